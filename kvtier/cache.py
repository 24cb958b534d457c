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

A token budget (``budget`` tokens per decode step, per layer and sequence; :mod:`kvtier.budget`)
attends the first ``sinks`` tokens, the last ``window`` (or more) tokens and, in between, whole pages
chosen by the scope: ``resident`` the device pages the policy ranks best, ``topk`` the best by a
query-aware score (``rank``). With ``exact_prefill`` the prefill attends every page and the budget
starts at the first decode step; ``mode="once"`` compresses once when the prefill ends (the pages
the policy ranks below the budget are dropped, as kvpress presses do) and then attends the rest.
The end of the prefill is :meth:`TieredKVCache.end_prefill` (the engine calls it; else the first
1-token step). Statistics the policy's scorer needs (attention per page of the newest query rows,
key and query statistics, :mod:`kvtier.page_stats`) are gathered at each step and handed over
with the salience when the step finishes.

With ``fidelity=True`` every decode step of a ``resident`` or ``topk`` cache also attends all pages
(uncounted) and records the attention-mass recall and output error of the scope
(:mod:`kvtier.eval.fidelity`).
"""

from __future__ import annotations

import contextvars
import time

import numpy as np
import torch

from kvtier.checks import check_device_room, check_salience
from kvtier.compat import PagedCacheBase
from kvtier.errors import ConfigError
from kvtier.eval.fidelity import FidelityStats, attention_fidelity
from kvtier.kernels.base import AttentionBackend
from kvtier.kernels.merge import merge_many
from kvtier.kernels.reference import TorchBackend
from kvtier.layout import KVLayout
from kvtier.budget import TokenBudget
from kvtier.metrics import CacheStats, synchronize
from kvtier.page_stats import KeyStats, QueryStats, page_attention
from kvtier.paged_io import write_tokens
from kvtier.policies.base import Policy
from kvtier.scheduler.base import Scheduler
from kvtier.scheduler.lookahead import LookaheadScheduler, page_info
from kvtier.scopes import SCOPES, every_page, make_scope
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
                 topk_pages: int | None = None, sinks: int = 4, batch_size: int = 1, fidelity: bool = False,
                 budget: int | None = None, window: int = 64, mode: str = "continuous", exact_prefill: bool = False,
                 rank: str = "quest", dense_layers: int = 0, per_head: bool = False,
                 query_rows: int = 1, policy_share: float = 0.0):
        if scope not in SCOPES:
            raise ConfigError("scope", f"unknown scope {scope!r}; use one of {list(SCOPES)}")
        self.budget = None if budget is None else TokenBudget(budget, sinks, window, layout.page_size, mode)
        if scope == "topk" and budget is None and topk_pages is None:
            raise ConfigError("topk_pages", "scope 'topk' needs topk_pages >= 1 (or a token budget), got None")
        if scope == "all" and self.budget is not None and mode == "continuous":
            raise ConfigError("cache.budget", "scope 'all' attends every page; a continuous budget needs "
                                              "scope resident or topk (or mode 'once')")
        self.exact_prefill = exact_prefill or mode == "once"
        if not isinstance(dense_layers, int) or isinstance(dense_layers, bool) or not \
                0 <= dense_layers <= layout.num_layers:
            raise ConfigError("cache.dense_layers", f"must be an integer in [0, {layout.num_layers}], got {dense_layers!r}")
        self.dense_layers = dense_layers  # the first layers attend every page (Quest leaves layers 0-1 dense)
        needs = policy.needs
        self.keys = KeyStats(layout, tiers[0].device) if scope == "topk" or "keys" in needs else None
        self.queries = QueryStats(layout.num_layers, max(1, getattr(policy, "query_rows", 32)), tiers[0].device) \
            if "queries" in needs else None
        if per_head and (scope != "topk" or budget is None):
            raise ConfigError("cache.per_head", "a per-head page choice needs scope 'topk' and a token budget")
        self.chooser = make_scope(scope, layout, topk_pages, sinks, self.keys, rank, per_head, query_rows,
                                  policy_share)
        super().__init__(layout)
        self.layout = layout
        self.table = BlockTable(layout, tiers)
        self.transfer = TransferEngine(self.table)
        self.policy = policy
        self.scheduler = scheduler or LookaheadScheduler()
        self.backend = backend or TorchBackend()
        self.scope, self.merge = scope, merge
        self.fidelity = FidelityStats() if fidelity and scope != "all" else None  # scope all is exact
        check_salience(policy, self.backend)
        check_device_room(tiers[0].capacity, policy, layout.page_size, 0, f"tiers.{tiers[0].name}.capacity", batch_size)
        self.seqs = list(range(batch_size))
        for s in self.seqs:
            self.table.add_sequence(s)
        policy.reset(layout.num_layers)
        policy.bind(self.keys, self.queries)
        self.device = tiers[0].device
        self.stats = CacheStats()
        self.attention = TieredAttention(self.table, self.transfer, self.backend, merge, self.stats)
        self.step = -1
        self._attended = -1
        self.next_reserve = 1  # device pages to keep free for the next step, per sequence
        self._q_len = 0
        self._salience: list[tuple[int, np.ndarray, torch.Tensor]] = []
        self._attention: list[tuple[int, np.ndarray, torch.Tensor]] = []  # (layer, pids, mass [r, n, N_kv])
        self.prefilled = False  # set by end_prefill()
        self._win_start: int | None = None  # mode "once": the window's start, fixed at compression
        self._prio_step, self._prio, self._prio_col = None, None, None

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
        elif self._attended != layer_idx - 1:  # the layer before wrote its K/V, then attended without kvtier
            raise ConfigError("attn_implementation", "the model's attention does not go through kvtier, so it "
                                                     "would read only the new tokens' K/V: call "
                                                     "kvtier.hook.use_hook(model) (kvtier.Engine does)")
        kv = torch.stack([key_states, value_states]).transpose(2, 3)  # [2, B, q, N_kv, D]
        for b, seq in enumerate(self.seqs):
            write_tokens(self.table, layer_idx, seq, kv[:, b], self._start)
        if self.keys is not None:
            self.keys.on_write(self.table, self.seqs, layer_idx, key_states, self._start)
        ACTIVE_CACHE.set(self)
        return key_states, value_states

    # -- step lifecycle ------------------------------------------------------------------------
    def receive_step(self, q_len: int) -> None:
        """Open a step whose K/V another process computed (:mod:`kvtier.disagg`): every sequence grows
        by ``q_len`` tokens and the caller writes each layer's new pages into their tiers."""
        self._begin_step(q_len)

    def _begin_step(self, q_len: int) -> None:
        self.finish_step()
        if q_len == 1 and not self.prefilled and self.step >= 0:
            self.end_prefill()
        self.step += 1
        self._q_len = q_len
        self._attended = -1  # the last layer this step attended through the hook
        self._start = self.get_seq_length()
        self.policy.on_step(self.step)
        need = self.layout.pages_for(self._start % self.layout.page_size + q_len) * len(self.seqs)
        if min(self.table.tiers[0].num_free(layer) for layer in range(self.layout.num_layers)) < need:
            self._plan_and_move(reserve=need)
        for seq in self.seqs:
            new, cow = self.table.append(seq, q_len)
            for old, fresh in cow:
                if self.keys is not None:
                    self.keys.on_copy(old, fresh)
            if new:
                pids = np.asarray(new, dtype=np.int64)
                if self.keys is not None:
                    self.keys.on_append(pids)
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
        if self._attention:
            mass = torch.cat([m.flatten() for _, _, m in self._attention]).cpu().numpy()  # one sync per step
            at = 0
            for layer, pids, m in self._attention:
                self.policy.on_attention(layer, pids, mass[at:at + m.numel()].reshape(m.shape), self.step)
                at += m.numel()
            self._attention.clear()
        self._prio_step = None
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
        self._attended = layer
        q = query.transpose(1, 2).reshape(B * q_len, H, D)  # [B*q, H, D]
        scale = D ** -0.5 if scaling is None else scaling
        chosen = self.choose(layer, query)
        tail_from, sinks, window, head_masks = self._spans
        parts = self.attention.parts(self.seqs, layer, chosen, q_len, tail_from, sinks=sinks, window=window,
                                     head_masks=head_masks)
        want_salience = self.policy.needs_salience
        results = self.attention.run(parts, q, scale, page_max=want_salience and q_len == 1)
        out, lse = merge_many([(o, l) for o, l, _ in results])  # [B*q, H, D], [B*q, H]
        if want_salience:
            for pids, sal in self.attention.salience(parts, results, q, lse, q_len, scale):
                self._salience.append((layer, pids, sal))
        self._observe(layer, parts, query, lse, scale)
        self._count_access(layer, parts, q_len)
        if self.fidelity is not None and q_len == 1:
            self._measure_fidelity(layer, q, out, lse, scale)
        return out.view(B, q_len, H, D)

    def choose(self, layer: int, query: torch.Tensor) -> list[np.ndarray]:
        """Per sequence, the logical pages attended in ``layer`` this step (sorted; the sink and
        window pages of a token budget are attended in part). Its spans ``(tail_from, sinks, window,
        head_masks)`` are kept for the attention call."""
        chosen, *spans = self.plan_attention(layer, query)
        self._spans = tuple(spans)
        return chosen

    def plan_attention(self, layer: int, query: torch.Tensor):
        """``(chosen pages per sequence, tail_from, sink tokens, window tokens, head masks)`` of ``layer``
        this step: the scope's choice, or under an active token budget the sink span, the scope's
        middle pages and the window span (0 sinks / 0 window: pages whole). Head masks: None, or per
        sequence ``[num_pages, N_kv]`` bool, which kv heads see each logical page (a per-head choice)."""
        q_len = query.shape[2]
        first, tail_from = self._attended_range(layer)
        exact = self.exact_prefill and not self.prefilled
        view = None
        if self.budget is not None and q_len == 1 and not exact and layer >= self.dense_layers:
            view = self.budget.view(self._start + 1, self._win_start)
        if view is None:
            if exact or (self.budget is not None and q_len == 1):  # exact prefill, or it fits the budget
                return self._live(layer, every_page(self.table, self.seqs, first)), tail_from, 0, 0, None
            return self._live(layer, self.chooser.choose(self.table, self.seqs, layer, query, first, tail_from,
                                                         q_len)), tail_from, 0, 0, None
        tail_from = max(first, min(view.tail_from, tail_from))
        sinks = view.sinks if first == 0 else 0  # a sliding layer whose window left the sinks behind
        chosen, masks = [], []
        for b, seq in enumerate(self.seqs):
            pids = self.table.pages(seq)
            live = self.table.tier_of[layer, pids] >= 0
            cand = view.candidates(live)
            cand = cand[(cand >= first) & (cand < tail_from)]
            k = cand.size if self._win_start is not None else self.budget.middle_pages
            middle, head_mask = self.chooser.middle(self.table, seq, b, layer, query, cand, k, self._rank)
            sink = np.arange(min(view.cand_lo, tail_from)) if sinks else np.zeros(0, np.int64)
            chosen.append(np.concatenate([sink, middle, np.arange(tail_from, pids.size)]).astype(np.int64))
            masks.append((pids.size, middle, head_mask))
        head_masks = None
        if any(m is not None for _, _, m in masks):  # a per-head choice: which kv heads see each page
            head_masks = [np.ones((n, self.layout.num_kv_heads), dtype=bool) for n, _, _ in masks]  # [pages, N_kv]
            for full, (_, middle, m) in zip(head_masks, masks):
                if m is not None:
                    full[middle] = m
        return chosen, tail_from, sinks, self._start + 1 - view.win_start, head_masks

    def _live(self, layer: int, chosen: list[np.ndarray]) -> list[np.ndarray]:
        """``chosen`` without dropped pages."""
        return [c[self.table.tier_of[layer, self.table.pages(seq)[c]] >= 0] for seq, c in zip(self.seqs, chosen)]

    def _rank(self, layer: int, pids: np.ndarray) -> np.ndarray:
        """The policy's priority of ``pids`` in ``layer`` ``[n]`` (computed once per step)."""
        if self._prio_step != self.step:
            info = page_info(self.table, self.step)
            L = self.layout.num_layers
            self._prio = np.broadcast_to(self.policy.priority(info), (L, info.pids.size))
            self._prio_col = np.full(int(info.pids.max(initial=-1)) + 1, -1, dtype=np.int64)
            self._prio_col[info.pids] = np.arange(info.pids.size)
            self._prio_step = self.step
        return self._prio[layer, self._prio_col[pids]]

    def end_prefill(self) -> None:
        """The prompt is in: finish its last step; with ``mode="once"``, compress it to the budget
        (per layer, the middle pages the policy ranks below the budget's are dropped for good)."""
        self.finish_step()
        if self.prefilled:
            return
        self.prefilled = True
        if self.budget is None or self.budget.mode != "once":
            return
        n = self.get_seq_length()
        view = self.budget.view(n + 1)  # the first decode token's spans
        if view is None:
            return
        self._win_start = view.win_start
        for layer in range(self.layout.num_layers):
            drop = []
            for seq in self.seqs:
                pids = self.table.pages(seq)
                cand = view.candidates(self.table.tier_of[layer, pids] >= 0)
                keep = np.argsort(-self._rank(layer, pids[cand]), kind="stable")[:self.budget.middle_pages]
                drop.append(pids[np.delete(cand, keep)])
            drop = np.concatenate(drop)
            self.transfer.wait(layer, drop)
            self.stats.compressed_pages += self.table.drop(layer, drop).size

    def _observe(self, layer: int, parts, query: torch.Tensor, lse: torch.Tensor, scale: float) -> None:
        """Gather what the policy's scorer needs from this call: attention per page of the newest
        rows, the newest queries (handed over when the step finishes)."""
        B, H, q_len, D = query.shape
        rows = self.policy.attention_rows
        if rows != 0:
            r = q_len if rows is None else min(rows, q_len)
            qr = query[:, :, q_len - r:].transpose(1, 2)  # [B, r, H, D]
            lr = lse.view(B, q_len, H)[:, q_len - r:]  # [B, r, H]
            pos = torch.arange(self._start + q_len - r, self._start + q_len, device=query.device).expand(B, r)
            for part in parts:
                mass = page_attention(part, qr, lr, pos, scale, self.layout.num_kv_heads, part.batch.window_left)
                self._attention.append((layer, part.pids, mass))
        if self.queries is not None:
            for i in range(max(0, q_len - self.queries.rows), q_len):
                self.queries.add(layer, query[0, :, i])  # the first sequence's queries

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
        every = self._live(layer, [np.arange(first, self.table.num_pages(seq)) for seq in self.seqs])
        exact = self.attention.run(self.attention.parts(self.seqs, layer, every, 1, tail_from, count=False), q, scale)
        out_all, lse_all = merge_many([(o, l) for o, l, _ in exact])  # [B, H, D], [B, H]
        self.fidelity.add(layer, *attention_fidelity(out, lse, out_all, lse_all))
        synchronize(self.device)
        self.stats.fidelity_s += time.perf_counter() - t0

    def _count_access(self, layer: int, parts, q_len: int) -> None:
        pids = np.concatenate([p.pids for p in parts])
        self.stats.attended_pages += pids.size
        if q_len == 1:
            self.stats.add_attended_tokens(self.step, sum(p.tokens for p in parts) / len(self.seqs))
        self.stats.resident_pages += sum(p.pids.size for p in parts if p.resident)
        self.policy.on_access(layer, pids, self.step)

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        self.finish_step()
        self.transfer.synchronize()
        for t in self.table.tiers:
            t.close()
