"""kvtier's bench JSONs as rows the simulator predicts, one :class:`Measured` per configuration and GPU kind.

Which runs count, per kind (the device name each JSON records):

- ``bench.e2e`` (decode steps): every ``e2e*-sNN.json`` with NN >= 20 (the one engine's current decode path:
  the H200's last run of the Llama-shape grid is ``-s20``, the H100's runs are ``-s30`` to ``-s34``). A
  configuration (model, batch x context, scope, budget, recall-cache pages) is measured by its latest run number;
  several runs of it there give their median. Rows with a page predictor are left out: the simulator does not
  model prediction ahead.
- ``bench.serve`` (TTFT, ITL, one session alone): the latest run of each part on each kind (:data:`SERVE_FILES`).

A row's ``case`` holds what the run itself recorded where the time depends on it (a ``topk`` row's bytes moved
per step): the simulator predicts the time of a configuration given those statistics. ``spread`` is the run's
p99 / p50, the step-time noise the simulator draws from (:attr:`kvtier.sim.calibration.Calibration.noise`).
The hardware each kind's runs measured beside them (HBM read rate, bf16 matmul rate, pinned host link) is read
by :func:`hardware_rates`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvtier.errors import ConfigError
from kvtier.sim.calibration import Calibration
from kvtier.sim.costs import StepCosts
from kvtier.sim.hardware import model_named
from kvtier.sim.split import HELD_OUT

BENCH_DIR = "bench/results"  # the bench JSONs bench/RESULTS.md cites, from the repository root
GPU_KINDS = {"NVIDIA H200": "H200", "NVIDIA H100 80GB HBM3": "H100"}
FIRST_SESSION = 20
SERVE_FILES = {"H200": ("serve-s21-ttft.json", "serve-s24-itl.json", "serve-s22-goodput.json"),
               "H100": ("serve-s33-ttft-itl-final.json", "serve-s33-goodput.json")}
GROUPS = ("decode", "recall", "prefill", "serving")
PAGE = 16  # tokens per page in bench.e2e
MIN_TOPK_PAGES = 16  # bench.e2e: topk attends max(pages x budget // 2, 16) pages per sequence


@dataclass(frozen=True)
class Measured:
    """One measured configuration: ``group`` (decode | recall | prefill | serving), ``case``, ``ms`` (p50)."""

    id: str
    group: str
    ms: float
    case: dict = field(default_factory=dict, hash=False)
    spread: float = 1.0  # p99 / p50 of the run (1: not recorded)
    source: str = ""  # the JSON file(s)

    @property
    def held_out(self) -> bool:
        return self.id in HELD_OUT[self.group]


def read_json(path: Path) -> dict:
    """A bench JSON; a missing or unreadable one is a ConfigError naming it."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError("bench", f"{path} not found; point --bench at kvtier's {BENCH_DIR}") from None
    except json.JSONDecodeError as e:
        raise ConfigError("bench", f"{path} is not JSON ({e})") from None


def kind_of(device: str) -> str | None:
    return GPU_KINDS.get(device)


def _session(path: Path) -> int:
    m = re.search(r"-s(\d+)", path.stem)
    return int(m.group(1)) if m else 0


def e2e_files(folder: Path) -> list[Path]:
    return sorted(p for p in Path(folder).glob("e2e*.json") if _session(p) >= FIRST_SESSION)


def decode_rows(folder: str | Path, kind: str) -> list[Measured]:
    """The kvtier decode rows of ``bench.e2e`` on ``kind`` (TPOT p50 per step), latest session per configuration."""
    runs: dict[str, list] = {}
    for path in e2e_files(Path(folder)):
        d = read_json(path)
        if kind_of(d["gpu"]) != kind:
            continue
        for r in d["rows"]:
            if r.get("system") not in ("kvtier", "capacity-dense", "capacity-recall") or \
                    r.get("predictor") not in (None, "-"):
                continue
            topk = r["scope"] == "topk"
            rid = f"e2e {r['model']} {r['B']}x{r['S']} {r['scope']} {r['budget']:g}" + \
                (f" r{r['recall_slots']}" if topk else "")
            case = {"model": r["model"], "batch": r["B"], "context": r["S"], "scope": r["scope"],
                    "budget": r["budget"], "moved_MB": r["MB_moved_per_step"], "hit_rate": r["hit_rate"]}
            spread = r["tpot_p99_ms"] / r["tpot_p50_ms"] if r.get("tpot_p99_ms") else 1.0
            runs.setdefault(rid, []).append((_session(path), r["tpot_p50_ms"], spread, case, path.name))
    out = []
    for rid, rs in runs.items():
        last = max(s for s, *_ in rs)
        rs = [r for r in rs if r[0] == last]
        ms, spread = float(np.median([r[1] for r in rs])), float(np.median([r[2] for r in rs]))
        case = {k: (float(np.median([r[3][k] for r in rs])) if k in ("moved_MB", "hit_rate") else v)
                for k, v in rs[0][3].items()}
        group = "recall" if case["scope"] == "topk" else "decode"
        out.append(Measured(rid, group, ms, case, spread, ", ".join(sorted({r[4] for r in rs}))))
    return sorted(out, key=lambda m: (GROUPS.index(m.group), m.id))


