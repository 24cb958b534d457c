"""TieredKVCache: a transformers Cache whose K/V live in kvtier pages across the tier stack.

Per engine step (one prefill chunk or one decode token for every sequence):

1. ``update()`` of layer 0 opens the step: the previous step is finished (its salience goes to
   the policy, the scheduler plans and issues migrations), then every sequence grows by the new
   tokens (new pages in the device tier, room made first if needed).
2. ``update()`` of each layer writes that layer's new K/V into the pages.
3. The attention hook calls :meth:`TieredKVCache.attend`, which attends the pages chosen by the
   attention scope through the kernel backend and records salience and hits.

Scopes: ``all`` (exact; pages off the device are fetched into a temporary device buffer, or with
``merge=True`` attended where they live, and merged by LSE), ``resident`` (only device pages),
``topk`` (Quest bounds from per-page key min/max pick ``topk_pages`` pages per decode step, plus
sinks and the pages being written; chosen pages off the device are fetched and count as misses).

Sliding-window layers (``layout.sliding_windows``) are exact under every scope: no page left of
a query's window is attended, the pages from the first one the window cuts to the newest are
attended together in one causal call (:mod:`kvtier.window`), and pages left of every holder's
window are dropped from their tier when a step finishes (``stats.dropped_pages``).

With ``fidelity=True`` every decode step of a ``resident`` or ``topk`` cache also attends all pages
(uncounted) and records the attention-mass recall and output error of the scope
(:mod:`kvtier.eval.fidelity`).
"""

from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.checks import check_device_room
from kvtier.compat import PagedCacheBase
from kvtier.errors import ConfigError
from kvtier.eval.fidelity import FidelityStats, attention_fidelity
from kvtier.kernels.base import AttentionBackend, PagedBatch, page_salience
from kvtier.kernels.merge import merge_many
from kvtier.kernels.reference import TorchBackend
from kvtier.layout import KVLayout
from kvtier.metrics import CacheStats, synchronize
from kvtier.paged_io import write_tokens
from kvtier.policies.base import Policy
from kvtier.scheduler.base import Scheduler
from kvtier.scheduler.lookahead import LookaheadScheduler
from kvtier.table import BlockTable
from kvtier.tiers.base import Tier
from kvtier.tiers.transfer import TransferEngine
from kvtier.window import attended_range, out_of_window

SCOPES = ("all", "resident", "topk")
ACTIVE_CACHE: contextvars.ContextVar["TieredKVCache | None"] = contextvars.ContextVar("kvtier_cache", default=None)


@dataclass
class _Part:
    """One attention call: some pages of each sequence, read from one pool."""

    pool: torch.Tensor  # [slots, 2, P, N_kv, D]
    batch: PagedBatch
    pids: np.ndarray  # [nnz] pid of each listed page
    resident: bool  # the pages are read in place from the device tier


