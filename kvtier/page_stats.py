"""Per-page statistics the cache gathers for scopes and scorers (hook path, torch, on the cache's device).

- :class:`KeyStats`: per (layer, page, kv head) key min / max (Quest's bounds), key sum, squared-key
  sum, key-norm sum and token count, updated as keys are written.
- :class:`QueryStats`: the last ``rows`` decode queries of every layer (TOVA/Quest use the newest,
  Expected Attention their mean and variance).
- :func:`page_attention`: the exact attention probability mass each attended page receives from
  chosen query rows, from the keys of an attention call's pool and the merged LSE of the step (an
  extra torch pass over the attended pages; no attention matrix is kept).
"""

from __future__ import annotations

import numpy as np
import torch


def _grow(t: torch.Tensor, size: int, fill: float) -> torch.Tensor:
    """``t`` with dim 1 (pids) extended to at least ``size`` (doubling), new cells ``fill``."""
    cap = t.shape[1]
    if size <= cap:
        return t
    extra = max(size, 2 * cap) - cap
    return torch.cat([t, torch.full((t.shape[0], extra, *t.shape[2:]), fill, dtype=t.dtype, device=t.device)], 1)


class KeyStats:
    """Key statistics per (layer, pid, kv head): ``key_min``/``key_max``/``key_sum``/``key_sq`` are
    ``[L, pids, N_kv, D]``, ``norm_sum`` ``[L, pids, N_kv]``, ``count`` ``[L, pids]`` (float32)."""

    FILL = {"key_min": float("inf"), "key_max": float("-inf"), "key_sum": 0.0, "key_sq": 0.0, "norm_sum": 0.0,
            "count": 0.0}

    def __init__(self, layout, device):
        self.layout, self.device = layout, device
        L, N, D = layout.num_layers, layout.num_kv_heads, layout.head_dim
        shapes = {"key_min": (L, 64, N, D), "key_max": (L, 64, N, D), "key_sum": (L, 64, N, D),
                  "key_sq": (L, 64, N, D), "norm_sum": (L, 64, N), "count": (L, 64)}
        for name, shape in shapes.items():
            setattr(self, name, torch.full(shape, self.FILL[name], device=device))

    def _grow(self, size: int) -> None:
        for name, fill in self.FILL.items():
            setattr(self, name, _grow(getattr(self, name), size, fill))

    def on_append(self, pids: np.ndarray) -> None:
        """Fresh pages (a recycled pid forgets its keys)."""
        self._grow(int(pids.max()) + 1)
        idx = torch.from_numpy(pids).to(self.device)
        for name, fill in self.FILL.items():
            getattr(self, name)[:, idx] = fill

    def on_copy(self, src: int, dst: int) -> None:
        self._grow(max(src, dst) + 1)
        for name in self.FILL:
            t = getattr(self, name)
            t[:, dst] = t[:, src]

    def on_write(self, table, seqs, layer: int, keys: torch.Tensor, start: int) -> None:
        """Keys ``[B, N_kv, q, D]`` written at positions ``start..`` of each sequence."""
        P = self.layout.page_size
        pos = np.arange(start, start + keys.shape[2])
        for b, seq in enumerate(seqs):
            pids = torch.from_numpy(table.pages(seq)[pos // P]).to(self.device)  # [q]
            k = keys[b].transpose(0, 1).float().to(self.device)  # [q, N_kv, D]
            idx = pids[:, None, None].expand_as(k)
            self.key_min[layer].scatter_reduce_(0, idx, k, reduce="amin")
            self.key_max[layer].scatter_reduce_(0, idx, k, reduce="amax")
            self.key_sum[layer].index_add_(0, pids, k)
            self.key_sq[layer].index_add_(0, pids, k * k)
            self.norm_sum[layer].index_add_(0, pids, k.norm(dim=-1))
            self.count[layer].index_add_(0, pids, torch.ones_like(pids, dtype=torch.float32))

    def quest_bound(self, layer: int, q: torch.Tensor, pids: np.ndarray) -> torch.Tensor:
        """Quest's upper bound of q·k over each page's keys, per query head: ``[m, H]``. q ``[H, D]``."""
        idx = torch.from_numpy(pids).to(self.device)
        kmin, kmax = self.key_min[layer, idx], self.key_max[layer, idx]  # [m, N_kv, D]
        n_kv = self.layout.num_kv_heads
        qg = q.float().view(n_kv, q.shape[0] // n_kv, -1).to(self.device)  # [N_kv, G, D]
        ub = torch.maximum(qg[None] * kmin[:, :, None], qg[None] * kmax[:, :, None]).sum(-1)  # [m, N_kv, G]
        return ub.flatten(1)


class QueryStats:
    """The last ``rows`` decode queries per layer: ``ring [rows, L, H, D]`` float32 (NaN: none yet)."""

    def __init__(self, num_layers: int, rows: int, device):
        self.rows, self.num_layers, self.device = rows, num_layers, device
        self.ring: torch.Tensor | None = None
        self.seen = np.zeros(num_layers, dtype=np.int64)

    def add(self, layer: int, q: torch.Tensor) -> None:
        """The newest query row ``q [H, D]`` of ``layer``."""
        if self.ring is None:
            self.ring = torch.full((self.rows, self.num_layers, *q.shape), float("nan"), device=self.device)
        self.ring[self.seen[layer] % self.rows, layer] = q.float().to(self.device)
        self.seen[layer] += 1

    def last(self) -> torch.Tensor | None:
        """The newest query of every layer ``[L, H, D]`` (None before any decode step)."""
        if self.ring is None:
            return None
        return self.ring[torch.from_numpy((self.seen - 1) % self.rows), torch.arange(self.num_layers)]

    def moments(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Mean and variance of the stored queries ``[L, H, D]`` each (None before any decode step)."""
        if self.ring is None:
            return None
        seen = ~torch.isnan(self.ring)
        n = seen.sum(0).clamp_min(1)
        x = torch.where(seen, self.ring, 0.0)
        mean = x.sum(0) / n
        var = (torch.where(seen, (self.ring - mean) ** 2, 0.0)).sum(0) / n
        return mean, var


def page_attention(part, q: torch.Tensor, lse: torch.Tensor, q_pos: torch.Tensor, scale: float, num_kv_heads: int,
                   window_left: int) -> torch.Tensor:
    """Attention probability mass per (query row, listed page, kv head) ``[r, nnz, N_kv]`` of one part.

    ``q [B, r, H, D]`` the chosen query rows of each sequence, ``lse [B, r, H]`` their final merged
    LSE, ``q_pos [B, r]`` their positions. A page's keys are at ``logical * P + t``; the causal
    mask, the part's token counts (a truncated sink page, the last page) and ``window_left`` apply
    as in the kernels. Mass is the sum over the page's tokens, mean over the kv group's query heads.
    """
    batch = part.batch
    P = batch.page_size
    keys = part.pool.index_select(0, batch.kv_indices.long())[:, 0].float().to(q.device)  # [nnz, P, N_kv, D]
    seq = batch.page_seq().to(q.device)  # [nnz]
    nnz, H = keys.shape[0], q.shape[2]
    G = H // num_kv_heads
    if nnz == 0:
        return torch.zeros(q.shape[1], 0, num_kv_heads, device=q.device)
    kk = keys.repeat_interleave(G, dim=2)  # [nnz, P, H, D]
    logits = torch.einsum("nrhd,nphd->nrhp", q.float()[seq], kk) * scale  # [nnz, r, H, P]
    tokens = torch.full((nnz,), P, device=q.device)  # valid tokens per listed page
    last = batch.kv_indptr[1:].long().to(q.device) - 1  # the last listed page of each sequence
    has = batch.kv_indptr[1:] > batch.kv_indptr[:-1]
    tokens[last[has.to(q.device)]] = batch.kv_last_page_len.long().to(q.device)[has.to(q.device)]
    key_pos = torch.from_numpy(part.logical).to(q.device)[:, None] * P + torch.arange(P, device=q.device)  # [nnz, P]
    qp = q_pos[seq][:, :, None]  # [nnz, r, 1]
    ok = (torch.arange(P, device=q.device) < tokens[:, None])[:, None] & (key_pos[:, None] <= qp)  # [nnz, r, P]
    if window_left >= 0:
        ok &= key_pos[:, None] >= qp - window_left
    prob = torch.exp(logits - lse.float()[seq][..., None]).masked_fill(~ok[:, :, None], 0.0)  # [nnz, r, H, P]
    mass = prob.sum(-1).view(nnz, -1, num_kv_heads, G).mean(-1)  # [nnz, r, N_kv]
    return mass.transpose(0, 1)
