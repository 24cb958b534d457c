"""TieredKVCache: a transformers Cache whose K/V live in kvtier pages across the tier stack.

Per engine step (one prefill chunk or one decode token for every sequence):

1. ``update()`` of layer 0 opens the step: the previous step is finished (its salience goes to
   the policy, the scheduler plans and issues migrations), then every sequence grows by the new
   tokens (new pages in the device tier, room made first if needed).
2. ``update()`` of each layer writes that layer's new K/V into the pages.
3. The attention hook calls :meth:`TieredKVCache.attend`, which attends the pages chosen by the
   attention scope through the kernel backend and records salience and hits.

The scope (:mod:`kvtier.scopes`: ``all``, ``resident``, ``topk``) chooses the pages; exact
attention over them wherever they live is :mod:`kvtier.tiered_attention` (pages off the device
gathered into a temporary device buffer, or with ``merge=True`` attended where they live), and the
calls are merged by LSE. Every copy between tiers goes through :mod:`kvtier.tiers.transfer`.

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

import numpy as np
import torch

from kvtier.checks import check_device_room
from kvtier.compat import PagedCacheBase
from kvtier.errors import ConfigError
from kvtier.eval.fidelity import FidelityStats, attention_fidelity
from kvtier.kernels.base import AttentionBackend
from kvtier.kernels.merge import merge_many
from kvtier.kernels.reference import TorchBackend
from kvtier.layout import KVLayout
from kvtier.metrics import CacheStats, synchronize
from kvtier.paged_io import write_tokens
from kvtier.policies.base import Policy
from kvtier.scheduler.base import Scheduler
from kvtier.scheduler.lookahead import LookaheadScheduler
from kvtier.scopes import SCOPES, make_scope
from kvtier.table import BlockTable
from kvtier.tiered_attention import TieredAttention
from kvtier.tiers.base import Tier
from kvtier.tiers.transfer import TransferEngine
from kvtier.window import attended_range, out_of_window

ACTIVE_CACHE: contextvars.ContextVar["TieredKVCache | None"] = contextvars.ContextVar("kvtier_cache", default=None)


class TieredKVCache(PagedCacheBase):
    """Paged, tiered KV cache for ``batch_size`` sequences of equal length (no padding)."""

    def __init__(self, layout: KVLayout, tiers: list[Tier], policy: Policy, scheduler: Scheduler | None = None,
                 backend: AttentionBackend | None = None, scope: str = "all", merge: bool = False,
                 topk_pages: int | None = None, sinks: int = 4, batch_size: int = 1, fidelity: bool = False):
        if scope not in SCOPES:
            raise ConfigError("scope", f"unknown scope {scope!r}; use one of {list(SCOPES)}")
        self.chooser = make_scope(scope, layout, topk_pages, sinks, tiers[0].device)
        super().__init__([layout.window(layer) > 0 for layer in range(layout.num_layers)])
        self.layout = layout
        self.table = BlockTable(layout, tiers)
        self.transfer = TransferEngine(self.table)
        self.policy = policy
        self.scheduler = scheduler or LookaheadScheduler()
        self.backend = backend or TorchBackend()
        self.scope, self.merge = scope, merge
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
        self.attention = TieredAttention(self.table, self.transfer, self.backend, merge, self.stats)
        self.step = -1
        self.next_reserve = 1  # device pages to keep free for the next step, per sequence
        self._q_len = 0
        self._salience: list[tuple[int, np.ndarray, torch.Tensor]] = []

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
        self.chooser.on_write(self.table, self.seqs, layer_idx, key_states, self._start)
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
                self.chooser.on_copy(old, fresh)
            if new:
                pids = np.asarray(new, dtype=np.int64)
                self.chooser.on_append(pids)
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
        tail_from = self._attended_range(layer)[1]
        parts = self.attention.parts(self.seqs, layer, self.choose(layer, query), q_len, tail_from)
        want_salience = self.policy.needs_salience
        results = self.attention.run(parts, q, scale, page_max=want_salience and q_len == 1)
        out, lse = merge_many([(o, l) for o, l, _ in results])  # [B*q, H, D], [B*q, H]
        if want_salience:
            for pids, sal in self.attention.salience(parts, results, q, lse, q_len, scale):
                self._salience.append((layer, pids, sal))
        self._count_access(layer, parts)
        if self.fidelity is not None and q_len == 1:
            self._measure_fidelity(layer, q, out, lse, scale)
        return out.view(B, q_len, H, D)

    def choose(self, layer: int, query: torch.Tensor) -> list[np.ndarray]:
        """Per sequence, the logical pages the scope attends in ``layer`` this step (sorted)."""
        first, tail_from = self._attended_range(layer)
        return self.chooser.choose(self.table, self.seqs, layer, query, first, tail_from, query.shape[2])

    def _attended_range(self, layer: int) -> tuple[int, int]:
        """``(first, tail_from)`` logical pages of this step in ``layer`` (:func:`kvtier.window.attended_range`)."""
        return attended_range(self._start, self._q_len, self.layout.page_size, self.layout.window(layer))

    def _measure_fidelity(self, layer: int, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                          scale: float) -> None:
        """Attend every page (uncounted) and record the scope's recall and error; its time goes to
        ``stats.fidelity_s`` (synchronised on a GPU) so that the engine leaves it out of TPOT."""
        synchronize(self.device)
        t0 = time.perf_counter()
        first, tail_from = self._attended_range(layer)
        every = [np.arange(first, self.table.num_pages(seq)) for seq in self.seqs]
        exact = self.attention.run(self.attention.parts(self.seqs, layer, every, 1, tail_from, count=False), q, scale)
        out_all, lse_all = merge_many([(o, l) for o, l, _ in exact])  # [B, H, D], [B, H]
        self.fidelity.add(layer, *attention_fidelity(out, lse, out_all, lse_all))
        synchronize(self.device)
        self.stats.fidelity_s += time.perf_counter() - t0

    def _count_access(self, layer: int, parts) -> None:
        pids = np.concatenate([p.pids for p in parts])
        self.stats.attended_pages += pids.size
        self.stats.resident_pages += sum(p.pids.size for p in parts if p.resident)
        self.policy.on_access(layer, pids, self.step)

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        self.finish_step()
        self.transfer.synchronize()
        for t in self.table.tiers:
            t.close()
