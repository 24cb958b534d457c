"""LSE merge of partial attention states (seed 001): exact softmax over a union of key sets."""

from __future__ import annotations

import torch


def merge_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """Combine attention over disjoint key sets A and B.

    out_* ``[N, H, D]``, lse_* ``[N, H]`` (natural log, -inf for an empty set). Returns
    ``(out [N, H, D] in out_a's dtype, lse [N, H] float32)``.
    """
    lse_a, lse_b = lse_a.float(), lse_b.float()
    lse = torch.logaddexp(lse_a, lse_b)  # [N, H]
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w_a = torch.exp(lse_a - safe).unsqueeze(-1)  # [N, H, 1]; 0 where A is empty
    w_b = torch.exp(lse_b - safe).unsqueeze(-1)
    out = w_a * out_a.float() + w_b * out_b.float()  # [N, H, D]
    return out.to(out_a.dtype), lse


def merge_many(parts: list):
    """Fold :func:`merge_states` over ``[(out, lse), ...]``; a single part is returned as is."""
    out, lse = parts[0]
    for o, l in parts[1:]:
        out, lse = merge_states(out, lse, o, l)
    return out, lse
