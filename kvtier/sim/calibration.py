"""Calibration: what the simulator knows of the hardware, read from kvtier's own bench JSONs.

A JSON file (``kvtier/sim/h200.json`` ships, from the session-5 H200 benches); regenerate it from your own
bench outputs with ``python -m kvtier.sim.calibrate --bench DIR --out FILE`` (:mod:`kvtier.sim.calibrate`).
Rates in GB/s and TFLOP/s, times in ms. ``params`` holds the fitted groups :class:`kvtier.sim.costs.StepCosts`
reads, ``anchors`` the bench rows each group was fitted on (every other row is held out).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvtier.errors import ConfigError
from kvtier.sim.hardware import GPUS

DEFAULT = Path(__file__).resolve().parent / "h200.json"

PARAMS = {  # group -> its parameters (StepCosts' formulas are linear in each)
    "decode": ("layer_ms", "weights_x", "row_layer_ms"),
    "tiered": ("plan_ms", "plan_us_per_page"),
    "recall": ("layer_ms", "stream_ms_per_MB"),
    "serve": ("step_ms",),
    "prefill": ("chunk_ms", "flops_x"),
}


@dataclass
class Calibration:
    gpu: str  # the GPU the benches ran on, a kvtier.sim.hardware.GPUS key
    hbm_GBps: float  # HBM read rate measured (x.sum over 4 GiB)
    bf16_tflops: float  # bf16 matmul rate measured
    host_GBps: float  # pinned host <-> device, one bulk copy, the slower way
    page_copy_GBps: dict  # copy method -> [[page KiB, pages, GB/s host-to-device], ...] (bench/transfers.py)
    nccl_GBps: float  # GPU-to-GPU send, one layer's pages (bench/disagg.py)
    redis_read_GBps: float  # RedisTier batched reads (bench/redis_tier.py)
    attention: dict  # kv dtype -> {"ms": per call, "GBps": KV read rate}: the decode kernel's line
    pick_churn: float  # share of a step's Quest top-k picks not held by a recall cache as big as the picks
    params: dict = field(default_factory=lambda: {g: dict.fromkeys(ks, 0.0) for g, ks in PARAMS.items()})
    anchors: dict = field(default_factory=dict)  # group -> ids of the rows it was fitted on
    source: str = ""  # the folder the JSONs were read from

    def __post_init__(self):
        if self.gpu not in GPUS:
            raise ConfigError("calibration.gpu", f"unknown GPU {self.gpu!r}; use one of {sorted(GPUS)}")
        for group, keys in PARAMS.items():
            missing = set(keys) - set(self.params.get(group, {}))
            if missing:
                raise ConfigError(f"calibration.params.{group}", f"lacks {sorted(missing)}; regenerate the file "
                                                                  "with python -m kvtier.sim.calibrate")
        for key in ("bf16", "fp8"):
            if set(self.attention.get(key, {})) != {"ms", "GBps"}:
                raise ConfigError(f"calibration.attention.{key}", "must hold 'ms' and 'GBps'")

    def page_copy_efficiency(self, page_KiB: float, method: str = "kernel") -> float:
        """Share of the bulk host link rate that ``method`` reached copying many pages of about ``page_KiB`` (the
        measured page size nearest in log scale, its largest batch)."""
        rows = self.page_copy_GBps[method]
        size = min({r[0] for r in rows}, key=lambda k: abs(math.log(k / page_KiB)))
        return max(r for r in rows if r[0] == size)[2] / self.host_GBps

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")


def load_calibration(path: str | Path | None = None) -> Calibration:
    """The calibration in ``path`` (None: the shipped H200 one)."""
    path = Path(path) if path is not None else DEFAULT
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError("calibration", f"{path} not found; write it with python -m kvtier.sim.calibrate") from None
    except json.JSONDecodeError as e:
        raise ConfigError("calibration", f"{path} is not JSON ({e})") from None
    try:
        return Calibration(**raw)
    except TypeError as e:
        raise ConfigError("calibration", f"{path}: {e}; regenerate it with python -m kvtier.sim.calibrate") from None
