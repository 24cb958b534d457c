"""Calibration: what the simulator knows of one GPU kind, read from kvtier's own bench JSONs.

Two kinds of figure, kept apart:

- **hardware**, measured by microbenchmarks on that kind (HBM read, bf16 matmul, pinned host link) or on the
  H200 host and carried to other kinds as a share of the datasheet (NCCL over NVLink, page copies over the host
  link, the Redis and Mooncake tiers' reads), and the all-reduce's latency and bus rate (``bench.collectives``
  where it ran; else the named assumption ``hardware.ALLREDUCE_LATENCY_US`` at the NCCL send rate, its
  ``source`` saying so): the hardware roofline runs on these alone;
- **kvtier's engine**, fitted on that kind's measured rows (:data:`PARAMS`, least squares on relative error over
  each group's anchor rows, :mod:`kvtier.sim.calibrate`) or measured by a kernel bench (``fp8_kv_x``): the
  multipliers and fixed costs by which kvtier's steps exceed the roofline, and its step-time noise.

``kvtier/sim/h100.json`` and ``h200.json`` ship; ``python -m kvtier.sim.calibrate --bench DIR --gpu KIND --out
FILE`` regenerates one. Rates in GB/s and TFLOP/s, times in ms, per-layer costs in us.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kvtier.errors import ConfigError
from kvtier.sim.hardware import GPUS

HERE = Path(__file__).resolve().parent
SHIPPED = {"H100": HERE / "h100.json", "H200": HERE / "h200.json"}

PARAMS = {  # group -> kvtier's engine parameters fitted on its anchor rows (every formula is affine in each)
    "decode": ("weights_x", "kv_x", "layer_us", "row_us", "tiered_ms"),
    "recall": ("choice_us", "choice_row_us", "miss_x"),
    "prefill": ("matmul_x", "attn_x", "chunk_layer_us"),
    "serving": ("step_ms",),
}
NOISE_Z99 = 2.326  # the 99th percentile of a standard normal: p99 / p50 = exp(2.326 sigma) for a lognormal


@dataclass
class Calibration:
    gpu: str  # the kind the rates were measured on, a kvtier.sim.hardware.GPUS key
    hbm_GBps: float  # HBM read (x.sum() over 4 GiB)
    bf16_tflops: float  # bf16 matmul
    host_GBps: float  # pinned host <-> device, one bulk copy, the slower way
    nvlink_GBps: float  # NCCL send of one layer's pages between two GPUs of a host
    allreduce: dict  # the all-reduce's alpha-beta line: latency_us, bus_GBps, and its source (calibrate.allreduce_line)
    page_copy_GBps: dict  # copy method -> [[page KiB, pages, GB/s host-to-device], ...] (bench/transfers.py)
    redis_read_GBps: float  # RedisTier batched reads (bench/redis_tier.py)
    pool_read_GBps: float  # MooncakeTier batched reads, TCP on one CPU box (bench/mooncake_tier.py)
    fp8_kv_x: float  # kvtier's FP8-page decode kernel: time per token over its bf16 kernel's (bench/results/kernels-s5.json)
    picks: dict = field(default_factory=dict)  # the recall cache's pick statistics (calibrate.pick_statistics)
    params: dict = field(default_factory=lambda: {g: dict.fromkeys(ks, 0.0) for g, ks in PARAMS.items()})
    noise: dict = field(default_factory=lambda: dict.fromkeys(PARAMS, 0.0))  # group -> sigma of ln(step time)
    anchors: dict = field(default_factory=dict)  # group -> ids of the rows it was fitted on
    fitted_on: str = ""  # the kind whose rows the engine parameters were fitted on ("" = this kind's)
    source: str = ""  # the bench files read

    def __post_init__(self):
        if self.gpu not in GPUS:
            raise ConfigError("calibration.gpu", f"unknown GPU {self.gpu!r}; use one of {sorted(GPUS)}")
        for group, keys in PARAMS.items():
            missing = set(keys) - set(self.params.get(group, {}))
            if missing:
                raise ConfigError(f"calibration.params.{group}", f"lacks {sorted(missing)}; regenerate the file "
                                                                  "with python -m kvtier.sim.calibrate")
        for key in ("hbm_GBps", "bf16_tflops", "host_GBps", "nvlink_GBps"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"calibration.{key}", f"must be > 0, got {getattr(self, key)!r}")
        if not (self.allreduce.get("latency_us", -1) >= 0 and self.allreduce.get("bus_GBps", 0) > 0):
            raise ConfigError("calibration.allreduce", f"needs latency_us >= 0 and bus_GBps > 0, got "
                                                       f"{self.allreduce!r}; regenerate it with python -m "
                                                       "kvtier.sim.calibrate")

    def efficiency(self) -> dict:
        """Measured rate / datasheet rate of this kind: HBM, bf16 matmul, NVLink."""
        sheet = GPUS[self.gpu]
        return {"hbm": self.hbm_GBps / sheet.hbm_GBps, "bf16": self.bf16_tflops / sheet.bf16_tflops,
                "nvlink": self.nvlink_GBps / sheet.nvlink_GBps}

    def on(self, gpu: str) -> Calibration:
        """This calibration carried to ``gpu``: the same efficiencies against its datasheet, the same engine."""
        a, b = GPUS[self.gpu], GPUS[gpu]
        nvlink = b.nvlink_GBps / a.nvlink_GBps
        return replace(self, gpu=gpu, hbm_GBps=self.hbm_GBps * b.hbm_GBps / a.hbm_GBps,
                       bf16_tflops=self.bf16_tflops * b.bf16_tflops / a.bf16_tflops,
                       nvlink_GBps=self.nvlink_GBps * nvlink,
                       allreduce={**self.allreduce, "bus_GBps": self.allreduce["bus_GBps"] * nvlink},
                       fitted_on=self.fitted_on or self.gpu)

    def with_engine(self, other: Calibration) -> Calibration:
        """This kind's hardware with ``other``'s engine parameters (fitted on another kind's rows)."""
        return replace(self, params={g: dict(v) for g, v in other.params.items()}, noise=dict(other.noise),
                       anchors={}, fitted_on=other.fitted_on or other.gpu)

    def page_copy_efficiency(self, page_KiB: float, method: str = "kernel") -> float:
        """Share of the bulk host link rate that ``method`` reached copying many pages of about ``page_KiB`` (the
        measured page size nearest in log scale, its largest batch)."""
        rows = self.page_copy_GBps[method]
        size = min({r[0] for r in rows}, key=lambda k: abs(math.log(k / page_KiB)))
        return max(r for r in rows if r[0] == size)[2] / self.host_GBps

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")


def load_calibration(which: str | Path | None = None) -> Calibration:
    """The calibration ``which``: a kind shipped with kvtier (``"H100"``, ``"H200"``; None: the H100, the seeds'
    GPU) or a JSON path."""
    path = SHIPPED.get(str(which or "H100").upper(), Path(str(which)))
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError("calibration", f"{path} not found; use H100 or H200, or write a file with python -m "
                                         "kvtier.sim.calibrate") from None
    except json.JSONDecodeError as e:
        raise ConfigError("calibration", f"{path} is not JSON ({e})") from None
    try:
        return Calibration(**raw)
    except TypeError as e:
        raise ConfigError("calibration", f"{path}: {e}; regenerate it with python -m kvtier.sim.calibrate") from None
