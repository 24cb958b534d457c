"""The seeds' hardware as the simulator builds it: Llama-3-70B on 8-GPU H100 nodes, one tensor-parallel instance
per GPU group, each figure that kvtier did not measure named here as an assumption (with what it stands on).

Every scenario builds its instances twice (:func:`seed_costs`): on **kvtier's engine** (the calibration's fitted
overheads; bf16 weights, since kvtier multiplies no FP8 weights, and its measured FP8-page kernel) and on the
**hardware roofline** (the measured rates alone; FP8 weights at the FP8 peak where the seed says FP8).
"""

from __future__ import annotations

from kvtier.sim.calibration import Calibration
from kvtier.sim.costs import StepCosts
from kvtier.sim.hardware import ALLREDUCE_LATENCY_US, MODELS

HBM_RESERVED = 0.10  # assumption: share of HBM kept for activations, workspace and the CUDA context (vLLM's
#                      default gpu_memory_utilization is 0.9)
CXL_GBPS = 256.0  # seed 000's tier 2: "256-512 GB/s" per node (the low end); kvtier measured no CXL link
ROCE_GBPS = 85.0  # seed 001: 800 Gb/s per node, "about 85 GB/s effective"
NIC_GBPS = 340.0  # assumption: 8 x 400 Gb/s RDMA NICs per node at seed 001's 85% efficiency (Mooncake's store)
SSD_GBPS = 24.0  # assumption: 4 NVMe drives per node at ~6 GB/s each (PCIe 4 x4 sequential reads)
DRAM_KV_GIB = 1024.0  # assumption: host DRAM per node given to KV (a 2 TiB node, half of it)
SSD_KV_GIB = 8192.0  # assumption: NVMe per node given to KV (4 x 2 TiB)
ASSUMPTIONS = {"HBM reserved": HBM_RESERVED,
               "all-reduce latency (us), unless bench.collectives ran": ALLREDUCE_LATENCY_US,
               "CXL GB/s per node": CXL_GBPS, "RoCE GB/s per node": ROCE_GBPS, "NIC GB/s per node": NIC_GBPS,
               "SSD GB/s per node": SSD_GBPS, "DRAM GiB per node for KV": DRAM_KV_GIB,
               "SSD GiB per node for KV": SSD_KV_GIB}


def seed_costs(cal: Calibration, engine: bool, tp: int = 8, fp8_kv: bool = False,
               fp8_weights: bool = False) -> StepCosts:
    """Llama-3-70B on ``tp`` GPUs of ``cal``'s kind: on kvtier's engine (bf16 weights whatever ``fp8_weights``:
    kvtier multiplies none in FP8) or on the hardware roofline."""
    return StepCosts(cal, MODELS["llama70b"], tp=tp, kv_bytes=1.0 if fp8_kv else 2.0,
                     weight_bytes=1.0 if fp8_weights and not engine else 2.0, engine=engine)


def kv_room_tokens(costs: StepCosts) -> int:
    """KV tokens the instance's HBM holds once its share of the weights is in."""
    per_gpu = costs.gpu_sheet.hbm_gib * 2**30 * (1 - HBM_RESERVED) - costs.model.params * costs.weight_bytes / costs.tp
    return max(0, int(per_gpu / costs.token_bytes()))
