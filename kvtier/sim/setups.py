"""The seeds' hardware, as the simulator builds it: Llama-3-70B on 8-GPU H100 nodes (seeds 000-002), one tensor-
parallel instance per GPU group. Figures the benches do not measure are named assumptions here."""

from __future__ import annotations

from kvtier.sim.calibration import Calibration
from kvtier.sim.costs import StepCosts
from kvtier.sim.hardware import GPUS, MODELS

ALLREDUCE_US = 10.0  # assumption: one NVLink all-reduce of a decode step's activations (~10 us, NCCL small messages)
HBM_RESERVED = 0.10  # assumption: share of HBM kept for activations, workspace and the CUDA context


def seed_costs(cal: Calibration, tp: int = 8, kv_bytes: float = 2.0, weight_bytes: float = 2.0) -> StepCosts:
    """Llama-3-70B on ``tp`` H100s, KV at ``kv_bytes`` and weights at ``weight_bytes`` per element."""
    return StepCosts(cal, MODELS["llama70b"], GPUS["H100"], tp=tp, kv_bytes=kv_bytes, allreduce_us=ALLREDUCE_US,
                     weight_bytes=weight_bytes)


def kv_room_tokens(costs: StepCosts) -> int:
    """KV tokens the instance's HBM holds once its share of the weights is in."""
    per_gpu = costs.gpu.hbm_gib * 2**30 * (1 - HBM_RESERVED) - costs.model.params * costs.weight_bytes / costs.tp
    return max(0, int(per_gpu / costs.token_bytes()))
