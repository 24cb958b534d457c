"""A prefill chunk's causal attention over its own tokens, from their contiguous K/V (cuDNN), with LSE out.

The first chunk of a cold prompt sees only its own tokens: the engine's prefill (:mod:`kvtier.engine.prefill`) runs
its causal call here rather than over its pages. The K/V are the step's own (the values its pages hold when the
pool stores them unscaled), read contiguous: on an H100, 8k tokens, 32/8 heads of 128, cuDNN takes 0.95 ms a layer
where the paged Triton kernel takes 1.37 (bench/RESULTS.md, "Kernels"). cuDNN takes the kv heads of GQA as they
are (repeating them first cost 0.1 ms a layer, with identical output).
"""

from __future__ import annotations

import torch

HALF = (torch.bfloat16, torch.float16)


def runs_own_causal(device: torch.device, dtype: torch.dtype) -> bool:
    """The kernel runs here: a CUDA device with cuDNN, half-precision K/V."""
    return device.type == "cuda" and dtype in HALF and torch.backends.cudnn.is_available()


def own_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of one chunk's queries ``q [T, H, D]`` over its keys and values ``k, v [T, N_kv, D]``:
    ``(out [T, H, D], lse [T, H] float32, natural log)``."""
    T, H, _ = q.shape
    q4, k4, v4 = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, H or N_kv, T, D], strided views; GQA as it is
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q4, k4, v4, None, True, 0.0, True, False,
                                                                   scale=scale)[:2]
    return out[0].transpose(0, 1), lse.reshape(H, T).transpose(0, 1).float()  # [T, H, D], [T, H]
