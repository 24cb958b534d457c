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
    """Elementwise key min/max per (layer, row, logical page): ``[L, B, M, N_kv, D]`` float32.

    ``compile``: the per-layer work runs as torch.compile'd kernels (a few fused launches instead of
    tens of small ones; the same code for every layer, so it compiles once per batch bucket).
    """

    def __init__(self, num_layers: int, rows: int, max_pages: int, num_kv_heads: int, head_dim: int,
                 page_size: int, device, compile: bool = False):
        shape = (num_layers, rows, max_pages, num_kv_heads, head_dim)
        self.kmin = torch.full(shape, float("inf"), device=device)
        self.kmax = torch.full(shape, float("-inf"), device=device)
        self.page_size = page_size
        self._fold = torch.compile(fold_decode_keys, dynamic=False) if compile else fold_decode_keys
        self._pick = torch.compile(quest_pick, dynamic=False) if compile else quest_pick

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
        self._fold(self.kmin[layer, :B], self.kmax[layer, :B], keys, positions, self.page_size)

    def pick(self, layer: int, q: torch.Tensor, seq_lens: torch.Tensor, k: int, sink_pages: int,
             extra: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Page lists (ascending logical pages, -1 = none) for queries ``q [B, H, D]``: the ``k`` to attend
        ``[B, k]``, and the ``k + extra`` best (a prediction of the next steps' picks) ``[B, k + extra]``.

        ``seq_lens [B]`` counts the token being written; rows of length 0 list nothing.
        """
        B = q.shape[0]
        return self._pick(q, self.kmin[layer, :B], self.kmax[layer, :B], seq_lens, k, sink_pages, extra,
                          self.page_size)


def fold_decode_keys(kmin: torch.Tensor, kmax: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                     page_size: int) -> None:
    """``kmin``/``kmax [B, M, N_kv, D]`` (in place) take each row's key ``keys [B, N_kv, D]`` at ``positions [B]``."""
    rows = torch.arange(keys.shape[0], device=keys.device)
    page = positions // page_size  # [B]
    fresh = (positions % page_size == 0)[:, None, None]  # [B, 1, 1]
    k = keys.float()
    lo, hi = kmin[rows, page], kmax[rows, page]  # [B, N_kv, D]
    kmin[rows, page] = torch.where(fresh, k, torch.minimum(lo, k))
    kmax[rows, page] = torch.where(fresh, k, torch.maximum(hi, k))


def quest_pick(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, seq_lens: torch.Tensor, k: int,
               sink_pages: int, extra: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`QuestBounds.pick` on one layer's bounds ``kmin``/``kmax [B, M, N_kv, D]``."""
    B, H, D = q.shape
    n_kv, M = kmin.shape[2], kmin.shape[1]
    qg = q.float().view(B, n_kv, H // n_kv, D)  # [B, N_kv, G, D]
    bound = (torch.einsum("bkgd,bmkd->bmkg", qg.clamp(min=0), kmax)
             + torch.einsum("bkgd,bmkd->bmkg", qg.clamp(max=0), kmin))  # [B, M, N_kv, G]
    score = bound.amax(dim=(2, 3))  # [B, M]
    logical = torch.arange(M, device=q.device)[None, :]  # [1, M]
    n_pages = (seq_lens.long() + page_size - 1) // page_size  # [B]
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
