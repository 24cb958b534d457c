"""What the simulator runs on: model shapes and GPUs (sizes and nominal rates), and the links between tiers.

Rates are GB/s (1e9 bytes/s) and TFLOP/s; sizes GiB. A GPU's *nominal* HBM bandwidth and bf16 peak are its
datasheet's; the simulator scales them by what kvtier measured on its own GPU against that GPU's datasheet
(:class:`kvtier.sim.costs.StepCosts`), so an H100 is assumed to reach the same share of its datasheet as the
H200 did.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.errors import ConfigError


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape: ``layers``, query / kv heads, ``head_dim``, ``params`` (weights)."""

    name: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    params: float

    def kv_token_bytes(self, kv_bytes: float = 2.0) -> float:
        """KV bytes of one token over all layers (seed 000's M_token = 2·L·N_kv·D·P_bytes)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * kv_bytes

    def linear_flops(self, tokens: float) -> float:
        """FLOPs of the weight matmuls for ``tokens`` tokens (2 per parameter per token)."""
        return 2.0 * self.params * tokens

    def attention_flops(self, tokens: float, prefix: float) -> float:
        """FLOPs of causal attention (QK^T and PV) for ``tokens`` new tokens after ``prefix`` cached ones."""
        return 4.0 * self.layers * self.q_heads * self.head_dim * tokens * (prefix + (tokens + 1) / 2)


MODELS = {  # the shapes kvtier's benches ran, and seeds 000-002's 70B
    "llama8b-shape": ModelShape("llama8b-shape", 32, 32, 8, 128, 7_241_732_096),  # bench/serve-s5.json params
    "smollm2": ModelShape("smollm2", 30, 9, 3, 64, 134_515_008),
    "llama70b": ModelShape("llama70b", 80, 64, 8, 128, 70.6e9),
}


@dataclass(frozen=True)
class Gpu:
    """One accelerator: ``hbm_gib`` of HBM, datasheet HBM bandwidth (GB/s) and dense bf16 peak (TFLOP/s)."""

    name: str
    hbm_gib: float
    hbm_GBps: float
    bf16_tflops: float


GPUS = {
    "H200": Gpu("H200", 141, 4800, 989),
    "H100": Gpu("H100 SXM5", 80, 3350, 989),
}


@dataclass(frozen=True)
class Link:
    """A path pages take: ``GBps`` each way and a fixed ``latency_us`` per transfer."""

    name: str
    GBps: float
    latency_us: float = 0.0

    def __post_init__(self):
        if not self.GBps > 0:
            raise ConfigError(f"link.{self.name}", f"bandwidth must be > 0 GB/s, got {self.GBps}")

    def seconds(self, nbytes: float) -> float:
        """Time to move ``nbytes`` over this link, alone on it."""
        return self.latency_us * 1e-6 + nbytes / (self.GBps * 1e9)


def model_named(name: str) -> ModelShape:
    if name not in MODELS:
        raise ConfigError("model", f"unknown model shape {name!r}; use one of {sorted(MODELS)}")
    return MODELS[name]

