"""FastEngine: batched tiered decode, one captured CUDA graph per batch-size bucket, replayed every token.

A decode step's GPU work (the model, the K/V writes, the scope's page choice and the static-shape
paged attention) reads only static device tensors: the block table ``[L, rows, max_pages]``
(per layer, row and logical page: ``x >= 0`` a device slot, ``x < 0`` host slot ``-x - 1``, read
in place through its mapped address), the sequence lengths and the input tokens. The host does the
bookkeeping once per step, around the replay, and never waits for the GPU except to bound how far
it runs ahead:

1. take what step ``t - k`` produced (``k = lookahead``): the pages each layer's scope attended and,
   for salience policies, their salience; the policy hears them (``on_access``, ``on_salience``);
2. grow every sequence by one token (a new page, in the device tier, every ``page_size`` steps);
3. the scheduler plans only when the device is short of room, or when some page lives off the device
   and something changed since the last plan (pages appended, accesses or salience heard, a sequence
   freed); its moves run on the side stream without waiting for compute; a moved page is read at its
   old place until its copy has landed, then the device table points at the new place (fenced
   moves, :mod:`kvtier.tiers.transfer`);
4. copy the changed table rows, lengths and tokens to the device, replay the bucket's graph.

So the pages that step ``t`` picked are promoted during step ``t + 1`` and resident from step
``t + k`` on (``lookahead=0``: nothing is fed back; misses are read in place from host memory).
With the recall cache (``recall_slots > 0``, scope ``topk``) the captured step copies its own misses
into HBM slots, resident from step ``t + 1``, and the picks are not fed back: ``lookahead`` then only
bounds how many steps the host runs ahead of the GPU (bench/RESULTS.md, session 5: the same hit rate
at k = 0, 1, 2).

Prefill runs eagerly, one sequence and chunk at a time, over all of the sequence's pages (exact): read
in place when they are all in the device pool, else gathered from their tiers into one temporary pool.
Sequences join (:meth:`add`) and finish (:meth:`finish`) between steps; a bucket's graph is captured once
and serves every batch that fits it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.cache import ACTIVE_CACHE
from kvtier.compat import PagedCacheBase
from kvtier.errors import ConfigError, KVTierError, TierFullError
from kvtier.fast.recall import RecallCache
from kvtier.fast.runner import LlamaRunner
from kvtier.fast.scopes import QuestBounds, resident_pages
from kvtier.kernels.base import AttentionBackend, PagedBatch
from kvtier.kernels.reference import TorchBackend
from kvtier.kernels.registry import make_backend
from kvtier.layout import KVLayout
from kvtier.paged_io import write_tokens
from kvtier.quant import write_scaled
from kvtier.policies.base import Policy
from kvtier.scheduler.base import Scheduler
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.scheduler.lookahead import LookaheadScheduler
from kvtier.scopes import SCOPES
from kvtier.table import BlockTable
from kvtier.tiers.base import Tier
from kvtier.tiers.transfer import TransferEngine


@dataclass
class _Produced:
    """What one decode step leaves for the host: picks and salience, copied to pinned memory."""

    step: int
    event: object  # torch.cuda.Event, or None on the CPU
    row_seq: list  # row -> sequence id at that step (None: idle)
    accessed: torch.Tensor | None  # [L, rows, K'] logical pages the policy hears as used, -1 = none
    page_list: torch.Tensor | None  # [L, rows, K] logical pages attended (None: all), for the salience
    salience: torch.Tensor | None  # [L, rows, K, N_kv]


@dataclass
class FastStats:
    steps: int = 0
    host_wait_s: float = 0.0  # host blocked on the GPU (run-ahead bound, room for new pages)
    tail_promotions: int = 0  # pages being written that had to be promoted before a step
    counts: torch.Tensor | None = None  # [2] device int64: attended pages, of which on the device
    per_step: list = field(default_factory=list)

    def hit_rate(self) -> float:
        """Attended pages read from the device tier / attended pages (one host sync)."""
        attended, resident = self.counts.tolist()
        return resident / attended if attended else 1.0


class _PassCache(PagedCacheBase):
    """The ``past_key_values`` the decoder layers see: routes ``update`` to the engine."""

    def __init__(self, engine: "FastEngine"):
        super().__init__(engine.layout)
        self.engine, self.layout = engine, engine.layout

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.engine.store(layer_idx, key_states, value_states)
        return key_states, value_states

    def attend(self, layer: int, query: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
        return self.engine.attend(layer, query, scaling)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def _tally(table: torch.Tensor, lens: torch.Tensor, page_list: torch.Tensor | None, page_size: int) -> torch.Tensor:
    """``[2]``: pages a step attends for ``table [L, B, M]`` / ``lens [B]`` / ``page_list [L, B, K]`` (None: all),
    and how many of them are in the device pool."""
    n_pages = (lens.long() + page_size - 1) // page_size  # [B]
    if page_list is None:
        listed = torch.arange(table.shape[-1], device=table.device) < n_pages[:, None]  # [B, M]
        listed = listed.expand_as(table)  # [L, B, M]
        on_dev = listed & (table >= 0)
    else:
        listed = (page_list >= 0) & (page_list < n_pages[:, None])  # [L, B, K]
        on_dev = listed & (table.gather(-1, page_list.clamp(min=0).long()) >= 0)
    return torch.stack([listed.sum(), on_dev.sum()])


def write_decode_kv(pool: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, page_size: int, scaled: bool) -> None:
    """Each row's new K/V ``[B, N_kv, 1, D]`` into its page ``table [B, M]`` at ``positions [B]`` of ``pool``
    (``scaled``: FP8 pages, quantized against their scales; each row writes its own page)."""
    slot = table.gather(1, (positions // page_size)[:, None])[:, 0].long()  # [B] device slots
    kv = torch.stack([key[:, :, 0], value[:, :, 0]], 1)  # [B, 2, N_kv, D]
    if scaled:
        write_scaled(pool, slot, torch.arange(slot.numel(), device=slot.device), positions.long() % page_size,
                     kv.transpose(0, 1))
    else:
        pool[slot, :, positions % page_size] = kv.to(pool.dtype)


class FastEngine:
    """Batched decode of up to ``max_batch`` sequences over a device tier and an optional host tier."""

    def __init__(self, model, layout: KVLayout, tiers: list[Tier], policy: Policy,
                 scheduler: Scheduler | None = None, scope: str = "all", topk_pages: int | None = None,
                 sinks: int = 4, max_batch: int = 1, max_context: int = 4096, lookahead: int = 2, margin: int = 0,
                 recall_slots: int = 0,
                 backend: AttentionBackend | None = None, decode_kernel: str | None = None,
                 prefill: ChunkedPrefill | None = None, graphs: bool | None = None, compile: bool | None = None,
                 buckets: tuple[int, ...] | None = None):
        if scope not in SCOPES:
            raise ConfigError("scope", f"unknown scope {scope!r}; use one of {list(SCOPES)}")
        if scope == "topk" and (not isinstance(topk_pages, int) or topk_pages < 1):
            raise ConfigError("topk_pages", f"scope 'topk' needs topk_pages >= 1, got {topk_pages!r}")
        if not isinstance(lookahead, int) or lookahead < 0:
            raise ConfigError("scheduler.lookahead", f"must be an integer >= 0, got {lookahead!r}")
        if not isinstance(margin, int) or margin < 0 or (margin and scope != "topk"):
            raise ConfigError("margin", f"extra pages prefetched beyond the top-k: an integer >= 0, and only with "
                                        f"scope 'topk'; got {margin!r} with scope {scope!r}")
        if not isinstance(recall_slots, int) or recall_slots < 0 or \
                (recall_slots and (scope != "topk" or len(tiers) < 2)):
            raise ConfigError("recall_slots", f"device slots per layer for the recall cache: an integer >= 0, and only "
                                              f"with scope 'topk' and a host tier; got {recall_slots!r}")
        kinds = [t.kind for t in tiers]
        if kinds not in (["device"], ["device", "host"]):
            raise ConfigError("tiers", f"the fast path reads pages in place from HBM and pinned host DRAM; got "
                                       f"{kinds}: use [device] or [device, host], or kvtier.engine.Engine for "
                                       "disk and remote tiers")
        self.runner = LlamaRunner(model)
        self.layout, self.policy, self.scope = layout, policy, scope
        self.scheduler = scheduler or LookaheadScheduler()
        self.table = BlockTable(layout, tiers)
        self.transfer = TransferEngine(self.table)
        self.device = tiers[0].device
        self.host = tiers[1] if len(tiers) > 1 else None
        if self.device.type == "cuda" and self.host is not None and not self.host.pool(0).is_pinned():
            raise ConfigError("tiers.host", "the fast path reads host pages through their mapped address: "
                                            "the host tier must be pinned (pin_memory=True)")
        self.prefill = prefill or ChunkedPrefill()
        self.backend = backend or (make_backend("triton") if self.device.type == "cuda" else TorchBackend())
        self.decode_kernel = decode_kernel or ("triton" if self.device.type == "cuda" else "torch")
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        # torch.compile fuses the model's small ops between the attention calls (which stay eager);
        # the compiled code is then captured in the step's graph like any other launch
        compiled = self.device.type == "cuda" if compile is None else compile
        if compiled:  # each engine and bucket is one more specialisation; dynamo's default of 8 runs out
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self._forward = torch.compile(self.runner.forward, dynamic=False) if compiled else self.runner.forward
        self._tally = torch.compile(_tally, dynamic=False) if compiled else _tally
        # FP8 pages are written eagerly (their rescaling is not checked under torch.compile)
        self._write_kv = torch.compile(write_decode_kv, dynamic=False) if compiled and not layout.scaled \
            else write_decode_kv
        self.lookahead, self.topk_pages, self.sinks, self.margin = lookahead, topk_pages, sinks, margin
        self.max_batch = max_batch
        self.max_pages = layout.pages_for(max_context)
        self.buckets = tuple(sorted(buckets or [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_batch]
                                    + [max_batch]))
        policy.reset(layout.num_layers)
        L, R, M = layout.num_layers, max_batch, self.max_pages
        # one device slot per layer that idle rows write into and nothing reads
        self.scratch = np.array([int(tiers[0].alloc(layer, 1)[0]) for layer in range(L)], dtype=np.int32)
        self.mirror = np.repeat(self.scratch[:, None, None], R, 1).repeat(M, 2)  # [L, R, M] host copy
        dev = self.device
        self.block_table = torch.from_numpy(self.mirror).to(dev)  # [L, R, M] int32, what attention reads
        self.recall = None
        if recall_slots:  # the host's table is then ``home``; the step overlays the recall slots on it
            slots = np.stack([tiers[0].alloc(layer, recall_slots).numpy() for layer in range(L)])  # [L, C]
            self.recall = RecallCache(slots, M, self.scratch, dev, compile=compiled)
        self.home = self.block_table.clone() if self.recall is not None else self.block_table
        self.seq_lens = torch.zeros(R, dtype=torch.int32, device=dev)  # [R] tokens incl. the one being fed
        self.positions = torch.zeros(R, dtype=torch.int64, device=dev)  # [R] position of the token fed
        self.tokens = torch.zeros(R, dtype=torch.int64, device=dev)  # [R] input, then the greedy next token
        self.logits = torch.zeros(R, model.config.vocab_size, dtype=torch.float32, device=dev)  # [R, V]
        self.stats = FastStats(counts=torch.zeros(2, dtype=torch.int64, device=dev))
        self.row_seq: list[int | None] = [None] * R
        self.lens = np.zeros(R, dtype=np.int64)  # host copy of seq_lens
        self.bounds = QuestBounds(L, R, M, layout.num_kv_heads, layout.head_dim, layout.page_size, dev, compiled) \
            if scope == "topk" else None
        listed = topk_pages if scope == "topk" else M
        self.want_salience = policy.needs_salience
        self.page_list = torch.full((L, R, listed), -1, dtype=torch.int32, device=dev) if scope != "all" else None
        # topk with a margin: the top (k + margin) pages by Quest score are what the policy hears as used
        self.predicted = torch.full((L, R, listed + margin), -1, dtype=torch.int32, device=dev) if margin else None
        self.salience = torch.zeros(L, R, listed, layout.num_kv_heads, device=dev) if self.want_salience else None
        self.kv = _PassCache(self)
        self.step_idx = -1
        self._next_seq = 0
        self._produced: list[_Produced] = []
        self._to_free: list[tuple[int, object]] = []  # (sequence, event of the last step that used it)
        self._plans: dict[int, object] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._last_event = None
        self._mode = "decode"
        self._B = max_batch
        self._dirty: set[int] = set()  # rows whose block-table entries changed since the last upload
        self._news = True  # the policy heard something since the last plan (appends, accesses, salience)
        self._prefilling: set[int] = set()  # rows opened and not yet decoding (their table row: scratch)

    # -- sequences -----------------------------------------------------------------------------
    @torch.no_grad()
    def add(self, prompt: torch.Tensor, all_logits: bool = False) -> tuple[int, torch.Tensor]:
        """Prefill ``prompt [S]`` as a new sequence: ``(sequence id, logits [S or 1, V])``.

        The greedy next token becomes the sequence's input of the next :meth:`step`.
        """
        S = int(prompt.numel())
        seq = self.open(S)
        out = [self.prefill_chunk(seq, prompt[a:b], all_logits) for a, b in self.prefill.chunks(S)]
        self.start_decode(seq, out[-1][-1].argmax())
        return seq, torch.cat(out) if all_logits else out[-1]

    def open(self, n_tokens: int, prefix_pids=(), prefix_len: int = 0) -> int:
        """A new sequence of up to ``n_tokens`` prompt tokens on a reserved row, not decoded until
        :meth:`start_decode`; it shares the pages ``prefix_pids`` holding its first ``prefix_len`` tokens
        (e.g. a radix-cache match). Its prompt is then computed by :meth:`prefill_chunk`, between steps."""
        if len(prefix_pids) and self.bounds is not None:
            raise ConfigError("scope", "'topk' builds each row's key bounds while it prefills, and a shared "
                                       "prefix is not prefilled: use scope 'all' or 'resident' to share prefixes")
        seq, _ = self._open_row(n_tokens, prefix_pids, prefix_len)
        return seq

    @torch.no_grad()
    def prefill_chunk(self, seq: int, ids: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """Compute the next ``q`` prompt tokens ``ids [q]`` of an opened ``seq``: logits ``[q or 1, V]``."""
        row, a = self._prefilling_row(seq), self.table.seq_len(seq)
        q = int(ids.numel())
        self._mode, token = "prefill", ACTIVE_CACHE.set(self.kv)
        try:
            self._grow(seq, row, q)
            self._prefill = (seq, row, a, q)
            pos = torch.arange(a, a + q, device=self.device)[None]  # [1, q]
            out = self.runner.forward(ids.view(1, q).to(self.device), pos, self.kv, last_only=not all_logits)[0]
            self._schedule(reserve=self._room_needed(), after_compute=True)
        finally:
            self._mode = "decode"
            ACTIVE_CACHE.reset(token)
        return out

    def start_decode(self, seq: int, next_token) -> None:
        """``seq``'s prompt is in its pages: it decodes from the next :meth:`step`, fed ``next_token``."""
        row = self._prefilling_row(seq)
        self._prefilling.discard(row)
        pids = self.table.pages(seq)
        for layer in range(self.layout.num_layers):
            self.transfer.wait(layer, pids)  # pages moved while it prefilled are read at their new place
            self.mirror[layer, row, :pids.size] = self._encode(layer, pids)
        self.lens[row] = self.table.seq_len(seq)
        self.tokens[row] = next_token
        self._dirty.add(row)

    def _prefilling_row(self, seq: int) -> int:
        row = self.row_seq.index(seq) if seq in self.row_seq else None
        if row is None or row not in self._prefilling:
            raise KVTierError(f"sequence {seq} is not being prefilled: open() it first")
        return row

    @torch.no_grad()
    def add_written(self, n_tokens: int, kv_of, next_token: int = 0) -> int:
        """A new sequence whose first ``n_tokens`` K/V are given, not computed: ``kv_of(layer, start, end)``
        returns ``[2, end - start, N_kv, D]`` (stored KV, or synthetic context for benchmarks)."""
        seq, row = self._open_row(n_tokens)
        self._mode = "prefill"
        try:
            for a, b in self.prefill.chunks(n_tokens):
                self._grow(seq, row, b - a)
                self._prefill = (seq, row, a, b - a)
                for layer in range(self.layout.num_layers):
                    kv = kv_of(layer, a, b).transpose(1, 2)[:, None]  # [2, 1, N_kv, q, D]
                    self.store(layer, kv[0], kv[1])
                self._schedule(reserve=self._room_needed(), after_compute=True)
        finally:
            self._mode = "decode"
        self.start_decode(seq, next_token)
        return seq

    def _open_row(self, n_tokens: int, prefix_pids=(), prefix_len: int = 0) -> tuple[int, int]:
        if n_tokens < 1 or n_tokens + 1 > self.max_pages * self.layout.page_size:
            raise ConfigError("prompt", f"{n_tokens} tokens do not fit max_context="
                                        f"{self.max_pages * self.layout.page_size}")
        row = next((r for r, s in enumerate(self.row_seq) if s is None), None)
        if row is None:
            raise KVTierError(f"all {self.max_batch} rows are busy; finish a sequence or raise max_batch")
        self._free_finished(block=True)
        seq = self._next_seq
        self._next_seq += 1
        self.table.add_sequence(seq, prefix_pids, prefix_len)
        self.row_seq[row] = seq
        self._prefilling.add(row)  # its table row stays the scratch slot until start_decode
        if self.recall is not None:
            self.recall.forget_row(row)
        if self.bounds is not None:
            self.bounds.reset_row(row)
        return seq, row

    def finish(self, seq: int) -> None:
        """Drop ``seq``: its row goes idle now, its pages are freed once no queued step can use them."""
        row = self.row_seq.index(seq)
        self.row_seq[row] = None
        self._prefilling.discard(row)
        self.lens[row] = 0
        self.mirror[:, row] = self.scratch[:, None]
        self._dirty.add(row)
        self._to_free.append((seq, self._last_event))

    def reclaim(self) -> None:
        """Free the pages of finished sequences now (waiting for the queued steps that read them)."""
        self._free_finished(block=True)

    # -- decode --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, tokens: dict[int, int] | None = None) -> torch.Tensor:
        """One decode token for every active sequence: logits ``[rows of the bucket, V]`` (device).

        Each sequence's input is its greedy token from the last step (or prefill), unless
        ``tokens`` (sequence -> token id) forces it. Row r of the result is ``self.row_seq[r]``.
        """
        active = [r for r, s in enumerate(self.row_seq) if s is not None and r not in self._prefilling]
        if not active:
            raise KVTierError("no active sequence: add() one first")
        B = next(b for b in self.buckets if b > max(active))
        self._take_produced(upto=self.step_idx + 1 - self.lookahead if self.lookahead else None)
        self._free_finished(block=False)
        self.step_idx += 1
        self.policy.on_step(self.step_idx)
        for r in active:
            self._grow(self.row_seq[r], r, 1)
        if self.scope == "all" or (self.scope == "resident" and not self.lookahead):
            self._note_access(active)
        self._schedule(reserve=self._room_needed(), after_compute=False)
        self._switch_landed()
        self._ensure_tails(active)
        if tokens:
            for seq, tok in tokens.items():
                self.tokens[self.row_seq.index(seq)] = tok
        self._upload()
        self._B = B
        if self.graphs:
            self._replay(B)
        else:
            self._decode(B)
        self._record(B)
        self.stats.steps += 1
        return self.logits[:B]

    def _decode(self, B: int) -> None:
        """The captured work: ``tokens[:B]`` -> ``logits[:B]``, greedy next tokens into ``tokens[:B]``."""
        token = ACTIVE_CACHE.set(self.kv)
        try:
            logits = self._forward(self.tokens[:B, None], self.positions[:B, None], self.kv, last_only=True)
        finally:
            ACTIVE_CACHE.reset(token)
        self.logits[:B] = logits[:, 0]
        self.tokens[:B] = logits[:, 0].argmax(-1)
        # attended pages and those read from the device tier, all layers at once (the tables after the
        # recall overlay are the ones attention read)
        page_list = self.page_list[:, :B] if self.page_list is not None else None
        self.stats.counts += self._tally(self.block_table[:, :B], self.seq_lens[:B], page_list, self.layout.page_size)
        if self.recall is not None:
            self.recall.next_step()

    def _replay(self, B: int) -> None:
        graph = self._graphs.get(B)
        if graph is None:
            saved = [t.clone() for t in self._step_state()]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._decode(B)  # warm-up: Triton compiles, cuBLAS picks kernels
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._decode(B)
            self._graphs[B] = graph
            for t, before in zip(self._step_state(), saved):  # the warm-up step did not happen
                t.copy_(before)
        graph.replay()

    def _step_state(self) -> list[torch.Tensor]:
        """Device state a step advances besides the pages: input tokens, counters, the recall cache."""
        state = [self.tokens, self.stats.counts]
        if self.recall is not None:
            state += [self.recall.page, self.recall.stamp, self.recall.step, self.recall.copied]
        return state

    # -- what the decoder layers call (left out of torch.compile: host logic and Triton launches) --
    @torch.compiler.disable
    def store(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write the step's K/V ``[B, N_kv, q, D]`` of ``layer`` into its pages."""
        if self._mode == "prefill":
            seq, row, start, _ = self._prefill
            kv = torch.stack([key[0], value[0]]).transpose(1, 2)  # [2, q, N_kv, D]
            write_tokens(self.table, layer, seq, kv, start)
            if self.bounds is not None:
                self.bounds.add_tokens(layer, row, kv[0], start)
            return
        B, P = self._B, self.layout.page_size
        if self.recall is not None:
            self.recall.overlay(layer, self.home[layer, :B], self.block_table[layer, :B])
        pos = self.positions[:B]  # [B]
        self._write_kv(self.table.tiers[0].pool(layer), self.block_table[layer, :B], pos, key, value, P,
                       self.layout.scaled)
        if self.bounds is not None:
            self.bounds.add_decode(layer, key[:, :, 0], pos)

    @torch.compiler.disable
    def attend(self, layer: int, query: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
        """Attention of ``query [B, H, q, D]`` of ``layer``: ``[B, q, H, D]``."""
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        if self._mode == "prefill":
            return self._attend_prefill(layer, query, scale)
        return self._attend_decode(layer, query, scale)

    def _attend_prefill(self, layer: int, query: torch.Tensor, scale: float) -> torch.Tensor:
        seq, _, _, q_len = self._prefill
        pids = self.table.pages(seq)
        self.transfer.wait(layer, pids)
        tiers, slots = self.table.locate(layer, pids)
        if (tiers == 0).all():  # read in place: no copy of the (cached) prefix
            pool, indices = self.table.tiers[0].pool(layer), slots
        else:  # some pages on the host: copies of them all in one temporary pool [n, 2, P, N_kv, D]
            pool, indices = self.transfer.gather(layer, pids, self.device)[0], np.arange(pids.size)
        last = (self.table.seq_len(seq) - 1) % self.layout.page_size + 1
        batch = PagedBatch.from_host([0, q_len], [0, pids.size], indices, [last],
                                     self.layout.page_size, True, self.device, window_left=self._window_left(layer))
        _, H, _, D = query.shape
        self.backend.plan(batch, H, self.layout.num_kv_heads, D, scale)
        q = query[0].transpose(0, 1).contiguous()  # [q, H, D]
        return self.backend.run(q, pool).out[None]  # [1, q, H, D]

    def _attend_decode(self, layer: int, query: torch.Tensor, scale: float) -> torch.Tensor:
        from kvtier.kernels.triton_static_decode import static_decode, static_decode_reference

        B, H, _, D = query.shape
        q = query[:, :, 0].contiguous()  # [B, H, D]
        table, lens = self.block_table[layer, :B], self.seq_lens[:B]  # [B, M], [B]
        page_list = self._choose(layer, q, table, lens)  # [B, K] or None
        host_pool = self.host.pool(layer) if self.host is not None else None
        page_max = None
        if self.want_salience:
            page_max = torch.empty(B, page_list.shape[1] if page_list is not None else self.max_pages, H,
                                   device=self.device)
        kernel = static_decode if self.decode_kernel == "triton" else static_decode_reference
        out, lse = kernel(q, self.table.tiers[0].pool(layer), host_pool, table, lens, self._plan(B, H, D), scale,
                          page_list=page_list, window_left=self._window_left(layer), page_max=page_max)
        if self.recall is not None:
            self.recall.admit(layer, page_list, table, self.table.tiers[0].pool(layer), host_pool)
        if page_max is not None:
            sal = torch.exp(page_max - lse[:, None, :])  # [B, K, H]
            self.salience[layer, :B] = sal.view(B, sal.shape[1], self.layout.num_kv_heads, -1).amax(-1)
        return out[:, None]  # [B, 1, H, D]

    def _window_left(self, layer: int) -> int:
        """FlashInfer's ``window_left`` of ``layer`` (HF's sliding window W is W - 1; -1: global)."""
        return self.layout.window(layer) - 1 if self.layout.window(layer) else -1

    def _choose(self, layer, q, table, lens) -> torch.Tensor | None:
        """The scope's page list ``[B, K]`` of this layer (None: every page), kept for the host."""
        B = q.shape[0]
        if self.scope == "all":
            return None
        if self.scope == "resident":
            picks = resident_pages(table, (lens.long() - 1).clamp(min=0) // self.layout.page_size)
        else:
            picks, predicted = self.bounds.pick(layer, q, lens, self.topk_pages,
                                                -(-self.sinks // self.layout.page_size), self.margin)
            if self.predicted is not None:
                self.predicted[layer, :B] = predicted
        self.page_list[layer, :B] = picks
        return picks

    def _plan(self, B: int, H: int, D: int):
        from kvtier.kernels.triton_static_decode import plan_static_decode

        if B not in self._plans:
            self._plans[B] = plan_static_decode(B, self.max_pages, H, self.layout.num_kv_heads, D,
                                                self.layout.page_size, self.device,
                                                kv_bytes=self.layout.kv_dtype.itemsize)
        return self._plans[B]

    # -- host bookkeeping ----------------------------------------------------------------------
    def _grow(self, seq: int, row: int, n: int) -> None:
        """Append ``n`` tokens to ``seq`` (room made on the device first) and point the table at new pages."""
        P = self.layout.page_size
        need = self.layout.pages_for(self.table.seq_len(seq) + n) - self.table.num_pages(seq)
        if need and self.host is not None and self._device_free() < need:
            self._schedule(reserve=need, after_compute=True)
            if self._device_free() < need:
                self._wait_room()
        first = self.table.num_pages(seq)
        new, _ = self.table.append(seq, n)
        if new:
            pids = np.asarray(new, dtype=np.int64)
            self.policy.on_append(pids, self.step_idx)
            self._news = True
            if row not in self._prefilling:
                for layer in range(self.layout.num_layers):
                    self.mirror[layer, row, first:first + pids.size] = self._encode(layer, pids)
                self._dirty.add(row)
        length = self.table.seq_len(seq)
        if self._mode == "decode":
            self.lens[row] = length
        if length > self.max_pages * P:
            raise KVTierError(f"sequence {seq} outgrew max_context={self.max_pages * P}")

    def _encode(self, layer: int, pids: np.ndarray) -> np.ndarray:
        tiers, slots = self.table.locate(layer, pids)
        if (tiers > 1).any():
            raise KVTierError("a page outside the device and host tiers cannot be read by the fast path")
        return np.where(tiers == 0, slots, -slots - 1).astype(np.int32)

    def _device_free(self) -> int:
        return min(self.table.tiers[0].num_free(layer) for layer in range(self.layout.num_layers))

    def _room_needed(self) -> int:
        """Device pages the next ``lookahead + 2`` steps will append (kept free ahead of time)."""
        P, ahead = self.layout.page_size, self.lookahead + 2
        active = self.lens[[s is not None for s in self.row_seq]]
        return int(((active + ahead) // P - active // P).sum())

    def _schedule(self, reserve: int, after_compute: bool) -> None:
        """Plan and issue moves when the device is short of room, or when some page lives off the device
        and something changed since the last plan: the policy heard news, or a sequence's pages were freed."""
        if self.host is None:
            return
        self._switch_landed()  # landed moves give their source slots back once their fence passes
        if self._device_free() >= reserve and not (self._news and self._off_device()):
            return
        self._news = False
        self._pin_unsettled(True)
        try:
            plan = self.scheduler.plan(self.table, self.policy, max(self.step_idx, 0), reserve=reserve)
        except TierFullError:  # host slots of promotions still in flight: wait for their fences, once
            self._wait_room()
            plan = self.scheduler.plan(self.table, self.policy, max(self.step_idx, 0), reserve=reserve)
        finally:
            self._pin_unsettled(False)
        demote = [(m.layer, m.pids, m.dst) for m in plan.demote]
        self.transfer.migrate_many(demote, after_compute=after_compute, fenced=True)
        free = {m.layer: self.table.tiers[0].num_free(m.layer) - reserve for m in plan.promote}
        promote = [(m.layer, m.pids[:free[m.layer]], 0) for m in plan.promote if free[m.layer] > 0]
        self.transfer.migrate_many(promote, after_compute=after_compute, fenced=True)
        self._news |= any(m.pids.size > free[m.layer] for m in plan.promote)  # the rest waits a step

    def _off_device(self) -> bool:
        return any(self.table.tiers[1].num_used(layer) for layer in range(self.layout.num_layers))

    def _pin_unsettled(self, pinned: bool) -> None:
        """Each sequence's page before the newest may still be written by a queued step: not movable."""
        prev = [self.table.seqs[s].pids[-2] for s in self.row_seq if s is not None and self.table.num_pages(s) > 1]
        if prev:
            self.table.set_pinned(prev, pinned)

    def _switch_landed(self) -> None:
        """Point the device table at the new place of every move that has landed (and not moved on)."""
        landed = self.transfer.take_landed(fence=self._last_event)
        if not landed:
            return
        rows = [(r, self.table.pages(seq)) for r, seq in enumerate(self.row_seq)
                if seq is not None and r not in self._prefilling]
        if not rows:
            return
        held = np.concatenate([pages for _, pages in rows])  # [N] every row's pages (a shared page: each holder)
        row_of = np.concatenate([np.full(pages.size, r) for r, pages in rows])  # [N]
        logical = np.concatenate([np.arange(pages.size) for _, pages in rows])  # [N]
        for layer, pids in landed:
            pids = pids[~self.transfer.in_flight(layer, pids)]  # a later move switches those
            hit = np.isin(held, pids)  # [N]
            if hit.any():
                self.mirror[layer, row_of[hit], logical[hit]] = self._encode(layer, held[hit])
                self._dirty.update(np.unique(row_of[hit]).tolist())

    def _ensure_tails(self, active: list[int]) -> None:
        """The page each row writes this step must be in the device pool, its copy landed: else the
        scheduler (which pins those pages) makes room and promotes them, and the host waits."""
        P = self.layout.page_size
        tails = (self.lens[active] - 1) // P  # [A]
        off = (self.mirror[:, active, tails] < 0).any(0)  # [A]
        if not off.any():
            return
        missing = [(active[i], tails[i]) for i in np.flatnonzero(off)]
        self._schedule(reserve=0, after_compute=True)
        self._wait_room()
        for r, page in missing:
            pid = self.table.pages(self.row_seq[r])[page]
            for layer in np.flatnonzero(self.mirror[:, r, page] < 0):
                if self.table.tier_of[layer, pid] != 0:
                    raise KVTierError(f"layer {layer}: no device room for the page being written; the policy "
                                      "pins more pages than the device tier holds")
                self.mirror[layer, r, page] = self._encode(int(layer), np.array([pid]))[0]
            self.stats.tail_promotions += 1
            self._dirty.add(r)

    def _wait_room(self) -> None:
        """Block until fenced demotions release their device slots."""
        t0 = time.perf_counter()
        self._switch_landed()
        if self._last_event is not None:
            self._last_event.synchronize()
        self.transfer.synchronize()
        self.stats.host_wait_s += time.perf_counter() - t0

    def _note_access(self, active: list[int]) -> None:
        """Scopes known on the host (``all``; ``resident`` without lookahead): every listed page was read.
        Without a host tier nothing is ever planned, so the policy need not hear it."""
        if self.host is None or not self.policy.hears_access:
            return
        pids = np.concatenate([self.table.pages(self.row_seq[r]) for r in active])
        for layer in range(self.layout.num_layers):
            mine = pids[self.table.tier_of[layer, pids] == 0] if self.scope == "resident" else pids
            self.policy.on_access(layer, mine, self.step_idx)
        self._news = True

    def _upload(self) -> None:
        """Lengths and positions every step; the block-table rows that changed (a copy each, or one
        copy of the whole table when most rows changed)."""
        lens = torch.from_numpy(self.lens)
        self.seq_lens.copy_(lens, non_blocking=True)
        self.positions.copy_((lens - 1).clamp(min=0), non_blocking=True)
        if 2 * len(self._dirty) > self.max_batch:
            self.home.copy_(torch.from_numpy(self.mirror), non_blocking=True)
        else:
            for r in self._dirty:
                self.home[:, r].copy_(torch.from_numpy(self.mirror[:, r]), non_blocking=True)
        self._dirty.clear()

    def _record(self, B: int) -> None:
        """After a step: copy its picks and salience towards the host, and mark the step's end."""
        accessed = attended = sal = None
        # the recall cache acts on the picks itself; a policy that ignores accesses need not hear them
        hears_picks = self.page_list is not None and self.recall is None and self.policy.hears_access
        if self.lookahead and self.page_list is not None and (hears_picks or self.salience is not None):
            attended = self._to_host(self.page_list[:, :B])
        if self.lookahead and hears_picks:
            accessed = self._to_host(self.predicted[:, :B]) if self.predicted is not None else attended
        if self.lookahead and self.salience is not None:
            sal = self._to_host(self.salience[:, :B])
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self._last_event = event
        row_seq = [None if r in self._prefilling else s for r, s in enumerate(self.row_seq[:B])]
        self._produced.append(_Produced(self.step_idx, event, row_seq, accessed, attended, sal))

    def _to_host(self, x: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return x.clone()
        out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        out.copy_(x, non_blocking=True)
        return out

    def _take_produced(self, upto: int | None) -> None:
        """Feed the policy what steps ``<= upto`` attended (waiting for them); keep at most ``lookahead``
        steps in flight (``upto=None``: nothing is fed back)."""
        keep = []
        bound = self.step_idx - max(self.lookahead, 1) + 1  # steps older than this are waited for
        for p in self._produced:
            if (upto is None or p.step > upto) and p.step >= bound:
                keep.append(p)
                continue
            if p.event is not None and not p.event.query():
                t0 = time.perf_counter()
                p.event.synchronize()
                self.stats.host_wait_s += time.perf_counter() - t0
            if upto is not None and (p.accessed is not None or p.salience is not None):
                self._feed(p)
        self._produced = keep

    def _feed(self, p: _Produced) -> None:
        """The policy hears the pages step ``p`` used (attended, and the margin's predictions) and the
        salience of those it attended (scope ``all``: every page)."""
        rows = [(r, self.table.pages(seq)) for r, seq in enumerate(p.row_seq)
                if seq is not None and seq in self.table.seqs]
        if not rows:
            return
        self._news = True
        every = np.arange(self.max_pages)
        for layer in range(self.layout.num_layers):
            if p.accessed is not None:
                pids, _ = self._listed(rows, lambda r: p.accessed[layer, r].numpy())
                self.policy.on_access(layer, pids, p.step)
            if p.salience is not None:
                attended = (lambda r: p.page_list[layer, r].numpy()) if p.page_list is not None else (lambda r: every)
                pids, ok = self._listed(rows, attended)
                scores = np.concatenate([p.salience[layer, r].numpy()[m] for (r, _), m in zip(rows, ok)])
                self.policy.on_salience(layer, pids, scores, p.step)

    @staticmethod
    def _listed(rows, lists) -> tuple[np.ndarray, list[np.ndarray]]:
        """pids of each row's listed logical pages (``lists(row)``, -1 = none), and each row's valid mask."""
        pids, masks = [], []
        for r, pages in rows:
            sel = lists(r)
            ok = (sel >= 0) & (sel < pages.size)
            pids.append(pages[sel[ok]])
            masks.append(ok)
        return np.concatenate(pids), masks

    def _free_finished(self, block: bool) -> None:
        still = []
        for seq, event in self._to_free:
            if event is None or block or event.query():
                if event is not None:
                    event.synchronize()
                self.table.free(seq)
                self._news = True  # room freed: better pages may move up
            else:
                still.append((seq, event))
        self._to_free = still

    def close(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.transfer.take_landed()
        self.transfer.synchronize()
        for t in self.table.tiers:
            t.close()
