"""Exact attention over pages that live on several tiers: split the chosen pages into calls, run the
backend on each, and give per-page salience. The cache merges the calls' results by LSE.

Device pages are read in place; the rest are gathered into one temporary device pool (one copy
launch per tier, :meth:`kvtier.tiers.transfer.TransferEngine.gather`) or, with ``merge``, attended
where they live, one call per tier. The tail (pages from ``tail_from``: those being written, and on
a sliding layer every page from the first one the window cuts) is whole within one call, in place
when every sequence's tail is on the device, else gathered. That call is causal (bottom-right)
with the layer's window, so every query sees exactly its keys; the other calls hold only pages
every query sees whole.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.kernels.base import AttentionBackend, PagedBatch, page_salience
from kvtier.kernels.reference import TorchBackend
from kvtier.metrics import CacheStats


@dataclass
class Part:
    """One attention call: some pages of each sequence, read from one pool."""

    pool: torch.Tensor  # [slots, 2, P, N_kv, D]
    batch: PagedBatch
    pids: np.ndarray  # [nnz] pid of each listed page
    resident: bool  # the pages are read in place from the device tier
    logical: np.ndarray  # [nnz] logical page number of each listed page
    tokens: float  # keys the newest query row of each sequence sees (mean over kv heads), summed over sequences


class TieredAttention:
    """Attention calls over a :class:`~kvtier.table.BlockTable`'s pages with ``backend``."""

    def __init__(self, table, transfer, backend: AttentionBackend, merge: bool, stats: CacheStats):
        self.table, self.transfer, self.backend, self.merge, self.stats = table, transfer, backend, merge, stats
        self.layout = table.layout
        self.device = table.tiers[0].device

    def parts(self, seqs: list[int], layer: int, chosen: list[np.ndarray], q_len: int, tail_from: int,
              count: bool = True, sinks: int = 0, window: int = 0,
              head_masks: list[np.ndarray] | None = None) -> list[Part]:
        """Split each sequence's ``chosen`` logical pages into calls. ``count=False`` (a fidelity
        pass) leaves the fetch and read counters alone.

        Token spans (a token budget, :mod:`kvtier.budget`): ``sinks > 0`` attends the first ``sinks``
        tokens in a call of their own (their last page truncated) instead of those pages whole;
        ``window > 0`` lets the tail call's queries see only their last ``window`` keys.
        ``head_masks`` (a per-head choice): per sequence ``[num_pages, N_kv]`` bool, the kv heads that
        see each logical page (the calls carry it as ``PagedBatch.head_mask``).
        """
        sink_pages = -(-sinks // self.layout.page_size)
        if sinks:
            chosen = [c[(c >= sink_pages) | (c >= tail_from)] for c in chosen]
        if window:  # the tail alone: the window's mask counts keys in the call's order
            chosen = [c[c < tail_from] for c in chosen]
        tail_on_dev = all(bool((self.table.tier_of[layer, self.table.pages(seq)[tail_from:]] == 0).all())
                          for seq in seqs)  # one causal call holds every sequence's tail
        groups: dict[object, list] = {}  # key -> per-seq (logical page numbers)
        for b, seq in enumerate(seqs):
            pids = self.table.pages(seq)
            sel = chosen[b]
            self.transfer.wait(layer, pids[sel])
            tiers = self.table.tier_of[layer, pids[sel]]
            for t in np.unique(tiers):
                pages = sel[tiers == t]
                if not tail_on_dev:
                    pages = pages[pages < tail_from]
                key = 0 if t == 0 else (int(t) if self.merge else "fetch")
                groups.setdefault(key, [[] for _ in seqs])[b].append(pages)
            if not tail_on_dev and not window:
                groups.setdefault("fetch", [[] for _ in seqs])[b].append(np.arange(tail_from, pids.size))
        parts = []
        for key, per_seq in groups.items():
            logical = [np.sort(np.concatenate(x)) if x else np.zeros(0, np.int64) for x in per_seq]
            if not any(x.size for x in logical):  # every page went to the tail's call: no empty launch
                continue
            parts.append(self._part(seqs, layer, key, logical, q_len, count, window, head_masks=head_masks))
        if window:
            logical = [np.arange(tail_from, self.table.num_pages(seq)) for seq in seqs]
            for seq, pages in zip(seqs, logical):
                self.transfer.wait(layer, self.table.pages(seq)[pages])
            parts.append(self._part(seqs, layer, 0 if tail_on_dev else "fetch", logical, q_len, count, window))
        if sinks:
            logical = [np.arange(sink_pages)] * len(seqs)
            for seq in seqs:
                self.transfer.wait(layer, self.table.pages(seq)[:sink_pages])
            on_dev = all(bool((self.table.tier_of[layer, self.table.pages(seq)[:sink_pages]] == 0).all())
                         for seq in seqs)
            parts.append(self._part(seqs, layer, 0 if on_dev else "fetch", logical, q_len, count, last_tokens=sinks))
        return parts

    def run(self, parts: list[Part], q: torch.Tensor, scale: float, page_max: bool = False) -> list:
        """Attention of ``q [B*q, H, D]`` over each part: ``[(out [B*q, H, D], lse [B*q, H], page_max | None)]``."""
        results = []
        for part in parts:
            backend = self._backend_for(part)
            backend.plan(part.batch, q.shape[1], self.layout.num_kv_heads, q.shape[2], scale)
            res = backend.run(q.to(part.pool.device), part.pool, return_page_max=page_max)
            results.append((res.out.to(q.device), res.lse.to(q.device), res.page_max))
        return results

    def salience(self, parts: list[Part], results: list, q: torch.Tensor, lse: torch.Tensor, q_len: int,
                 scale: float) -> list[tuple[np.ndarray, torch.Tensor]]:
        """Per part, ``(pids, max attention probability [nnz, N_kv])`` of the last query row of each
        sequence against the merged ``lse`` (decode: the query; prefill: one extra 1-row pass)."""
        B = lse.shape[0] // q_len
        last_rows = torch.arange(B, device=q.device) * q_len + q_len - 1  # [B]
        out = []
        for part, (_, _, page_max) in zip(parts, results):
            batch = part.batch
            if page_max is None:  # prefill: one extra pass of the last query row over this part
                rows = np.arange(B + 1)  # [B+1] one query row per sequence
                single = PagedBatch(torch.arange(rows.size, dtype=torch.int32, device=batch.kv_indptr.device),
                                    batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, batch.page_size, False,
                                    rows, batch.host_kv_indptr, batch.window_left)
                backend = self._backend_for(part)
                backend.plan(single, q.shape[1], self.layout.num_kv_heads, q.shape[2], scale)
                page_max = backend.run(q[last_rows].to(part.pool.device), part.pool, return_page_max=True).page_max
                batch = single
            final = lse[last_rows].to(page_max.device)  # [B, H]
            out.append((part.pids, page_salience(page_max, final, batch, self.layout.num_kv_heads).to(self.device)))
        return out

    def _part(self, seqs, layer: int, key, logical: list[np.ndarray], q_len: int, count: bool, window: int = 0,
              last_tokens: int = 0, head_masks: list[np.ndarray] | None = None) -> Part:
        """One call; ``last_tokens`` > 0: the listed pages are the first ``last_tokens`` tokens (sinks);
        ``head_masks``: per sequence ``[num_pages, N_kv]``, the kv heads that see each logical page."""
        P = self.layout.page_size
        all_pids, kv_indptr, last_len, causal = [], [0], [], False
        for b, seq in enumerate(seqs):
            pids = self.table.pages(seq)[logical[b]]
            all_pids.append(pids)
            kv_indptr.append(kv_indptr[-1] + pids.size)
            has_tail = logical[b].size and logical[b][-1] == self.table.num_pages(seq) - 1 and not last_tokens
            causal |= bool(has_tail)
            if last_tokens:
                last_len.append(last_tokens - (pids.size - 1) * P)
            else:
                last_len.append((self.table.seq_len(seq) - 1) % P + 1 if has_tail else P)
        pids = np.concatenate(all_pids)
        tiers, slots = self.table.locate(layer, pids)
        if key == 0:
            pool, indices = self.table.tiers[0].pool(layer), slots
        elif key == "fetch":
            pool, indices = self._fetch(layer, pids, count), np.arange(pids.size)
        else:
            tier = self.table.tiers[key]
            pool, indices = tier.pool(layer), slots
            if pool is None:
                pool, indices = tier.read(layer, torch.from_numpy(slots)), np.arange(pids.size)
                if count:
                    self.stats.add_read(tier.name, pids.size * self.layout.page_bytes)
        spans = [w for w in (self.layout.window(layer), window) if w > 0]
        window_left = min(spans) - 1 if causal and spans else -1  # -1: no window (also for a global layer)
        mask = None if head_masks is None else \
            np.concatenate([m[p] for m, p in zip(head_masks, logical)])  # [nnz, N_kv]
        batch = PagedBatch.from_host(np.arange(len(seqs) + 1) * q_len, kv_indptr, indices, last_len, P, causal,
                                     pool.device, window_left, mask)
        n_pages = np.diff(kv_indptr)
        seen = np.where(n_pages > 0, (n_pages - 1) * P + np.asarray(last_len), 0)  # keys per sequence
        if window_left >= 0:
            seen = np.minimum(seen, window_left + 1)
        tokens = float(seen.sum())
        if mask is not None and window_left < 0:  # each page's keys times the share of kv heads that see it
            page_tokens = np.full(pids.size, P)  # [nnz]
            ends = np.asarray(kv_indptr[1:])[n_pages > 0] - 1
            page_tokens[ends] = np.asarray(last_len)[n_pages > 0]
            tokens = float((page_tokens * mask.mean(axis=1)).sum())
        return Part(pool, batch, pids, key == 0, np.concatenate(logical).astype(np.int64), tokens)

    def _fetch(self, layer: int, pids, count: bool) -> torch.Tensor:
        """Copy pages from their tiers into a temporary device pool ``[n, 2, P, N_kv, D]``."""
        t0 = time.perf_counter()
        pool, links = self.transfer.gather(layer, pids, self.device)
        if count:
            for link, nbytes in links.items():
                self.stats.add_fetch(link, nbytes)
            self.stats.fetch_s += time.perf_counter() - t0
        return pool

    def _backend_for(self, part: Part) -> AttentionBackend:
        """The configured backend on the device; the torch reference where pages live on the host."""
        if part.pool.device.type == self.device.type:
            return self.backend
        return TorchBackend()
