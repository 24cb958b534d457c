"""Feedback: what a step produced (pages attended, their salience and attention mass, keys attended) from
device buffers to the policy, under the lookahead bound.

Each decode layer's kernel writes per listed page its max and log-sum-exp of the scaled logits into static
buffers; :meth:`Feedback.observe` turns them into salience (max probability over the kv group) and attention mass
(mean over the group), added to the policy's statistics when the step ends (:meth:`finish`). :meth:`record` copies
the page lists and statistics' snapshots to pinned memory behind an event; :meth:`take` waits for the steps the
lookahead bound makes due and hands the policy their snapshots and ``on_access``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.errors import KVTierError
from kvtier.scopes.base import KeyList, live_mask, pages_of, window_pages
from kvtier.window import first_page


@dataclass
class Produced:
    """One step's statistics on their way to the host."""

    step: int
    event: object  # torch.cuda.Event, or None on the CPU
    rows: list  # row -> (sequence id, length) at that step, or None (idle)
    picks: dict = field(default_factory=dict)  # width -> [L, B, (N_kv,) K] pinned copies (width None: all pages)
    slot: int | None = None  # the snapshot slot of this step's statistics
    layer_width: list = field(default_factory=list)  # per layer, the width its lists had
    tokens: torch.Tensor | None = None  # [L] keys attended per row (mean)