class TieredKVCache(PagedCacheBase):
    """Paged, tiered KV cache for ``batch_size`` sequences of equal length (no padding)."""

    def __init__(self, layout: KVLayout, tiers: list[Tier], policy: Policy, scheduler: Scheduler | None = None,
                 backend: AttentionBackend | None = None, scope: str = "all", merge: bool = False,
                 topk_pages: int | None = None, sinks: int = 4, batch_size: int = 1, fidelity: bool = False):
        if scope not in SCOPES:
            raise ConfigError("scope", f"unknown scope {scope!r}; use one of {list(SCOPES)}")
        if scope == "topk" and (not isinstance(topk_pages, int) or topk_pages < 1):
            raise ConfigError("topk_pages", f"scope 'topk' needs topk_pages >= 1, got {topk_pages!r}")
        super().__init__([layout.window(layer) > 0 for layer in range(layout.num_layers)])
        self.layout = layout
        self.table = BlockTable(layout, tiers)
        self.transfer = TransferEngine(self.table)
        self.policy = policy
        self.scheduler = scheduler or LookaheadScheduler()
        self.backend = backend or TorchBackend()
        self.scope, self.merge, self.topk_pages, self.sinks = scope, merge, topk_pages, sinks
        self.fidelity = FidelityStats() if fidelity and scope != "all" else None  # scope all is exact
        if policy.needs_salience and not self.backend.supports_salience:
            raise ConfigError("kernel", f"policy '{policy.name}' needs salience, which backend "
                                        f"'{self.backend.name}' does not give; use kernel=triton or kernel=torch")
        check_device_room(tiers[0].capacity, policy, layout.page_size, 0, f"tiers.{tiers[0].name}.capacity", batch_size)
        self.seqs = list(range(batch_size))
        for s in self.seqs:
            self.table.add_sequence(s)
        policy.reset(layout.num_layers)
        self.device = tiers[0].device
        self.stats = CacheStats()
        self.step = -1
        self.next_reserve = 1  # device pages to keep free for the next step, per sequence
        self._q_len = 0
        self._salience: list[tuple[int, np.ndarray, torch.Tensor]] = []
        shape = (layout.num_layers, 64 if scope == "topk" else 0, layout.num_kv_heads, layout.head_dim)
        # Quest key bounds, kept only for scope=topk: [L, pids, N_kv, D]
        self.key_min = torch.full(shape, float("inf"), device=self.device)
        self.key_max = torch.full(shape, float("-inf"), device=self.device)

    # -- transformers Cache interface ---------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.table.seq_len(self.seqs[0])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write K/V ``[B, N_kv, q, D]`` of ``layer_idx``; returns them unchanged (attention reads pages)."""
        B, n_kv, q_len, _ = key_states.shape
        if B != len(self.seqs):
            raise ConfigError("batch_size", f"cache built for {len(self.seqs)} sequences, got a batch of {B}")
        if layer_idx == 0:
            self._begin_step(q_len)
        kv = torch.stack([key_states, value_states]).transpose(2, 3)  # [2, B, q, N_kv, D]
        for b, seq in enumerate(self.seqs):
            write_tokens(self.table, layer_idx, seq, kv[:, b], self._start)
        self._update_key_bounds(layer_idx, key_states)
        ACTIVE_CACHE.set(self)
        return key_states, value_states

    # -- step lifecycle ------------------------------------------------------------------------
    def _begin_step(self, q_len: int) -> None:
        self.finish_step()
        self.step += 1
        self._q_len = q_len
        self._start = self.get_seq_length()
        self.policy.on_step(self.step)
        need = self.layout.pages_for(self._start % self.layout.page_size + q_len) * len(self.seqs)
        if min(self.table.tiers[0].num_free(layer) for layer in range(self.layout.num_layers)) < need:
            self._plan_and_move(reserve=need)
        for seq in self.seqs:
            new, cow = self.table.append(seq, q_len)
            for old, fresh in cow:
                self._copy_key_bounds(old, fresh)
            if new:
                pids = np.asarray(new, dtype=np.int64)
                self._reset_key_bounds(pids)
                self.policy.on_append(pids, self.step)
        self.stats.observe_occupancy(self.step, self.table)
        self._open = True

    def finish_step(self) -> None:
        """Hand the step's salience to the policy, then plan and issue migrations (idempotent)."""
        if not getattr(self, "_open", False):
            return
        self._open = False
        if self._salience:
            scores = torch.cat([s for _, _, s in self._salience]).float().cpu().numpy()  # one sync per step
            at = 0
            for layer, pids, s in self._salience:
                self.policy.on_salience(layer, pids, scores[at:at + pids.size], self.step)
                at += pids.size
            self._salience.clear()
        self._drop_out_of_window()
        self._plan_and_move(reserve=self.next_reserve * len(self.seqs))

    def _drop_out_of_window(self) -> None:
        """On each sliding layer, free the pages no sequence's next query can see (never read again)."""
        P = self.layout.page_size
        for window in set(self.layout.sliding_windows) - {0}:
            pids = out_of_window(self.table.seqs, P, window)
            for layer in range(self.layout.num_layers):
                if pids.size and self.layout.window(layer) == window:
                    self.transfer.wait(layer, pids)
                    n = self.table.drop(layer, pids).size
                    self.stats.dropped_pages += n
                    self.stats.dropped_bytes += n * self.layout.page_bytes

    def _plan_and_move(self, reserve: int) -> None:
        plan = self.scheduler.plan(self.table, self.policy, self.step, reserve=reserve)
        self.scheduler.execute(plan, self.transfer)
        self.stats.planned_pages += plan.num_pages()

    # -- attention -----------------------------------------------------------------------------
    def attend(self, layer: int, query: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
        """Paged attention of ``query [B, H, q, D]`` for ``layer`` under the scope: ``[B, q, H, D]``."""
        B, H, q_len, D = query.shape
        q = query.transpose(1, 2).reshape(B * q_len, H, D)  # [B*q, H, D]
        scale = D ** -0.5 if scaling is None else scaling
        parts = self._parts(layer, self._choose_pages(layer, query), q_len)
        want_salience = self.policy.needs_salience
        results = self._attend_parts(parts, q, scale, page_max=want_salience and q_len == 1)
        out, lse = merge_many([(o, l) for o, l, _ in results])  # [B*q, H, D], [B*q, H]
        if want_salience:
            self._record_salience(layer, parts, results, q, lse, q_len, scale)
        self._count_access(layer, parts)
        if self.fidelity is not None and q_len == 1:
            self._measure_fidelity(layer, q, out, lse, scale)
        return out.view(B, q_len, H, D)

    def _measure_fidelity(self, layer: int, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                          scale: float) -> None:
        """Attend every page (uncounted) and record the scope's recall and error; its time goes to
        ``stats.fidelity_s`` (synchronised on a GPU) so that the engine leaves it out of TPOT."""
        synchronize(self.device)
        t0 = time.perf_counter()
        exact = self._attend_parts(self._parts(layer, self._all_pages(layer), 1, count=False), q, scale)
        out_all, lse_all = merge_many([(o, l) for o, l, _ in exact])  # [B, H, D], [B, H]
        self.fidelity.add(layer, *attention_fidelity(out, lse, out_all, lse_all))
        synchronize(self.device)
        self.stats.fidelity_s += time.perf_counter() - t0

    def _attend_parts(self, parts: list[_Part], q: torch.Tensor, scale: float, page_max: bool = False) -> list:
        """Attention of ``q [B*q, H, D]`` over each part: ``[(out [B*q, H, D], lse [B*q, H], page_max | None)]``."""
        results = []
        for part in parts:
            backend = self._backend_for(part)
            backend.plan(part.batch, q.shape[1], self.layout.num_kv_heads, q.shape[2], scale)
            res = backend.run(q.to(part.pool.device), part.pool, return_page_max=page_max)
            results.append((res.out.to(q.device), res.lse.to(q.device), res.page_max))
        return results

    def _attended_range(self, layer: int) -> tuple[int, int]:
        """``(first, tail_from)`` logical pages of this step in ``layer`` (:func:`kvtier.window.attended_range`)."""
        return attended_range(self._start, self._q_len, self.layout.page_size, self.layout.window(layer))

    def _all_pages(self, layer: int) -> list[np.ndarray]:
        """Every logical page number of each sequence that a query of this step can see in ``layer``."""
        first = self._attended_range(layer)[0]
        return [np.arange(first, self.table.pages(seq).size) for seq in self.seqs]

    def _choose_pages(self, layer: int, query: torch.Tensor) -> list[np.ndarray]:
        """Per sequence, the logical page numbers to attend (sorted), never left of a sliding window."""
        P = self.layout.page_size
        first, tail_from = self._attended_range(layer)
        chosen = []
        for b, seq in enumerate(self.seqs):
            pids = self.table.pages(seq)
            n = pids.size
            if self.scope == "all" or (self.scope == "topk" and self._q_len > 1):
                chosen.append(np.arange(first, n))
            elif self.scope == "resident":
                on_dev = self.table.tier_of[layer, pids] == 0
                on_dev[tail_from:] = True  # the tokens being written are always attended
                chosen.append(np.flatnonzero(on_dev[first:]) + first)
            else:
                forced = np.zeros(n, dtype=bool)
                forced[tail_from:] = True
                forced[: -(-self.sinks // P)] = True
                forced[:first] = False
                free = np.flatnonzero(~forced[first:]) + first
                k = min(self.topk_pages - int(forced.sum()), free.size)
                if k > 0:
                    scores = self._quest_scores(layer, query[b], pids[free])  # [m]
                    forced[free[torch.topk(scores, k).indices.cpu().numpy()]] = True
                chosen.append(np.flatnonzero(forced))
        return chosen

    def _quest_scores(self, layer: int, q: torch.Tensor, pids: np.ndarray) -> torch.Tensor:
        """Quest upper bound of q·k over each page, max over heads: ``[m]``. q ``[H, 1, D]``."""
        idx = torch.from_numpy(pids).to(self.device)
        kmin, kmax = self.key_min[layer, idx], self.key_max[layer, idx]  # [m, N_kv, D]
        H = q.shape[0]
        g = H // self.layout.num_kv_heads
        qg = q[:, -1].float().view(self.layout.num_kv_heads, g, -1).to(self.device)  # [N_kv, G, D]
        ub = torch.maximum(qg[None] * kmin[:, :, None], qg[None] * kmax[:, :, None]).sum(-1)  # [m, N_kv, G]
        return ub.amax(dim=(1, 2))

    def _parts(self, layer: int, chosen: list[np.ndarray], q_len: int, count: bool = True) -> list[_Part]:
        """Split the chosen pages into attention calls: device pages in place, the rest fetched
        into one temporary device pool (or, with merge, one call per tier where the pages live).

        The tail (pages from ``tail_from``: those being written, and on a sliding layer every page
        from the first one the window cuts) is whole within one call, in place when every
        sequence's tail is on the device, else fetched. That call is causal (bottom-right) with
        the layer's window, so every query sees exactly its keys; the other calls hold only pages
        every query sees whole. ``count=False`` (a fidelity pass) leaves the fetch and read
        counters alone.
        """
        tail_from = self._attended_range(layer)[1]
        tail_on_dev = all(bool((self.table.tier_of[layer, self.table.pages(seq)[tail_from:]] == 0).all())
                          for seq in self.seqs)  # one causal call holds every sequence's tail
        groups: dict[object, list] = {}  # key -> per-seq (logical page numbers)
        for b, seq in enumerate(self.seqs):
            pids = self.table.pages(seq)
            sel = chosen[b]
            self.transfer.wait(layer, pids[sel])
            tiers = self.table.tier_of[layer, pids[sel]]
            for t in np.unique(tiers):
                pages = sel[tiers == t]
                if not tail_on_dev:
                    pages = pages[pages < tail_from]
                key = 0 if t == 0 else (int(t) if self.merge else "fetch")
                groups.setdefault(key, [[] for _ in self.seqs])[b].append(pages)
            if not tail_on_dev:
                groups.setdefault("fetch", [[] for _ in self.seqs])[b].append(np.arange(tail_from, pids.size))
        parts = []
        for key, per_seq in groups.items():
            logical = [np.sort(np.concatenate(x)) if x else np.zeros(0, np.int64) for x in per_seq]
            parts.append(self._make_part(layer, key, logical, q_len, count))
        return parts

    def _make_part(self, layer: int, key, logical: list[np.ndarray], q_len: int, count: bool) -> _Part:
        P = self.layout.page_size
        all_pids, kv_indptr, last_len, causal = [], [0], [], False
        for b, seq in enumerate(self.seqs):
            pids = self.table.pages(seq)[logical[b]]
            all_pids.append(pids)
            kv_indptr.append(kv_indptr[-1] + pids.size)
            n_pages = self.table.pages(seq).size
            has_tail = logical[b].size and logical[b][-1] == n_pages - 1
            causal |= bool(has_tail)
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
        window_left = self.layout.window(layer) - 1 if causal else -1  # -1: no window (also for a global layer)
        batch = PagedBatch.from_host(np.arange(len(self.seqs) + 1) * q_len, kv_indptr, indices, last_len, P, causal,
                                     pool.device, window_left)
        return _Part(pool, batch, pids, key == 0)

    def _fetch(self, layer: int, pids, count: bool = True) -> torch.Tensor:
        """Copy pages from their tiers into a temporary device pool ``[n, 2, P, N_kv, D]``."""
        t0 = time.perf_counter()
        pool, links = self.transfer.gather(layer, pids, self.device)
        if count:
            for link, nbytes in links.items():
                self.stats.add_fetch(link, nbytes)
            self.stats.fetch_s += time.perf_counter() - t0
        return pool

    def _backend_for(self, part: _Part) -> AttentionBackend:
        """The configured backend on the device; the torch reference where pages live on the host."""
        if part.pool.device.type == self.device.type:
            return self.backend
        return TorchBackend()

    def _record_salience(self, layer, parts, results, q, lse, q_len, scale) -> None:
        """Per-page max attention probability (decode: the query; prefill: the chunk's last query)."""
        last_rows = torch.arange(len(self.seqs), device=q.device) * q_len + q_len - 1  # [B]
        for part, (_, _, page_max) in zip(parts, results):
            batch = part.batch
            if page_max is None:  # prefill: one extra pass of the last query row over this part
                rows = np.arange(len(self.seqs) + 1)  # [B+1] one query row per sequence
                single = PagedBatch(torch.arange(rows.size, dtype=torch.int32, device=batch.kv_indptr.device),
                                    batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, batch.page_size, False,
                                    rows, batch.host_kv_indptr, batch.window_left)
                backend = self._backend_for(part)
                backend.plan(single, q.shape[1], self.layout.num_kv_heads, q.shape[2], scale)
                page_max = backend.run(q[last_rows].to(part.pool.device), part.pool, return_page_max=True).page_max
                batch = single
            final = lse[last_rows].to(page_max.device)  # [B, H]
            sal = page_salience(page_max, final, batch, self.layout.num_kv_heads)  # [nnz, N_kv]
            self._salience.append((layer, part.pids, sal.to(self.device)))

    def _count_access(self, layer: int, parts: list[_Part]) -> None:
        pids = np.concatenate([p.pids for p in parts])
        resident = sum(p.pids.size for p in parts if p.resident)
        self.stats.attended_pages += pids.size
        self.stats.resident_pages += resident
        self.policy.on_access(layer, pids, self.step)

    # -- Quest key bounds ----------------------------------------------------------------------
    def _grow_bounds(self, size: int) -> None:
        cap = self.key_min.shape[1]
        if size <= cap:
            return
        extra = max(size, 2 * cap) - cap
        pad = lambda t, v: torch.cat([t, torch.full((t.shape[0], extra, *t.shape[2:]), v, device=t.device)], 1)  # noqa: E731
        self.key_min, self.key_max = pad(self.key_min, float("inf")), pad(self.key_max, float("-inf"))

    def _reset_key_bounds(self, pids: np.ndarray) -> None:
        if self.scope != "topk":
            return
        self._grow_bounds(int(pids.max()) + 1)
        idx = torch.from_numpy(pids).to(self.device)
        self.key_min[:, idx] = float("inf")
        self.key_max[:, idx] = float("-inf")

    def _copy_key_bounds(self, src: int, dst: int) -> None:
        if self.scope != "topk":
            return
        self._grow_bounds(max(src, dst) + 1)
        self.key_min[:, dst] = self.key_min[:, src]
        self.key_max[:, dst] = self.key_max[:, src]

    def _update_key_bounds(self, layer: int, key_states: torch.Tensor) -> None:
        """Fold the new keys ``[B, N_kv, q, D]`` into their pages' min/max."""
        if self.scope != "topk":
            return
        P = self.layout.page_size
        q_len = key_states.shape[2]
        pos = np.arange(self._start, self._start + q_len)
        for b, seq in enumerate(self.seqs):
            pids = torch.from_numpy(self.table.pages(seq)[pos // P]).to(self.device)  # [q]
            k = key_states[b].transpose(0, 1).float().to(self.device)  # [q, N_kv, D]
            idx = pids[:, None, None].expand_as(k)
            self.key_min[layer].scatter_reduce_(0, idx, k, reduce="amin")
            self.key_max[layer].scatter_reduce_(0, idx, k, reduce="amax")

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        self.finish_step()
        self.transfer.synchronize()
        for t in self.table.tiers:
            t.close()
