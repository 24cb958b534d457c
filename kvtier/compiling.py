"""torch.compile for the step's parts, with eager's rounding."""

from __future__ import annotations

import torch


def compile_step(fn, dynamic: bool):
    """``fn`` through ``torch.compile``, its fused kernels rounding each intermediate to the dtype eager gives it
    (Inductor's ``emulate_precision_casts``). Without that, a fused bf16 kernel keeps sums in fp32 that eager rounds,
    so where the graph is cut changes the result: a predictor's hook after a layer's attention changed the logits
    of a random-weight SmolLM2 by 44% (28% between compiled and eager), though identical in fp32
    (``bench/RESULTS.md``, session 30)."""
    return torch.compile(fn, dynamic=dynamic, options={"emulate_precision_casts": True})