class Feedback:
    def __init__(self, engine):
        self.engine = engine
        policy = engine.policy
        self.attention = engine.attention  # AttentionStats the step adds to
        self.wants = (set(policy.needs) & {"salience"}) | ({"attention"} if self.attention else set())
        self.hears_access = policy.hears_access  # the policy hears the pages attended, on the host
        self.snapshotted = [*self.attention, *engine.salience, *engine.scores]  # what the host reads from snapshots
        self._slots = engine.snapshot_slots - 1  # the ring of steps' snapshots; slot _slots: one taken now
        self._buffers: dict = {}  # width -> dict of device buffers [L, R, ...]
        self._layer_width: list = [None] * engine.layout.num_layers
        self._step: dict = {}  # layer -> page list (or key list) of the step being computed
        self._keys: set = set()  # the layers whose lists this step are key lists
        self.tokens = torch.zeros(engine.layout.num_layers, device=engine.device)  # [L] keys attended per row
        self._produced: list[Produced] = []
        self.last_event = None  # the event that marks the last decode step's end (None: none, or a CPU)
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}  # (slot, pids, queries kept) -> the captured snapshot
        self._pool = None  # their memory pool
        self._windows = np.array([engine.layout.window(layer) for layer in range(engine.layout.num_layers)])  # [L]
        # no sliding window: a layer that attends every page sees each row's every page (none is dropped)
        self._all_pages_every_layer = not self._windows.any()

    def state(self) -> list[torch.Tensor]:
        return [self.tokens]

    def _bufs(self, width: int, per_head: bool) -> dict:
        key = (width, per_head)
        if key not in self._buffers:
            e = self.engine
            L, R, n_kv = e.layout.num_layers, e.config.max_batch, e.layout.num_kv_heads
            b = {"picks": torch.full((L, R, n_kv, width) if per_head else (L, R, width), -1, dtype=torch.int32,
                                     device=e.device)}
            for name in self.wants:
                b[name] = torch.zeros(L, R, width, n_kv, device=e.device)
            self._buffers[key] = b
        return self._buffers[key]

    def buffers(self, B: int, picks: torch.Tensor | None, heads: int) -> dict:
        """The kernel's page-statistics outputs (``page_max``/``page_lse`` ``[B, K, H]``, scratch shared by the
        layers: :meth:`observe` reduces them over each kv group at once)."""
        if not self.wants:
            return {}
        width = self.engine.max_pages if picks is None else picks.shape[-1]
        out = {}
        if "salience" in self.wants:
            out["page_max"] = self._scratch("page_max", width, heads)[:B]
        if "attention" in self.wants:
            out["page_lse"] = self._scratch("page_lse", width, heads)[:B]
        return out

    def _scratch(self, name: str, width: int, heads: int) -> torch.Tensor:
        key = ("scratch", name, width)
        if key not in self._buffers:
            e = self.engine
            self._buffers[key] = torch.empty(e.config.max_batch, width, heads, device=e.device)
        return self._buffers[key]

    def observe(self, layer: int, picks: torch.Tensor | None, lse: torch.Tensor, keys: bool = False) -> None:
        """After a layer's decode call with page list ``[B, (N_kv,) K]`` (``keys``: a key list) and final LSE ``[B,
        H]``: the per-entry salience ``[B, K, N_kv]`` (max probability over the kv group) and attention mass (mean
        over the group) into the step's buffers; the list is kept for :meth:`finish`."""
        e = self.engine
        B, H = lse.shape
        width = e.max_pages if picks is None else picks.shape[-1]
        per_head = picks is not None and picks.dim() == 3
        self._layer_width[layer] = (None if picks is None else width, per_head)
        self._step[layer] = picks
        if keys:
            self._keys.add(layer)
        if not self.wants:
            return
        bufs, n_kv = self._bufs(width, per_head), e.layout.num_kv_heads
        for name, stat, reduce in (("salience", "page_max", torch.amax), ("attention", "page_lse", torch.mean)):
            if name in self.wants:
                prob = torch.exp(self._scratch(stat, width, H)[:B] - lse[:, None, :])  # [B, K, H]
                bufs[name][layer, :B] = reduce(prob.view(B, width, n_kv, H // n_kv), -1)

    def complete(self) -> bool:
        """Every layer attended in the step being computed."""
        return len(self._step) == self.engine.layout.num_layers

    def drop_step(self) -> None:
        self._step.clear()
        self._keys.clear()

    def group_lists(self, layers: range) -> tuple[torch.Tensor | None, bool]:
        """The lists a group of layers attended this step ``[L', B, (N_kv,) K]`` (None: every page), and whether
        they are key lists."""
        picks = [self._step[layer] for layer in layers]
        kinds = {None if p is None else (tuple(p.shape), layer in self._keys) for p, layer in zip(picks, layers)}
        if len(kinds) > 1:
            raise KVTierError(f"scope '{self.engine.scope.name}' gave layers {layers.start}-{layers.stop - 1} (one "
                              f"window, all dense or all budgeted) lists of different shapes or kinds "
                              f"{sorted(map(str, kinds))}; a scope's lists must share their shape within such a group")
        return (None, False) if picks[0] is None else (torch.stack(picks), layers[0] in self._keys)

    def group_pages(self, layers: range) -> torch.Tensor | None:
        """The pages a group of layers read this step: its page lists, or each row's pages of its key lists once
        each ``[L', B, K]`` (None: every page)."""
        picks, keys = self.group_lists(layers)
        e = self.engine
        return pages_of(KeyList(picks) if keys else picks, e.max_pages, e.layout.page_size)

    def finish(self, layers: range, B: int, picks: torch.Tensor | None, tokens: torch.Tensor) -> None:
        """When the step ends, per layer group: keys seen ``tokens [L']``, the lists into the step's buffers and the
        attention mass and salience into the policy's statistics."""
        at = slice(layers.start, layers.stop)
        self.tokens[at] = tokens
        width, per_head = self._layer_width[layers[0]]
        e = self.engine
        keys = picks is not None and layers[0] in self._keys
        pages = torch.where(picks >= 0, picks // e.layout.page_size, -1) if keys else picks  # each entry's page
        if picks is not None and self.hears_access:
            self._bufs(width, per_head)["picks"][at, :B] = pages
        if self.attention or e.salience:
            bufs = self._bufs(e.max_pages if width is None else width, per_head)
            logical = self._listed(layers, B) if picks is None else \
                pages.reshape(len(layers), B, -1, picks.shape[-1])  # [L', B, G, K]
            live = e.buffers.seq_lens[:B] > 0
            for stats, name, reduce in [*((a, "attention", "sum") for a in self.attention),
                                        *((s, "salience", "amax") for s in e.salience)]:
                value = bufs[name][at, :B]  # [L', B, K, N_kv] per entry
                listed, value = per_page(logical, value, reduce) if keys else (logical, value)
                stats.add_step(layers, listed, e.buffers.pid_table[:B], value, live)

    def _listed(self, layers: range, B: int) -> torch.Tensor:
        """Every live page the layers' window shows, as page lists ``[L', B, 1, M]`` (logical, -1 none)."""
        e = self.engine
        table = e.buffers.block_table[layers.start:layers.stop, :B]  # [L', B, M]
        lens = e.buffers.seq_lens[:B].long()
        first, _ = window_pages(lens.clamp(min=1), e.layout.window(layers[0]), e.layout.page_size)  # [B]
        logical = torch.arange(table.shape[-1], device=table.device)
        seen = live_mask(table, lens, e.layout.page_size) & (logical >= first[:, None])
        return torch.where(seen, logical, -1)[:, :, None]

    def record(self, B: int) -> None:
        """After a decode step: its buffers and attention statistics towards the host, and the step's end event."""
        e = self.engine
        plan = e.plan
        p = Produced(e.step_idx, None, [None if r in plan.prefilling or s is None else (s, int(plan.lens[r]))
                                        for r, s in enumerate(plan.row_seq[:B])])
        p.layer_width = list(self._layer_width)
        p.tokens = _to_host(self.tokens, e.device)
        if self.hears_access:
            for (width, per_head) in set(self._layer_width):
                if width is None:
                    continue
                p.picks[(width, per_head)] = _to_host(self._bufs(width, per_head)["picks"][:, :B], e.device)
        if self.snapshotted:
            p.slot = e.step_idx % self._slots
            self._snapshot(p.slot, e.table.ref.size)
        if e.device.type == "cuda":
            p.event = torch.cuda.Event(enable_timing=True)
            p.event.record()
        self.last_event = p.event
        self._produced.append(p)

    def take(self, upto: int | None) -> None:
        """Hand the policy what steps ``<= upto`` produced (waiting for them) and any prefill chunk's; at most
        ``lookahead`` steps stay in flight. ``upto=None``: only wait (nothing is fed back). ``upto`` at the current
        step: the snapshotted statistics (attention, device scores) as they are now (after a wait for the queued work)."""
        e = self.engine
        keep, shown = [], None
        bound = e.step_idx - max(e.lookahead, 1) + 1  # steps older than this are waited for
        for p in self._produced:
            if (upto is None or p.step > upto) and p.step >= bound:
                keep.append(p)
                continue
            if p.event is not None and not p.event.query():
                t0 = time.perf_counter()
                p.event.synchronize()
                e.stats.host_wait_s += time.perf_counter() - t0
            if upto is not None:
                self._feed(p)
                shown = p
        self._produced = keep
        if not self.snapshotted or upto is None:
            return
        if upto >= e.step_idx:
            self._snapshot(self._slots, e.table.ref.size)
            if e.device.type == "cuda":
                t0 = time.perf_counter()
                torch.cuda.current_stream().synchronize()
                e.stats.host_wait_s += time.perf_counter() - t0
            for stats in self.snapshotted:
                stats.show(self._slots, e.step_idx)
        elif shown is not None:
            for stats in self.snapshotted:
                stats.show(shown.slot, shown.step)

    def _snapshot(self, slot: int, pids: int) -> None:
        """Every snapshotted statistic of the first ``pids`` pids into pinned slot ``slot`` (queued). An engine that
        captures its steps replays this chain of small reductions and copies from one CUDA graph per ``(slot,
        pids)`` and whether the queries are kept yet (a scorer reads them once they are), captured after its first
        eager run; the graphs share one memory pool (they run one after another)."""
        def work():
            for stats in self.snapshotted:
                stats.snapshot(slot, pids)

        key = (slot, pids, self.engine.queries is not None)
        graph = self._graphs.get(key)
        if graph is not None:
            return graph.replay()
        work()
        if self.engine.graphs:
            self._graphs[key] = graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                work()
            self._pool = graph.pool()

    def _feed(self, p: Produced) -> None:
        """The policy hears the pages step ``p`` attended and their statistics: one call per hook for every layer
        (``layer`` is then the ``[n]`` layer of each page, or ``slice(None)`` when every layer attended every page
        of every row and only accesses are heard), pids in each row's page order."""
        e = self.engine
        rows = [(r, e.table.pages(s)[:e.layout.pages_for(n)], n) for r, x in enumerate(p.rows) if x is not None
                for s, n in [x] if s in e.table.seqs]
        if not rows:
            return
        e.stats.add_attended_tokens(p.step, float(p.tokens.sum()), calls=e.layout.num_layers)
        if not self.hears_access:
            return
        picks = {k: v.numpy() for k, v in p.picks.items()}  # pinned host copies: numpy views, no copy
        if self._all_pages_every_layer and all(w is None for w, _ in p.layer_width):
            e.policy.on_access(slice(None), np.concatenate([pages for _, pages, _ in rows]), p.step)
            return
        batch_rows = np.array([r for r, _, _ in rows])  # [R]
        lens = np.array([n for _, _, n in rows])  # [R]
        n_pages = np.array([pages.size for _, pages, _ in rows])  # [R]
        pids = np.full((len(rows), n_pages.max()), -1, dtype=np.int64)  # [R, M] each row's pids, -1 beyond
        for i, (_, pages, _) in enumerate(rows):
            pids[i, :pages.size] = pages
        parts = []  # (layer [u], pid [u]) per layer width
        for key in dict.fromkeys(p.layer_width):
            layers = np.array([layer for layer, w in enumerate(p.layer_width) if w == key])  # [L']
            lists = None if key[0] is None else picks[key][layers[:, None], batch_rows[None, :]]  # [L', R, (N_kv,) K]
            row, at, logical = self._attended(layers, pids, n_pages, lens, lists)
            parts.append((layers[at], pids[row, logical]))
        e.policy.on_access(np.concatenate([x[0] for x in parts]), np.concatenate([x[1] for x in parts]), p.step)

    def _attended(self, layers: np.ndarray, pids: np.ndarray, n_pages: np.ndarray, lens: np.ndarray,
                  lists: np.ndarray | None):
        """The distinct pages each row (pids ``[R, M]``, ``n_pages [R]``, ``lens [R]`` tokens) attended in each of
        ``layers [L']``, from page lists ``lists [L', R, (1 or N_kv) * K]`` (None: every live page the layer's window
        shows): ``(row [u], at [u], logical [u])`` (row, index into ``layers``, logical page; sorted by row, layer,
        page)."""
        e = self.engine
        R, M = pids.shape
        if lists is None:
            first = first_page(lens[None, :] - 1, self._windows[layers][:, None], e.layout.page_size)  # [L', R]
            logical = np.arange(M)
            seen = (e.table.tier_of[layers[:, None, None], pids.clip(min=0)[None]] >= 0) & \
                (logical < n_pages[:, None]) & (logical >= first[..., None])  # [L', R, M]
            return np.nonzero(seen.transpose(1, 0, 2))  # sorted by row, layer, page
        L = layers.size
        lists = lists.reshape(L, R, -1)  # [L', R, G * K]
        listed = (lists >= 0) & (lists < n_pages[None, :, None])
        start = (np.arange(R)[None, :, None] * L + np.arange(L)[:, None, None]) * M  # [L', R, 1] each list's in seen
        seen = np.zeros(R * L * M, dtype=bool)  # [R, L', M] flat; a page listed by several heads counts once
        seen[(lists + start)[listed]] = True
        row, rest = np.divmod(np.flatnonzero(seen), L * M)  # sorted by row, layer, page
        return (row, *np.divmod(rest, M))


def per_page(pages: torch.Tensor, value: torch.Tensor, reduce: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A key list's per-key statistics as per-page ones: ``pages [L', B, N_kv, W]`` (each key's page, position order:
    a page's keys are one run) and ``value [L', B, W, N_kv]`` (entry k of list g: ``value[..., k, g]``) ->
    ``(pages, value)`` with each run's first entry holding the run's ``reduce`` ("sum", "amax") and the rest -1 and
    0, so that a page counts once per kv head."""
    start = torch.ones_like(pages, dtype=torch.bool)
    start[..., 1:] = pages[..., 1:] != pages[..., :-1]
    run = start.long().cumsum(-1) - 1  # [L', B, N_kv, W] the run of each entry
    v = value.transpose(-1, -2)  # [L', B, N_kv, W]
    total = torch.zeros_like(v).scatter_reduce(-1, run, v, reduce=reduce, include_self=False)
    head = start & (pages >= 0)
    return torch.where(head, pages, -1), torch.where(head, total.gather(-1, run), 0.0).transpose(-1, -2)


def _to_host(x: torch.Tensor, device) -> torch.Tensor:
    if device.type != "cuda":
        return x.clone()
    out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    out.copy_(x, non_blocking=True)
    return out
