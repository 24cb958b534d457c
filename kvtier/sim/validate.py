"""Validation: the simulator's step costs against kvtier's measured rows, on the GPU kind it was fitted on and
across kinds.

``python -m kvtier.sim.validate [--bench DIR] [--json PATH]`` prints the tables (markdown) and writes, as
fractions: ``median_error`` and ``worst_error`` (|predicted / measured - 1| over the held-out rows of both kinds,
each calibrated on its own anchors), ``same_gpu`` (per kind, every row) and ``cross_hardware``: the engine
fitted on one kind's anchors predicts every row of the other, given that kind's measured hardware rates (and,
under ``datasheet``, given only its datasheet and the fitted kind's efficiencies). Targets: median <= 10%,
worst <= 25%.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier.sim.calibrate import calibrate
from kvtier.sim.calibration import Calibration
from kvtier.sim.measured import BENCH_DIR, GROUPS, Measured, measured_rows, predict

TARGET_MEDIAN, TARGET_WORST = 0.10, 0.25
KINDS = ("H200", "H100")


@dataclass
class Checked:
    row: Measured
    predicted_ms: float
    held_out: bool

    @property
    def error(self) -> float:
        return self.predicted_ms / self.row.ms - 1


def check_rows(cal: Calibration, rows: list[Measured], all_held_out: bool = False) -> list[Checked]:
    return [Checked(r, predict(r, cal), all_held_out or r.held_out) for r in rows]


def summary(checked: list[Checked]) -> dict:
    """Median and worst |error| over the held-out rows, per group too; whether the targets are met."""
    held = [c for c in checked if c.held_out]
    errs = np.abs([c.error for c in held])
    out = {"held_out": len(held), "median_error": float(np.median(errs)), "worst_error": float(errs.max()),
           "groups": {g: float(np.max(np.abs([c.error for c in held if c.row.group == g])))
                      for g in GROUPS if any(c.row.group == g for c in held)}}
    out["met"] = out["median_error"] <= TARGET_MEDIAN and out["worst_error"] <= TARGET_WORST
    return out


def rows_json(checked: list[Checked]) -> list[dict]:
    return [{"id": c.row.id, "group": c.row.group, "measured_ms": c.row.ms, "predicted_ms": c.predicted_ms,
             "error": c.error, "held_out": c.held_out, "source": c.row.source} for c in checked]


def table(checked: list[Checked], title: str) -> str:
    lines = [f"{title}\n", "| group | row | measured ms | simulated ms | error | |",
             "| --- | --- | ---: | ---: | ---: | --- |"]
    for c in checked:
        lines.append(f"| {c.row.group} | {c.row.id} | {c.row.ms:,.2f} | {c.predicted_ms:,.2f} | {c.error:+.1%} | "
                     f"{'held out' if c.held_out else 'fit'} |")
    s = summary(checked)
    lines.append(f"\nheld out: {s['held_out']} rows, median |error| {s['median_error']:.1%}, worst "
                 f"{s['worst_error']:.1%} (targets {TARGET_MEDIAN:.0%} / {TARGET_WORST:.0%}: "
                 f"{'met' if s['met'] else 'missed'}); worst per group: "
                 + ", ".join(f"{g} {e:.1%}" for g, e in s["groups"].items()))
    return "\n".join(lines)


def validation(folder: str | Path = BENCH_DIR) -> dict:
    """Same-GPU and cross-hardware checks of every kind's rows (see the module docstring); ``tables`` holds them."""
    cals = {kind: calibrate(folder, kind) for kind in KINDS}
    rows = {kind: measured_rows(folder, kind) for kind in KINDS}
    same = {kind: check_rows(cals[kind], rows[kind]) for kind in KINDS}
    out: dict = {"same_gpu": {}, "cross_hardware": {}, "cross_hardware_datasheet": {}, "tables": []}
    for kind in KINDS:
        out["same_gpu"][kind] = {**summary(same[kind]), "rows": rows_json(same[kind])}
        out["tables"].append(table(same[kind], f"{kind}: fitted on its own anchors"))
    pooled = summary(same["H200"] + same["H100"])
    out["median_error"], out["worst_error"] = pooled["median_error"], pooled["worst_error"]
    for key, hardware in (("cross_hardware", lambda src, dst: cals[dst].with_engine(cals[src])),
                          ("cross_hardware_datasheet", lambda src, dst: cals[src].on(dst))):
        both = []
        for src, dst in ((KINDS[0], KINDS[1]), (KINDS[1], KINDS[0])):
            checked = check_rows(hardware(src, dst), rows[dst], all_held_out=True)
            both += checked
            out[key][f"{src}->{dst}"] = {**summary(checked), "rows": rows_json(checked)}
            how = "its measured rates" if key == "cross_hardware" else f"the {src}'s efficiencies on its datasheet"
            out["tables"].append(table(checked, f"{dst} predicted by the engine fitted on the {src}, {how}"))
        s = summary(both)
        out[key].update(median_error=s["median_error"], worst_error=s["worst_error"], met=s["met"])
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m kvtier.sim.validate", description=__doc__.splitlines()[0])
    p.add_argument("--bench", default=BENCH_DIR, help="folder of the bench JSONs")
    p.add_argument("--json", default=None, help="write the figures here")
    a = p.parse_args(argv)
    v = validation(a.bench)
    print("\n\n".join(v.pop("tables")))
    print(f"\nsame GPU, held out (both kinds): median {v['median_error']:.1%}, worst {v['worst_error']:.1%}; "
          f"across kinds: median {v['cross_hardware']['median_error']:.1%}, worst "
          f"{v['cross_hardware']['worst_error']:.1%} (datasheet only: median "
          f"{v['cross_hardware_datasheet']['median_error']:.1%}, worst "
          f"{v['cross_hardware_datasheet']['worst_error']:.1%})")
    if a.json:
        Path(a.json).write_text(json.dumps(v, indent=1) + "\n")
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
