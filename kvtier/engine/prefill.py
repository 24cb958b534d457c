"""Attention of a prefill chunk over a row's chosen pages, wherever they live (eager, one row at a time).

The chosen pages split into two calls, merged by LSE: the pages every query of the chunk sees whole
(before ``tail_from``: any subset of them is exact), and the tail (from ``tail_from`` on: the chunk's own
pages and, on a sliding layer, the page the window cuts), attended in one causal call with the layer's
``window_left``. A call reads the device pool in place when all its pages are there, else one
temporary pool gathered from their tiers (:meth:`kvtier.tiers.transfer.TransferEngine.gather`).

It also gives what the policy's statistics need: per page the salience of the chunk's last query row
(one extra pass of that row) and the attention mass of its newest rows (:func:`kvtier.engine.stats.page_mass`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvtier.engine.stats import page_mass
from kvtier.kernels.base import PagedBatch, page_salience
from kvtier.kernels.merge import merge_many
from kvtier.quant import dequantize


@dataclass
class Call:
    """One attention call: some pages of the row, read from one pool."""

    pool: torch.Tensor  # [slots, 2, P, N_kv, D]
    batch: PagedBatch
    pids: np.ndarray  # [n] pid of each listed page
    logical: np.ndarray  # [n] logical page numbers
    tokens: np.ndarray  # [n] tokens counted per page
    resident: np.ndarray  # [n] read in place from the device tier


class PrefillAttention:
    """Prefill calls over a :class:`~kvtier.table.BlockTable`'s pages with ``backend``."""

    def __init__(self, table, transfer, backend, stats):
        self.table, self.transfer, self.backend, self.stats = table, transfer, backend, stats
        self.layout = table.layout
        self.device = table.tiers[0].device

    def calls(self, seq: int, layer: int, chosen: np.ndarray, q_len: int, tail_from: int) -> list[Call]:
        """The row's ``chosen`` logical pages (sorted) as at most two calls: the whole ones, then the tail."""
        n = self.table.num_pages(seq)
        middle, tail = chosen[chosen < tail_from], np.arange(tail_from, n)
        window = self.layout.window(layer)
        out = []
        if middle.size:
            out.append(self._call(seq, layer, middle, q_len, causal=False, window_left=-1))
        out.append(self._call(seq, layer, tail, q_len, causal=True, window_left=window - 1 if window else -1))
        return out

    def run(self, calls: list[Call], q: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [q, H, D]`` over the calls, merged: ``(out [q, H, D], lse [q, H])``."""
        results = []
        for call in calls:
            self.backend.plan(call.batch, q.shape[1], self.layout.num_kv_heads, q.shape[2], scale)
            res = self.backend.run(q, call.pool)
            results.append((res.out, res.lse))
        return merge_many(results)

    def salience(self, calls: list[Call], q_last: torch.Tensor, lse_last: torch.Tensor,
                 scale: float) -> list[tuple[np.ndarray, torch.Tensor]]:
        """Per call ``(pids, max attention probability [n, N_kv])`` of the last query row ``q_last [1, H, D]``
        against its final ``lse_last [1, H]``: one extra 1-row pass per call."""
        out = []
        for call in calls:
            b = call.batch
            single = PagedBatch(torch.arange(2, dtype=torch.int32, device=b.kv_indptr.device), b.kv_indptr,
                                b.kv_indices, b.kv_last_page_len, b.page_size, False, np.arange(2), b.host_kv_indptr,
                                b.window_left)
            self.backend.plan(single, q_last.shape[1], self.layout.num_kv_heads, q_last.shape[2], scale)
            page_max = self.backend.run(q_last, call.pool, return_page_max=True).page_max  # [n, H]
            out.append((call.pids, page_salience(page_max, lse_last, single, self.layout.num_kv_heads)))
        return out

    def mass(self, calls: list[Call], q_rows: torch.Tensor, lse_rows: torch.Tensor, pos: torch.Tensor,
             scale: float, layer: int) -> list[tuple[np.ndarray, torch.Tensor]]:
        """Per call ``(pids, attention mass [r, n, N_kv])`` of the rows ``q_rows [r, H, D]`` at ``pos [r]``."""
        window = self.layout.window(layer)
        out = []
        for call in calls:
            pages = call.pool.index_select(0, call.batch.kv_indices.long())  # [n, 2, P(+R), N_kv, D]
            keys = (dequantize(pages, self.layout.page_size) if self.layout.scaled else pages)[:, 0]  # [n, P, N_kv, D]
            logical = torch.from_numpy(call.logical).to(q_rows.device)
            tokens = torch.from_numpy(call.tokens).to(q_rows.device)
            wl = window - 1 if window and call.batch.causal else -1
            out.append((call.pids, page_mass(keys.to(q_rows.device), logical, tokens, q_rows, lse_rows, pos, scale,
                                             self.layout.num_kv_heads, wl)))
        return out

    def _call(self, seq: int, layer: int, logical: np.ndarray, q_len: int, causal: bool, window_left: int) -> Call:
        P = self.layout.page_size
        pids = self.table.pages(seq)[logical]
        self.transfer.wait(layer, pids)
        tiers, slots = self.table.locate(layer, pids)
        length = self.table.seq_len(seq)
        tokens = np.full(logical.size, P)
        if logical.size and logical[-1] == self.table.num_pages(seq) - 1:
            tokens[-1] = (length - 1) % P + 1
        if (tiers == 0).all():
            pool, indices = self.table.tiers[0].pool(layer), slots
        else:
            pool, links = self.transfer.gather(layer, pids, self.device)
            indices = np.arange(pids.size)
            for link, nbytes in links.items():
                self.stats.add_fetch(link, nbytes)
        batch = PagedBatch.from_host([0, q_len], [0, pids.size], indices, [int(tokens[-1]) if pids.size else 0], P,
                                     causal, self.device, window_left)
        return Call(pool, batch, pids, logical, tokens, tiers == 0)
