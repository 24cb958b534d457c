"""Which pages a fast decode step attends, chosen on the device with static shapes (no host work).

- ``all``: every page (``page_list=None``).
- ``resident``: the pages in the device pool, and the page being written.
- ``topk``: Quest (Tang et al., 2024, arXiv:2406.10774): per page, the upper bound of q·k from the
  page's elementwise key min/max; the ``k`` best pages per sequence, with the sink pages and the
  page being written always among them.
"""

from __future__ import annotations

import torch


def resident_pages(block_table: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """Page list ``[B, M]`` (logical page, -1 = skip) of device pages and pages from ``tail [B]`` on.

    ``block_table [B, M]`` int32 locations (>= 0: device slot; < 0: host).
    """
    logical = torch.arange(block_table.shape[1], device=block_table.device)  # [M]
    keep = (block_table >= 0) | (logical[None, :] >= tail[:, None])  # [B, M]
    return torch.where(keep, logical[None, :], -1).to(torch.int32)


class QuestBounds:
    """Elementwise key min/max per (layer, row, logical page): ``[L, B, M, N_kv, D]`` float32."""

    def __init__(self, num_layers: int, rows: int, max_pages: int, num_kv_heads: int, head_dim: int,
                 page_size: int, device):
        shape = (num_layers, rows, max_pages, num_kv_heads, head_dim)
        self.kmin = torch.full(shape, float("inf"), device=device)
        self.kmax = torch.full(shape, float("-inf"), device=device)
        self.page_size = page_size

    def reset_row(self, row: int) -> None:
        self.kmin[:, row] = float("inf")
        self.kmax[:, row] = float("-inf")

    def add_tokens(self, layer: int, row: int, keys: torch.Tensor, start: int) -> None:
        """Fold ``keys [q, N_kv, D]`` at positions ``start..`` of ``row`` into their pages (prefill)."""
        pages = (torch.arange(keys.shape[0], device=keys.device) + start) // self.page_size  # [q]
        idx = pages[:, None, None].expand_as(keys)
        self.kmin[layer, row].scatter_reduce_(0, idx, keys.float(), reduce="amin")
        self.kmax[layer, row].scatter_reduce_(0, idx, keys.float(), reduce="amax")

    def add_decode(self, layer: int, keys: torch.Tensor, positions: torch.Tensor) -> None:
        """Fold one key per row ``keys [B, N_kv, D]`` at ``positions [B]``; a page's first token resets it."""
        B = keys.shape[0]
        rows = torch.arange(B, device=keys.device)
        page = positions // self.page_size  # [B]
        fresh = (positions % self.page_size == 0)[:, None, None]  # [B, 1, 1]
        k = keys.float()
        lo, hi = self.kmin[layer, rows, page], self.kmax[layer, rows, page]  # [B, N_kv, D]
        self.kmin[layer, rows, page] = torch.where(fresh, k, torch.minimum(lo, k))
        self.kmax[layer, rows, page] = torch.where(fresh, k, torch.maximum(hi, k))

    def pick(self, layer: int, q: torch.Tensor, seq_lens: torch.Tensor, k: int, sink_pages: int,
             extra: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Page lists (ascending logical pages, -1 = none) for queries ``q [B, H, D]``: the ``k`` to attend
        ``[B, k]``, and the ``k + extra`` best (a prediction of the next steps' picks) ``[B, k + extra]``.

        ``seq_lens [B]`` counts the token being written; rows of length 0 list nothing.
        """
        B, H, D = q.shape
        kmin, kmax = self.kmin[layer, :B], self.kmax[layer, :B]  # [B, M, N_kv, D]
        n_kv, M = kmin.shape[2], kmin.shape[1]
        qg = q.float().view(B, n_kv, H // n_kv, D)  # [B, N_kv, G, D]
        bound = (torch.einsum("bkgd,bmkd->bmkg", qg.clamp(min=0), kmax)
                 + torch.einsum("bkgd,bmkd->bmkg", qg.clamp(max=0), kmin))  # [B, M, N_kv, G]
        score = bound.amax(dim=(2, 3))  # [B, M]
        logical = torch.arange(M, device=q.device)[None, :]  # [1, M]
        n_pages = (seq_lens.long() + self.page_size - 1) // self.page_size  # [B]
        forced = (logical < sink_pages) | (logical == n_pages[:, None] - 1)
        score = torch.where(forced, float("inf"), score)
        score = torch.where(logical < n_pages[:, None], score, float("-inf"))  # [B, M]
        best, idx = torch.topk(score, min(k + extra, M), dim=1)  # [B, k + extra], best first
        idx = torch.where(best > float("-inf"), idx, M)  # empty picks sort last
        return _ascending(idx[:, :k], M), _ascending(idx, M)


def _ascending(idx: torch.Tensor, M: int) -> torch.Tensor:
    """Logical pages ``idx [B, n]`` (``M`` = none) sorted ascending, none as -1, int32."""
    idx = torch.sort(idx, dim=1).values
    return torch.where(idx < M, idx, -1).to(torch.int32)
