"""torch.compile for the step's parts, with eager's rounding."""

from __future__ import annotations

import torch


def compile_step(fn, dynamic: bool):
    """``fn`` through ``torch.compile``, its fused kernels rounding each intermediate to the dtype eager gives it
    (Inductor's ``emulate_precision_casts``). Without that, a fused bf16 kernel keeps sums in fp32 that eager rounds,
    so where the graph is cut changes the result: a predictor's hook after a layer's attention changed the logits
    of a random-weight SmolLM2 by 44% (28% between compiled and eager), though identical in fp32
    (``python -m bench.prediction_exact`` checks it on a GPU: bench/RESULTS.md, "Recall")."""
    return torch.compile(fn, dynamic=dynamic, options={"emulate_precision_casts": True})


def make_room(entries: int) -> None:
    """Let dynamo compile ``entries`` more specialisations of a function before it gives up on it. The attention
    hook breaks the model's graph at every attention call, so the attention module's forward is a frame of its own,
    specialised per layer index and per shape: an engine adds layers x (decode buckets + prompt forms) of them to
    that one function. Past dynamo's limits (by default 8, and 256 counting every specialisation of the function) a
    new one runs eager: unfused rotary and reshapes in every step of a bucket met late (a 24-row serving engine of
    32 layers met it)."""
    config = torch._dynamo.config
    config.recompile_limit += entries
    config.accumulated_recompile_limit += entries
