"""LSE merge of partial attention states (seed 001): exact softmax over a union of key sets."""

from __future__ import annotations

import torch


def merge_stacked(out: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype | None = None):
    """Combine attention over ``S`` disjoint key sets: out ``[S, N, H, D]``, lse ``[S, N, H]`` (natural log, -inf
    for an empty set). Returns ``(out [N, H, D] in dtype (default out's), lse [N, H] float32)``."""
    lse = lse.float()
    top = lse.amax(0)  # [N, H]
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp(lse - top)  # [S, N, H]; 0 where a set is empty
    total = w.sum(0)  # [N, H]
    merged = (w.unsqueeze(-1) * out.float()).sum(0) / total.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(-1)
    return merged.to(dtype or out.dtype), torch.where(total > 0, top + torch.log(total), float("-inf"))


def merge_many(parts: list):
    """:func:`merge_stacked` over ``[(out [N, H, D], lse [N, H]), ...]`` (out in the first part's dtype); a single
    part is returned as is."""
    if len(parts) == 1:
        return parts[0]
    return merge_stacked(torch.stack([o.float() for o, _ in parts]), torch.stack([l.float() for _, l in parts]),
                         parts[0][0].dtype)
