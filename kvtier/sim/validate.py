"""Validation: the simulator's step costs against every timed bench row, with the error per row.

``python -m kvtier.sim.validate [--calibration FILE] [--bench DIR]`` prints the table (markdown). Rows a
calibration group was fitted on are marked ``fit``; the targets (median error <= 10%, worst <= 25%) are read
on the held-out rows.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from kvtier.sim.calibration import Calibration, load_calibration
from kvtier.sim.costs import StepCosts
from kvtier.sim.hardware import GPUS, model_named
from kvtier.sim.measured import Measured, measured_rows, read_bench

TARGET_MEDIAN, TARGET_WORST = 0.10, 0.25
PAGE = 16  # tokens per page in bench/e2e.py


def costs_for(cal: Calibration, model: str) -> StepCosts:
    """Step costs of ``model`` on the calibrated GPU itself."""
    return StepCosts(cal, model_named(model), GPUS[cal.gpu])


def predict(row: Measured, cal: Calibration) -> float:
    """The simulated time (ms) of ``row``'s configuration."""
    c, k = costs_for(cal, row.case["model"]), row.case
    if row.kind == "decode":
        B, S, scope = k["batch"], k["context"], k["scope"]
        if scope == "all":
            return c.decode_ms(B, B * S)
        off = B * S * (1 - k["budget"]) / PAGE  # pages off the device
        if scope == "resident":  # attends the device pages: the budget's share
            return c.decode_ms(B, B * S * k["budget"], tiered=True, off_pages=off, miss_MB=k["moved_MB"])
        return c.decode_ms(B, B * S * k["budget"] / 2, tiered=True, off_pages=off, recall=True,
                           miss_MB=k["moved_MB"])  # k = half the budget
    if row.kind == "prefill":
        return c.prompt_ms(k["prompt"], k["cached"], k["chunk"])
    if row.kind == "mixed":  # one decode step of the batch, plus the iteration's prefill chunk (mean over the prompt)
        step = c.decode_ms(k["batch"], k["batch"] * k["context"], serve=True)
        if not k["chunk"]:
            return step
        return step + c.prompt_ms(k["prompt"], 0, k["chunk"]) / -(-k["prompt"] // k["chunk"])
    if row.kind == "disagg":  # the last layer of the last chunk lands after the prefill ends
        return c.prompt_ms(k["prompt"], 0, k["chunk"]) + k["layer_bytes"] / (cal.nccl_GBps * 1e6)
    raise ValueError(f"unknown row kind {row.kind!r}")


@dataclass
class Checked:
    row: Measured
    predicted_ms: float
    fitted: bool  # a calibration group was fitted on this row

    @property
    def error(self) -> float:
        return self.predicted_ms / self.row.ms - 1


def check_rows(cal: Calibration, rows: list[Measured]) -> list[Checked]:
    fitted = {i for ids in cal.anchors.values() for i in ids}
    return [Checked(r, predict(r, cal), r.id in fitted) for r in rows]


def summary(checked: list[Checked]) -> dict:
    """Median and worst |error| over the held-out rows and over all rows; whether the targets are met."""
    held = [abs(c.error) for c in checked if not c.fitted]
    every = [abs(c.error) for c in checked]
    out = {"held_out": len(held), "rows": len(every),
           "median_held_out": float(np.median(held)), "worst_held_out": float(np.max(held)),
           "median_all": float(np.median(every)), "worst_all": float(np.max(every))}
    out["met"] = out["median_held_out"] <= TARGET_MEDIAN and out["worst_held_out"] <= TARGET_WORST
    return out


def table(checked: list[Checked]) -> str:
    lines = ["| row | measured ms | simulated ms | error | |", "| --- | ---: | ---: | ---: | --- |"]
    for c in checked:
        lines.append(f"| {c.row.id} | {c.row.ms:,.2f} | {c.predicted_ms:,.2f} | {c.error:+.1%} | "
                     f"{'fit' if c.fitted else 'held out'} |")
    s = summary(checked)
    lines.append(f"\nheld out: {s['held_out']} rows, median |error| {s['median_held_out']:.1%}, worst "
                 f"{s['worst_held_out']:.1%} (targets {TARGET_MEDIAN:.0%} / {TARGET_WORST:.0%}: "
                 f"{'met' if s['met'] else 'missed'}); all {s['rows']} rows: median {s['median_all']:.1%}, "
                 f"worst {s['worst_all']:.1%}")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m kvtier.sim.validate", description=__doc__.splitlines()[0])
    p.add_argument("--calibration", default=None, help="calibration JSON (default: the shipped H200 one)")
    p.add_argument("--bench", default="bench", help="folder of the bench JSONs")
    a = p.parse_args(argv)
    cal = load_calibration(a.calibration)
    print(table(check_rows(cal, measured_rows(read_bench(a.bench)))))


if __name__ == "__main__":
    main()
