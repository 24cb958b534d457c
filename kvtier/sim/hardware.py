"""What the simulator runs on: model shapes, GPUs as their datasheets give them, and the links between them.

Rates are GB/s (1e9 bytes/s) and TFLOP/s (dense); sizes GiB. A datasheet is never what a GPU reaches: the
simulator reads each kind's *measured* rates from its calibration (:mod:`kvtier.sim.calibration`) and uses a
datasheet only to report efficiencies (measured / datasheet) and to carry an efficiency to a kind nothing was
measured on.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.errors import ConfigError


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape: ``layers``, query / kv heads, ``head_dim``, ``params`` (all weights), the embedding's
    ``vocab`` x ``hidden``, and whether the output head is ``tied`` to it."""

    name: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    params: float
    vocab: int
    hidden: int
    tied: bool = False

    def kv_token_bytes(self, kv_bytes: float = 2.0) -> float:
        """KV bytes of one token over all layers (seed 000's M_token = 2·L·N_kv·D·P_bytes)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * kv_bytes

    @property
    def decode_params(self) -> float:
        """Weights one decode step reads: every one once, bar an untied input embedding (its rows only)."""
        return self.params - (0 if self.tied else self.vocab * self.hidden)

    @property
    def matmul_params(self) -> float:
        """Weights a prompt token multiplies: the embedding and the output head left out (one token's logits)."""
        return self.params - self.vocab * self.hidden * (1 if self.tied else 2)

    def attention_flops(self, tokens: float, prefix: float) -> float:
        """FLOPs of causal attention (QK^T and PV) for ``tokens`` new tokens after ``prefix`` cached ones."""
        return 4.0 * self.layers * self.q_heads * self.head_dim * tokens * (prefix + (tokens + 1) / 2)


MODELS = {  # the shapes kvtier's benches ran (bench/common.py, the real SmolLM2), and the seeds' Llama-3-70B
    "llama8b-shape": ModelShape("llama8b-shape", 32, 32, 8, 128, 7_241_732_096, 32_000, 4096),
    "smollm2": ModelShape("smollm2", 30, 9, 3, 64, 134_515_008, 49_152, 576, tied=True),
    "llama70b": ModelShape("llama70b", 80, 64, 8, 128, 70_553_706_496, 128_256, 8192),
}


@dataclass(frozen=True)
class Gpu:
    """One accelerator's datasheet: ``hbm_gib`` of HBM (as the driver reports it), HBM bandwidth, dense bf16 and
    FP8 peaks, NVLink bandwidth each way."""

    name: str
    hbm_gib: float
    hbm_GBps: float
    bf16_tflops: float
    fp8_tflops: float
    nvlink_GBps: float


GPUS = {  # NVIDIA's H100 SXM5 and H200 datasheets (dense, no sparsity); HBM as nvidia-smi reports it
    "H100": Gpu("H100 SXM5", 79.6, 3350, 989.5, 1979, 450),
    "H200": Gpu("H200 SXM", 140.4, 4800, 989.5, 1979, 450),
}


ALLREDUCE_LATENCY_US = 10.0  # assumption: one small NCCL all-reduce within an NVLink node, where bench.collectives
#                             has not run (kvtier.sim.calibrate.allreduce_line)


@dataclass(frozen=True)
class Link:
    """A path bytes take: ``GBps`` each way and a fixed ``latency_us`` per transfer (the alpha-beta model)."""

    name: str
    GBps: float
    latency_us: float = 0.0

    def __post_init__(self):
        if not self.GBps > 0:
            raise ConfigError(f"link.{self.name}", f"bandwidth must be > 0 GB/s, got {self.GBps}")
        if self.latency_us < 0:
            raise ConfigError(f"link.{self.name}", f"latency must be >= 0 us, got {self.latency_us}")

    def seconds(self, nbytes: float) -> float:
        """Time to move ``nbytes`` over this link, alone on it."""
        return self.latency_us * 1e-6 + nbytes / (self.GBps * 1e9)


def allreduce_s(nbytes: float, gpus: int, link: Link) -> float:
    """A ring all-reduce of ``nbytes`` over ``gpus`` GPUs on ``link``: its latency once, and each GPU sends and
    receives 2 (p - 1) / p of the bytes at the link's rate (NCCL's bus bandwidth)."""
    if gpus <= 1:
        return 0.0
    return link.latency_us * 1e-6 + 2 * (gpus - 1) / gpus * nbytes / (link.GBps * 1e9)


def model_named(name: str) -> ModelShape:
    if name not in MODELS:
        raise ConfigError("model", f"unknown model shape {name!r}; use one of {sorted(MODELS)}")
    return MODELS[name]


def gpu_named(name: str) -> Gpu:
    if name not in GPUS:
        raise ConfigError("gpu", f"unknown GPU {name!r}; use one of {sorted(GPUS)}")
    return GPUS[name]