def serve_rows(folder: str | Path, kind: str) -> list[Measured]:
    """``bench.serve`` on ``kind``: TTFT of a cold 8k prompt (one chunk, chunks of 512) and of its radix hit; ITL
    p50 of 16 decoders alone and beside prefill chunks; one session alone (TTFT, ITL p50)."""
    out = []
    for name in SERVE_FILES[kind]:
        d = read_json(Path(folder) / name)
        if kind_of(d["device"]) != kind:
            raise ConfigError("bench", f"{name} ran on {d['device']!r}, not an {kind}")
        sz, model = d["sizes"], {"model": "llama8b-shape"}
        for r in d["rows"]:
            part, system = r["part"], r["system"]
            if part.startswith("ttft") and not system.startswith("floor"):
                runs = r.get("runs_ms") or [r["ttft_ms"]]
                chunk = 512 if "512" in system else sz["long"] + 1
                out.append(Measured(f"serve {part} {system}", "prefill", r["ttft_ms"], {
                    **model, "prompt": sz["long"] + 1, "cached": r["cached_tokens"], "chunk": chunk},
                    max(runs) / min(runs), name))
            elif part.startswith("itl") and system.startswith("decode"):
                chunk = 0 if system == "decode only" else int(system.split("+ ")[1].split("-")[0])
                out.append(Measured(f"serve {part} {system}", "serving", r["itl_p50_ms"], {
                    **model, "batch": sz["batch"], "context": sz["ctx"], "chunk": chunk, "prompt": sz["long"]},
                    r["itl_p99_ms"] / r["itl_p50_ms"], name))
            elif system.startswith("1 session alone"):
                case = {**model, "prompt": sz["session"], "chunk": sz["budget"], "new": sz["new"]}
                out.append(Measured("serve goodput 1 session alone TTFT", "prefill", r["ttft_ms"],
                                    {**case, "cached": 0}, 1.0, name))
                out.append(Measured("serve goodput 1 session alone ITL", "serving", r["itl_p50_ms"],
                                    {**case, "chunk": 0, "batch": 1, "context": sz["session"] + sz["new"] // 2},
                                    1.0, name))
    return out


def measured_rows(folder: str | Path, kind: str) -> list[Measured]:
    """Every row of ``kind`` the simulator is validated on, by group."""
    rows = decode_rows(folder, kind) + serve_rows(folder, kind)
    return sorted(rows, key=lambda m: GROUPS.index(m.group))


def hardware_rates(folder: str | Path, kind: str) -> dict:
    """What ``kind``'s own runs measured of its hardware (medians over the runs :func:`measured_rows` reads):
    HBM read (``x.sum()`` over 4 GiB), bf16 matmul, pinned host link (one bulk copy, the slower way)."""
    e2e = [d for d in (read_json(p) for p in e2e_files(Path(folder))) if kind_of(d["gpu"]) == kind]
    serve = [read_json(Path(folder) / n) for n in SERVE_FILES[kind]]
    if not e2e:
        raise ConfigError("bench", f"no bench.e2e run of session {FIRST_SESSION} or later on an {kind}")
    return {"hbm_GBps": float(np.median([d["hbm_read_GBps"] for d in e2e])),
            "bf16_tflops": float(np.median([d["tflops"] for d in serve])),
            "host_GBps": float(np.median([min(d["link"].values()) for d in e2e]))}


def predict(row: Measured, cal: Calibration) -> float:
    """The simulated time (ms) of ``row``'s configuration on kvtier's engine."""
    k = row.case
    c = StepCosts(cal, model_named(k["model"]))
    if row.group in ("decode", "recall"):
        B, S = k["batch"], k["context"]
        if k["scope"] == "all":
            return c.decode_ms(B, B * S, serve=False)
        if k["scope"] == "resident":  # attends the device pages: the budget's share
            return c.resident_ms(B, B * S * k["budget"], k["moved_MB"])
        pages = max(int(S // PAGE * k["budget"]) // 2, MIN_TOPK_PAGES)
        return c.recall_ms(B, B * pages * PAGE, k["moved_MB"])
    if row.group == "prefill":
        return c.prompt_ms(k["prompt"], k["cached"], k["chunk"])
    keys = k["batch"] * k["context"]  # serving: one iteration's ITL, the median over the prompt's chunks beside it
    if not k["chunk"]:
        return c.decode_ms(k["batch"], keys)
    return float(np.median([c.iteration_ms(k["batch"], keys, [(min(k["chunk"], k["prompt"] - s), s)])
                            for s in range(0, k["prompt"], k["chunk"])]))
