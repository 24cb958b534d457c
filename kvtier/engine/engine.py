"""Engine: the one data plane. Every caller (recipes, ``generate`` through :class:`~kvtier.cache.TieredKVCache`,
serving, disaggregation, benches) drives the same step over the same block table, tiers and policy.

A step is **plan -> run -> feedback**:

1. plan (host): the policy hears what step ``t - lookahead`` produced (:mod:`kvtier.engine.feedback`);
   pages left of every sliding window are dropped; the scheduler plans and the mover issues its copies
   (on a GPU on a side stream; the step reads a moved page at its new place, its compute ordered after
   the copy, so placement never depends on copy timing); rows grow (new pages in the device tier); the
   token budget's spans and the policy's ranks are computed; the changed block-table rows, lengths, positions and tokens are copied to the step's
   static device buffers (:class:`~kvtier.scopes.base.StepView` reads them).
2. run: the model forward (:mod:`kvtier.engine.runner`), eager or one CUDA-graph replay per batch
   bucket. A scope whose choice reads no query plans the page lists of each layer group at once; per
   layer the attention module calls :meth:`Engine.store` (the K/V write, :mod:`kvtier.mover.paged_io`) and
   :meth:`Engine.attend`: the planned list (or the scope's pick for this layer's query), then one decode
   kernel (:func:`~kvtier.kernels.triton_decode.static_decode`, or its torch oracle) reads the pages where
   they live (device, pinned host, or disk/remote pages staged into pinned memory before the step) and
   writes per-page statistics, which become the salience / attention mass the policy needs in device
   buffers. When the last layer is done, one batch of device ops per layer group
   (:meth:`Engine._finish_step`) tallies the pages and updates the key/query statistics.
3. feedback: those buffers are copied to pinned host memory and an event marks the step's end; the
   host goes on with the next step and takes them when the lookahead bound says so.

A step is an iteration (:meth:`Engine.iterate`): one forward over a token row of decode rows, then prompt chunks
of several sequences; the chunks are written and attended through the same store/attend
(:mod:`kvtier.engine.prefill`: one varlen call per layer, planned once per iteration), and an iteration whose
pages are all in HBM is replayed from a CUDA graph per (decode rows, token bucket). The step's
research semantics live here once: the token budget (sinks, the policy-ranked or Quest-chosen middle,
the recent window), compress-once when the prompt is in (``budget.mode == "once"``), sliding windows
with their dropped pages, every scorer's statistics, fidelity as an observer of the step's
``(out, lse)`` against an uncounted exact pass.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from kvtier.budget import TokenBudget, token_budget
from kvtier.cache_base import ACTIVE_CACHE, PassCache
from kvtier.checks import (check_decode_kernel, check_dense_layers, check_device_room, check_engine_args,
                           check_recall_room, check_salience, check_scheduler, graphs_for)
from kvtier.compiling import compile_step, make_room
from kvtier.engine.config import EngineConfig
from kvtier.engine.feedback import Feedback
from kvtier.engine.pages import SequencePages
from kvtier.engine.prefill import CAPTURE_TOKENS, Chunk, PrefillAttention
from kvtier.engine.runner import LlamaRunner, make_runner
from kvtier.errors import ConfigError, KVTierError, TierFullError
from kvtier.eval.fidelity import FidelityStats, attention_fidelity
from kvtier.kernels.reference import TorchBackend
from kvtier.kernels.registry import backend_for
from kvtier.layout import KVLayout
from kvtier.metrics import CacheStats, synchronize
from kvtier.mover.paged_io import read_tokens, store_rows, write_decode, write_tokens
from kvtier.mover.staging import Staging
from kvtier.mover.transfer import TransferEngine
from kvtier.policies.base import Policy
from kvtier.policies.stats import NEEDS
from kvtier.scheduler.base import Ranking, Scheduler, pairs
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.scheduler.lookahead import LookaheadScheduler
from kvtier.scopes import All, Resident, Scope, StepView, make_scope
from kvtier.kernels.base import DROPPED
from kvtier.scopes.base import KeyList, pages_of
from kvtier.scopes.recall import RecallCache, admission_batches
from kvtier.stats import AttentionStats, DeviceScores, KeyStats, QueryStats, SalienceStats
from kvtier.table import BlockTable
from kvtier.tiers.base import Tier, rank_in_layer
from kvtier.window import out_of_window

TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, CAPTURE_TOKENS)  # chunk tokens a captured iteration is padded to


@dataclasses.dataclass
class Iteration:
    """What one :meth:`Engine.iterate` computed."""

    logits: torch.Tensor | None  # [B, V] the decode rows' (row r is Engine.row_seq[r]); None: no decode rows
    chunk_logits: list  # per chunk [q or 1, V]


def tally(table: torch.Tensor, lens: torch.Tensor, page_list: torch.Tensor | None, page_size: int,
          keys: bool = False) -> torch.Tensor:
    """``[2]``: pages (``keys``: keys of key lists, one per kv head) a group of layers attends for ``table [L', B,
    M]`` / ``lens [B]`` / ``page_list [L', B, (N_kv,) K]`` (None: all), and how many of them are in the device pool."""
    n_pages = (lens.long() + page_size - 1) // page_size  # [B]
    if page_list is None:
        listed = torch.arange(table.shape[-1], device=table.device) < n_pages[:, None]  # [B, M]
        on_dev = listed & (table >= 0)  # [L', B, M]
        return torch.stack([listed.sum() * table.shape[0], on_dev.sum()])
    lists = page_list.reshape(*table.shape[:-1], -1).long()  # [L', B, (N_kv *) K]
    listed = (lists >= 0) & (lists < (lens.long() if keys else n_pages)[:, None])
    pages = torch.where(listed, lists // page_size if keys else lists, 0)
    on_dev = listed & (table.gather(-1, pages) >= 0)
    return torch.stack([listed.sum(), on_dev.sum()])


def layer_groups(layout: KVLayout, dense_layers: int) -> list[range]:
    """Runs of consecutive layers that share a sliding window and are all dense or all budgeted: what a step
    plans and finishes with one batch of device ops each."""
    key = [(layer < dense_layers, layout.window(layer)) for layer in range(layout.num_layers)]
    cuts = [0] + [i for i in range(1, len(key)) if key[i] != key[i - 1]] + [len(key)]
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


class Engine:
    """Batched, tiered, paged attention for ``model`` over ``tiers`` with ``policy`` and ``scope``.

    ``model`` may be None when the forward is driven from outside (``generate`` through
    :class:`~kvtier.cache.TieredKVCache`). ``kernel``: a backend or its name (None: ``auto``, triton on a GPU);
    ``budget``: the keys each decode step attends (:class:`~kvtier.budget.TokenBudget`, its page size the layout's;
    None: the scope's own choice); ``exact_prefill``: prefill chunks
    attend every page until the prompt is in; ``dense_layers``: the first layers attend every page;
    ``fidelity``: measure each decode call against exact attention (an uncounted second pass).
    """

    def __init__(self, model, layout: KVLayout, tiers: list[Tier], policy: Policy, scope: Scope | str = "all",
                 scheduler: Scheduler | None = None, kernel=None, prefill: ChunkedPrefill | None = None,
                 budget: TokenBudget | None = None, exact_prefill: bool = False, dense_layers: int = 0,
                 fidelity: bool = False, config: EngineConfig | None = None):
        check_engine_args(model, layout, config, exact_prefill=exact_prefill, fidelity=fidelity)
        if not isinstance(policy, Policy):
            raise ConfigError("policy", f"must be a kvtier.policies.Policy, got {type(policy).__name__} "
                                        f"{policy!r}; e.g. kvtier.policies.SinkWindow()")
        self.config = config = config or EngineConfig()
        budget = token_budget(budget, layout.page_size)
        self.scope = make_scope(scope)
        self.layout, self.policy, self.budget = layout, policy, budget
        self.exact_prefill = exact_prefill or (budget is not None and budget.mode == "once")
        if isinstance(self.scope, All) and budget is not None and budget.mode == "continuous":
            raise ConfigError("cache.attend_budget", "scope 'all' attends every page; a continuous budget needs "
                                                     "scope resident or topk (or cache.mode once)")
        check_dense_layers(dense_layers, layout.num_layers)
        self.dense_layers = dense_layers
        self.groups = layer_groups(layout, dense_layers)
        self.scheduler = scheduler or LookaheadScheduler()
        check_scheduler(self.scheduler)
        self.table = BlockTable(layout, tiers)
        self.pages = SequencePages(self.table, policy)  # what serving reads and holds of the table
        self.transfer = TransferEngine(self.table)
        self.device = tiers[0].device
        self.kernel = backend_for(kernel, self.device)
        self.prefill = prefill or ChunkedPrefill()
        self.stats = CacheStats()
        check_decode_kernel(self.kernel)
        self._check_feedback()
        self.host = tiers[1] if len(tiers) > 1 and tiers[1].pool(0) is not None else None
        if self.device.type == "cuda" and self.host is not None and not self.host.pool(0).is_pinned():
            raise ConfigError(f"tiers.{self.host.name}", "the engine reads host pages through their mapped "
                                                         "address: the host tier must be pinned (pin_memory=True)")
        R = config.max_batch
        scratch = R > 1  # idle rows of a bucket write into one device slot per layer that nothing reads
        n_land = getattr(self.scope, "landing_slots", 0)
        room = tiers[0].capacity - scratch
        check_device_room(room, policy, layout.page_size, 0, f"tiers.{tiers[0].name}.capacity", R)
        recall_slots = check_recall_room(room, policy, layout.page_size, self.scope, R)  # what the recall cache takes
        held = sum(t.capacity for t in tiers) - scratch - recall_slots  # pages a row may hold
        self.max_pages = min(layout.pages_for(config.max_context), held) if config.max_context else held
        L, M = layout.num_layers, self.max_pages
        self.model = model
        self.runner = make_runner(model, config.runner) if model is not None else None
        on_gpu = self.device.type == "cuda"
        self.fidelity = FidelityStats() if fidelity and not isinstance(self.scope, All) else None
        reference = isinstance(self.kernel, TorchBackend)  # the oracle reads lengths on the host: not capturable
        self.graphs = graphs_for(config.graphs, self.device, reference, self.fidelity is not None, model is not None)
        self.compiled = compiled = on_gpu if config.compile is None else config.compile  # torch.compile'd step parts
        self._forward = self._forward_chunks = self.runner.forward if self.runner is not None else None
        if compiled and self.runner is not None:
            self._forward = compile_step(self.runner.forward, dynamic=False)  # a decode bucket: static rows
            # an iteration with prompt chunks: one compile for every token count (captured ones pay its guards
            # once, at capture)
            self._forward_chunks = compile_step(self.runner.forward, dynamic=True)
        self._tally = compile_step(tally, dynamic=False) if compiled else tally
        # the decode K/V write fused into one kernel (eager it is six launches a layer); 8-bit pages stay eager
        self._write_decode = compile_step(write_decode, dynamic=False) if compiled and not layout.scaled \
            else write_decode
        self._lists: dict | None = None  # layer -> page list of the step being computed (None: not planned)
        self._step_keys: dict = {}  # layer -> the decode keys [B, N_kv, D] written this step
        self._step_queries: dict = {}  # layer -> the first row's decode query [H, D]
        self.buckets = config.buckets or tuple(sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < R} | {R}))
        if compiled:  # per layer: each decode bucket, the prompt forward (its first shape, then dynamic), spare
            make_room(L * (len(self.buckets) + 3))
        self.lookahead = config.lookahead
        self.prompt_room = 0  # device slots per layer each step keeps free for a prompt chunk (keep_room)
        self._layers = np.arange(L)  # [L]
        self.scratch = (tiers[0].alloc(self._layers).numpy() if scratch else np.zeros(L)).astype(np.int32)  # [L]
        self.mirror = np.repeat(self.scratch[:, None, None], R, 1).repeat(M, 2)  # [L, R, M] host copy of locations
        self.pid_mirror = np.full((R, M), -1, dtype=np.int32)  # [R, M] pid of each logical page
        dev = self.device
        self.home = torch.from_numpy(self.mirror).to(dev)  # [L, R, M] int32: where the host placed each page
        self.block_table = self.home  # [L, R, M] what attention reads (the recall overlay writes its own)
        self.pid_table = torch.from_numpy(self.pid_mirror).to(dev)  # [R, M]
        self.seq_lens = torch.zeros(R, dtype=torch.int32, device=dev)  # [R] tokens incl. the one being fed
        self.positions = torch.zeros(R, dtype=torch.int64, device=dev)  # [R] position of the token fed
        self.tokens = torch.zeros(R, dtype=torch.int64, device=dev)  # [R] input, then the greedy next token
        self.logits = torch.zeros(R, model.config.vocab_size, device=dev) if model is not None else None  # [R, V]
        self.span_host = np.zeros((R, 2), dtype=np.int32)  # [R] (sinks, win_start) of the budget
        self.spans = torch.zeros(R, 2, dtype=torch.int32, device=dev)
        # [L, pids] the policy's priority of every pid, for scopes that choose by the policy
        self.priority = torch.zeros(L, _pid_capacity(held), dtype=torch.float64, device=dev) \
            if self.scope.needs_rank(budget) else None
        self.counts = torch.zeros(2, dtype=torch.int64, device=dev)  # attended pages, of which on the device
        self.row_seq: list[int | None] = [None] * R
        self.lens = np.zeros(R, dtype=np.int64)  # host copy of seq_lens
        self.win_start: dict[int, int] = {}  # sequence -> the window's start fixed by compress-once
        self._ranking = None  # the policy's Ranking of the step being planned (None: not asked yet)
        needs = policy.needs
        self.keys = self._key_stats(_pid_capacity(held)) if self.scope.needs_keys or "keys" in needs else None
        self.queries = None  # QueryStats, made once the heads are known (the first attention call)
        policy.reset(L)
        policy.bind(self.keys, None)
        self.snapshot_slots = slots = max(config.lookahead, 1) + 2  # the feedback's: in flight, shown, one taken now
        self.attention = policy.bind_attention(
            lambda rows, keeps: AttentionStats(L, _pid_capacity(held), layout.num_kv_heads, rows, keeps, dev, slots))
        self.salience = policy.bind_salience(lambda window: SalienceStats(L, _pid_capacity(held), window, dev, slots))
        self.scores = policy.bind_scores(lambda score: DeviceScores(score, L, _pid_capacity(held), dev, slots))
        if self.scores and self.keys is None:
            raise ConfigError("policy", f"policy '{policy.name}' scores pages on the device (score_device) from the key "
                                        "statistics, but does not need 'keys': add 'keys' to its scorer's needs")
        if "attention" in needs and not self.attention:
            raise ConfigError("policy", f"policy '{policy.name}' needs attention but keeps no attention statistics: "
                                        "a policy reads observed attention through bind_attention (as ScoredPolicy "
                                        "does)")
        far = any(t.pool(0) is None for t in tiers[1:]) or len(tiers) > 2  # tiers the kernel cannot address
        # staged copies only for scopes that may read pages off the device (resident reads HBM only: memory stays
        # bounded by the tiers, as a long context through device -> host -> disk needs)
        self.staging = Staging(self.table, self.stats, self.host is not None, R * self.max_pages, on_gpu) \
            if far and not isinstance(self.scope, Resident) else None
        self.scope.bind(self)
        self.recall = None
        if recall_slots:
            if self.host is None:
                raise ConfigError("scope.recall_slots", "the recall cache holds pages picked from the host tier: "
                                                        "add a host tier")
            slots = tiers[0].alloc(self._layers, self.scope.recall_slots).numpy().reshape(L, -1)  # [L, C]
            if n_land and layout.scaled:
                raise ConfigError("scope.landing_slots", "the decode lands 16/32-bit pages only (the layout's pages "
                                                         "are 8-bit): set scope.landing_slots=0")
            land = tiers[0].alloc(self._layers, R * n_land).numpy().reshape(L, R, n_land) if n_land else None
            self.recall = RecallCache(slots, M, self.scratch, tiers[0], self.host, dev, compile=compiled, land=land)
            self._admit_after = admission_batches(self.groups)  # last layer of a batch -> the batch
            self.block_table = self.home.clone()  # the overlay's output, never the host's copy
        self.predictor = getattr(self.scope, "predictor", None)  # the recall cache's prediction ahead
        if self.predictor is not None and not isinstance(self.runner, LlamaRunner):
            raise ConfigError("scope.predictor", "prediction ahead reads the hidden state between layers, which "
                                                 "only the compact runner shows: a Llama-family model with "
                                                 "engine.runner auto or llama")
        self.width = self.scope.width(budget, budget is not None and budget.mode == "once", M)
        self.feedback = Feedback(self)
        self.prefill_attention = PrefillAttention(self.table, self.transfer, self.kernel, self.stats, R, M,
                                                  self.scratch if scratch else None)
        if model is not None:  # the Triton kernel's tiles are planned with the iteration
            self.prefill_attention.heads = model.config.num_attention_heads
        self.kv = PassCache(self)
        self.step_idx = -1
        self.dropped_any = False
        self.ttft_s: list[float] = []
        self.tpot_s: list[float] = []
        self._next_seq = 0
        self._to_free: list[tuple[int, object]] = []  # (sequence, event of the last step that used it)
        self._plans: dict[tuple, object] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._last_event = None
        self._prefill_queued = False  # a prefill step's K/V writes may still be queued on the GPU
        self._mode = "idle"  # idle | prefill | decode | mixed (decode rows, then prefill chunks, in one token row)
        self._B = R
        self._dirty: set[int] = set()  # rows whose table entries changed since the last upload
        self._prefilling: set[int] = set()  # rows opened and not yet decoding (their table row: scratch)
        self._chunks: list[Chunk] = []  # the prefill chunks of the iteration being computed
        self._bucket: int | None = None  # their padded token count when the iteration is captured
        self._inputs: dict | None = None  # static inputs and outputs of captured iterations

    # -- construction checks -------------------------------------------------------------------
    def _key_stats(self, pids: int) -> KeyStats:
        """The key statistics of ``pids`` pids (:meth:`KeyStats.needed`)."""
        return KeyStats(self.layout, pids, self.device, *KeyStats.needed(self.scope, self.policy, self.layout))

    @property
    def kv_bytes_per_token(self) -> float:
        """Bytes of K/V pages per token (every layer; 8-bit pages with their scale rows)."""
        return self.layout.num_layers * self.layout.page_bytes / self.layout.page_size

    @property
    def stats_bytes_per_token(self) -> float:
        """Device bytes of key statistics (the key sketch among them) per stored token, which the device budget pays
        for beside the pages it holds."""
        return self.keys.bytes_per_token() if self.keys is not None else 0.0

    def _check_feedback(self) -> None:
        """Every statistic the policy needs must come from the step: named errors here, never zeros later."""
        needs = set(self.policy.needs)
        unknown = needs - NEEDS
        if unknown:
            raise ConfigError("policy", f"needs unknown statistics {sorted(unknown)}; the engine gives {sorted(NEEDS)}")
        if self.config.lookahead == 0 and (needs or self.policy.hears_access):
            raise ConfigError("engine.lookahead", f"0 feeds nothing back, and policy '{self.policy.name}' hears "
                                                  f"{sorted(needs) or ['accesses']}: use lookahead >= 1")
        page_stats = needs & {"attention", "salience"}
        missing = page_stats - set(self.scope.gives)
        if missing:
            raise ConfigError("scope", f"policy '{self.policy.name}' needs {sorted(missing)}, which scope "
                                       f"'{self.scope.name}' does not give (it gives {sorted(self.scope.gives)}); "
                                       "pick a policy that needs less or a scope that gives it")
        check_salience(self.policy, self.kernel)

    # -- sequences -----------------------------------------------------------------------------
    @torch.no_grad()
    def add(self, prompt: torch.Tensor, all_logits: bool = False) -> tuple[int, torch.Tensor]:
        """Prefill ``prompt [S]`` as a new sequence and start decoding it: ``(sequence id, logits [S or 1, V])``.
        The greedy next token becomes its input of the next :meth:`step`."""
        seq = self.open(int(self._check_ids(prompt).numel()))
        logits = self.prefill_sequence(seq, prompt, all_logits)
        self.start_decode(seq, logits[-1].argmax())
        return seq, logits

    def prefill_sequence(self, seq: int, prompt: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """All chunks of ``prompt [S]`` for an opened ``seq`` (timed as TTFT): logits ``[S or 1, V]``."""
        self._sync()
        t0, measuring = time.perf_counter(), self.stats.fidelity_s
        out = [self.prefill_chunk(seq, prompt[a:b], all_logits) for a, b in self.prefill.chunks(int(prompt.numel()))]
        self._sync()
        self.ttft_s.append(time.perf_counter() - t0 - (self.stats.fidelity_s - measuring))
        return torch.cat(out) if all_logits else out[-1]

    def open(self, n_tokens: int, prefix_pids=(), prefix_len: int = 0) -> int:
        """A new sequence of up to ``n_tokens`` prompt tokens on a free row, decoded from :meth:`start_decode`
        on; it shares the pages ``prefix_pids`` holding its first ``prefix_len`` tokens (a radix-cache match)."""
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, (int, np.integer)) or n_tokens < 1 or \
                n_tokens + 1 > self.max_pages * self.layout.page_size:
            capped = self.config.max_context and self.layout.pages_for(self.config.max_context) == self.max_pages
            limit = f"engine.max_context={self.config.max_context}" if capped else "what the tiers hold"
            raise ConfigError("engine.max_context" if capped else "prompt",
                              f"a prompt of {n_tokens!r} tokens (and the token decoded after it) does not fit "
                              f"{self.max_pages * self.layout.page_size} tokens per sequence ({limit})")
        row = next((r for r, s in enumerate(self.row_seq) if s is None), None)
        if row is None:
            raise KVTierError(f"all {self.config.max_batch} rows are busy; finish a sequence or raise max_batch")
        self._free_finished(block=False)  # the rest once room runs short (_grow): no wait for the step in flight
        seq = self._next_seq
        self._next_seq += 1
        self.table.add_sequence(seq, prefix_pids, prefix_len)
        self.row_seq[row] = seq
        self._prefilling.add(row)  # its table row stays the scratch slot until start_decode
        self.pid_mirror[row] = -1
        if self.recall is not None:
            self.recall.forget_row(row)
        self.scope.reset_row(row)
        return seq

    def prefill_chunk(self, seq: int, ids: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """Compute the next prompt tokens ``ids [q]`` of an opened ``seq`` (an iteration of that chunk alone):
        logits ``[q or 1, V]``."""
        return self.iterate([(seq, ids)], decode=False, all_logits=all_logits).chunk_logits[0]

    def begin_prefill(self, seqs: list[int], q_len) -> None:
        """Open a step in which each of ``seqs`` (opened, not decoding) grows by ``q_len`` prompt tokens (an int, or
        one count per sequence); its layers are then written and attended by :meth:`store` / :meth:`attend` (any
        driver) as ``[len(seqs), heads, q_len, D]``, or with counts per sequence as ``[1, heads, their sum, D]``
        (one sequence's tokens after another)."""
        q_lens = [q_len] * len(seqs) if isinstance(q_len, (int, np.integer)) else list(q_len)
        self._begin(list(zip(seqs, q_lens)), decode=False)

    def start_decode(self, seq: int, next_token) -> None:
        """``seq``'s prompt is in its pages: (compress it once, under such a budget) and decode it from the next
        :meth:`step`, fed ``next_token`` (an int, or a device tensor ``[1]``: no wait for it)."""
        row = self._prefilling_row(seq)
        self.end_prefill([seq])
        self._prefilling.discard(row)
        self._place_row(row, seq)
        if isinstance(next_token, torch.Tensor):
            self.tokens[row:row + 1] = next_token.reshape(1)
        else:
            self.tokens[row] = int(next_token)

    def end_prefill(self, seqs: list[int]) -> None:
        """The prompts of ``seqs`` are in: the policy hears the last chunk; with ``budget.mode == "once"`` the
        middle pages it ranks below the budget are dropped for good (as kvpress presses do), once it has heard every
        step so far (otherwise it hears the last chunk when the next step is planned, as any step's)."""
        if self.budget is None or self.budget.mode != "once":
            return
        self.feedback.take(upto=self.step_idx)
        prio = self._priority()
        for seq in seqs:
            n = self.table.seq_len(seq)
            view = self.budget.view(n + 1)  # the first decode token's spans
            if view is None:
                continue
            self.win_start[seq] = view.win_start
            pids = self.table.pages(seq)
            for layer in range(self.layout.num_layers):
                cand = view.candidates(self.table.tier_of[layer, pids] >= 0)
                keep = np.argsort(-prio[layer, pids[cand]], kind="stable")[:self.budget.middle_pages]
                drop = pids[np.delete(cand, keep)]
                self.transfer.wait(layer, drop)
                self.stats.compressed_pages += self.table.drop(layer, drop).size
                if not self.dropped_any:  # steps captured before list every page as live: capture again
                    self._graphs.clear()
                self.dropped_any = True

    def _prefilling_row(self, seq: int) -> int:
        row = self.row_seq.index(seq) if seq in self.row_seq else None
        if row is None or row not in self._prefilling:
            raise KVTierError(f"sequence {seq} is not being prefilled: open() it first")
        return row

    def _check_ids(self, ids) -> torch.Tensor:
        """Prompt tokens ``ids [q]``: a non-empty 1-D integer tensor of ids in the model's vocabulary."""
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32) or ids.dim() != 1 or \
                ids.numel() < 1:
            raise ConfigError("prompt", "token ids must be a non-empty 1-D integer tensor [S], got "
                                        f"{getattr(ids, 'dtype', type(ids).__name__)} of shape "
                                        f"{tuple(getattr(ids, 'shape', ()))}")
        vocab = self.model.config.vocab_size if self.model is not None else None
        if vocab is not None and not 0 <= int(ids.min()) <= int(ids.max()) < vocab:
            raise ConfigError("prompt", f"token ids must be in [0, {vocab}) (the model's vocabulary), got ids from "
                                        f"{int(ids.min())} to {int(ids.max())}")
        return ids.long()

    @torch.no_grad()
    def add_written(self, n_tokens: int, kv_of, next_token: int = 0) -> int:
        """A new sequence whose first ``n_tokens`` K/V are given, not computed: ``kv_of(layer, start, end)``
        returns ``[2, end - start, N_kv, D]`` (stored KV, or synthetic context for benchmarks)."""
        seq = self.open(n_tokens)
        for a, b in self.prefill.chunks(n_tokens):
            self._begin([(seq, b - a)], decode=False)
            for layer in range(self.layout.num_layers):
                kv = kv_of(layer, a, b).transpose(1, 2)[:, None]  # [2, 1, N_kv, q, D]
                self.store(layer, kv[0], kv[1])
            self._mode = "idle"
        self.start_decode(seq, next_token)
        return seq

    def finish(self, seq: int) -> None:
        """Drop ``seq``: its row goes idle now, its pages are freed once no queued step can use them."""
        if seq not in self.row_seq:
            raise KVTierError(f"finish of unknown sequence {seq!r}; running: {[s for s in self.row_seq if s is not None]}")
        row = self.row_seq.index(seq)
        self.row_seq[row] = None
        self._prefilling.discard(row)
        self.lens[row] = 0
        self.mirror[:, row] = self.scratch[:, None]
        self.pid_mirror[row] = -1
        self.span_host[row] = 0
        self.win_start.pop(seq, None)
        self._dirty.add(row)
        self._to_free.append((seq, self._queued_fence()))

    def reorder(self, rows) -> list[int]:
        """Rows ``0..n-1`` go on with copy-on-write forks (:meth:`BlockTable.fork`) of the sequences decoding now on
        ``rows[r]`` (``[n]``; beam search's reorder, or a prompt prefilled once and decoded on several rows); every
        sequence decoding now finishes, its pages freed once no fork holds them and no queued step reads them. A
        fork's first write into a shared, partly filled page copies it first. The new sequence ids, by row."""
        rows = [int(r) for r in rows]
        old = list(self.row_seq)
        if not 0 < len(rows) <= self.config.max_batch or \
                any(not 0 <= r < len(old) or old[r] is None or r in self._prefilling for r in rows):
            raise KVTierError(f"reorder onto {rows}: each must be a row decoding now ({self.running} run on rows "
                              f"{[r for r, s in enumerate(old) if s in self.running]}), at most max_batch="
                              f"{self.config.max_batch} of them")
        new = []
        for r in rows:
            seq, self._next_seq = self._next_seq, self._next_seq + 1
            self.table.fork(old[r], seq)
            if old[r] in self.win_start:
                self.win_start[seq] = self.win_start[old[r]]
            new.append(seq)
        tokens = self.tokens[torch.tensor(rows, device=self.device)]  # [n] each row's next input
        for seq in old:
            if seq is not None:
                self.finish(seq)
        for r, seq in enumerate(new):
            self.row_seq[r] = seq
            if self.recall is not None:
                self.recall.forget_row(r)
            self.scope.reset_row(r)
            self._place_row(r, seq)
        self.tokens[:len(rows)] = tokens
        return new

    def read_sequence(self, seq: int, n: int, device="cpu") -> list[torch.Tensor]:
        """The first ``n`` tokens' K/V of ``seq`` per layer ``[2, n, N_kv, D]`` on ``device`` (host memory: what a
        swapped-out request takes with it), in the model's dtype (FP8 pages dequantized; pages dropped for good
        read as zeros)."""
        pids = self.table.pages(seq)
        out = []
        for layer in range(self.layout.num_layers):
            self.transfer.wait(layer, pids)
            out.append(read_tokens(self.table, layer, seq, device=device)[:, :n])
        return out

    def keep_room(self, pages: int) -> None:
        """Keep ``pages`` device slots per layer free beyond the running rows' next pages: each step's moves make
        the room, the prefix cache's pages leaving first, so a prompt chunk that arrives finds it without waiting
        for copies (a serving scheduler's token budget). Needs a tier below the device to move pages to."""
        if len(self.table.tiers) < 2 or isinstance(pages, bool) or not isinstance(pages, int) or pages < 0:
            raise ConfigError("keep_room", f"device slots to keep free, an int >= 0, on an engine with a tier below "
                                           f"the device; got {pages!r} with {len(self.table.tiers)} tier(s)")
        self.prompt_room = pages

    def reclaim(self) -> None:
        """Free the pages of finished sequences now (waiting for the queued steps that read them)."""
        self._free_finished(block=True)

    @property
    def max_batch(self) -> int:
        return self.config.max_batch

    @property
    def captured(self) -> int:
        """CUDA graphs captured so far (decode buckets and iteration shapes; each capture costs hundreds of ms)."""
        return len(self._graphs)

    @property
    def decodes_like_prefill(self) -> bool:
        """A decode row attends what a prefill query at its place would (scope all, no token budget): a prompt's
        last token may run as its sequence's first decode row."""
        return isinstance(self.scope, All) and self.budget is None

    @property
    def running(self) -> list[int]:
        """Sequences decoding now."""
        return [s for r, s in enumerate(self.row_seq) if s is not None and r not in self._prefilling]

    # -- iterations ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, tokens: dict[int, int] | None = None) -> torch.Tensor:
        """One decode token for every running sequence: logits ``[rows of the bucket, V]`` (device; the caller's to
        keep, as every output of :meth:`iterate`).

        Each sequence's input is its greedy token from the last step (or prefill), unless ``tokens``
        (sequence -> token id) forces it. Row r of the result is ``self.row_seq[r]``.
        """
        self._sync()
        t0, measuring = time.perf_counter(), self.stats.fidelity_s
        logits = self.iterate(tokens=tokens).logits
        self._sync()
        self.tpot_s.append(time.perf_counter() - t0 - (self.stats.fidelity_s - measuring))
        return logits

    @torch.no_grad()
    def iterate(self, chunks=(), decode: bool = True, tokens: dict[int, int] | None = None,
                all_logits: bool = False) -> Iteration:
        """One forward over a token row that holds a decode token of every running sequence (``decode``) and
        the prompt chunks ``chunks`` (``(sequence, ids [q])`` of opened sequences, several prompts at once).

        Decode rows attend through the decode kernel as in :meth:`step` (the whole step, without chunks, is one
        CUDA-graph replay); the chunks' tokens through one varlen prefill call per layer
        (:mod:`kvtier.engine.prefill`). ``all_logits``: every chunk token's logits, else each chunk's last.
        """
        if self.runner is None:
            raise ConfigError("model", "this engine has no model to run; drive it through TieredKVCache")
        ids = [self._check_ids(x).to(self.device, non_blocking=True) for _, x in chunks]
        T = sum(int(x.numel()) for x in ids)
        bucket = next((b for b in TOKEN_BUCKETS if b >= T), None) if ids and self._capturable(all_logits) else None
        B = self._begin([(seq, int(x.numel())) for (seq, _), x in zip(chunks, ids)], decode, tokens, bucket)
        if not ids:
            if self.graphs:
                self._replay(B, lambda: self._decode(B))
            else:
                self._decode(B)
            self.end_decode()
            return Iteration(self.logits[:B].clone(), [])  # a copy: the next step writes self.logits
        lens = [c.q_len for c in self._chunks]
        ends = B + np.cumsum(lens)  # [n] one past each chunk's last token
        keep = np.arange(B + T) if all_logits else np.concatenate([np.arange(B), ends - 1])  # [k]
        pos = torch.from_numpy(np.concatenate([np.arange(c.start, c.start + c.q_len) for c in self._chunks]))
        Tb = self.prefill_attention.tokens
        try:
            if self._bucket is not None:  # captured at a token bucket: the inputs into the static buffers, padded
                R = self.config.max_batch
                inputs = self._iteration_inputs()
                inputs["ids"][:Tb].copy_(torch.nn.functional.pad(torch.cat(ids), (0, Tb - T)))
                inputs["pos"][:Tb].copy_(torch.nn.functional.pad(pos, (0, Tb - T)), non_blocking=True)
                inputs["keep"][:B + R].copy_(torch.from_numpy(np.pad(keep, (0, B + R - keep.size))), non_blocking=True)
                self._replay(("iteration", B, Tb, self.prefill_attention.shape(), self.prefill_attention.version),
                             lambda: self._captured_iteration(B, Tb))
                logits = inputs["logits"][:keep.size].clone()
            else:
                row = torch.cat([self.tokens[:B]] + ids)[None]  # [1, B + T]
                positions = torch.cat([self.positions[:B], pos.to(self.device, non_blocking=True)])[None]  # [1, B + T]
                keep_at = torch.from_numpy(keep).to(self.device, non_blocking=True)
                logits = self._run_iteration(row, positions, keep_at, B)  # [k, V]
        finally:
            self._mode = "idle" if not B else "decode"
        if B:
            self.end_decode()
        cuts = np.concatenate([[0], np.cumsum(lens) if all_logits else np.arange(1, len(lens) + 1)]) + B
        return Iteration(self.logits[:B].clone() if B else None, [logits[a:b] for a, b in zip(cuts, cuts[1:])])

    def _capturable(self, all_logits: bool) -> bool:
        """Can an iteration with chunks be captured (when every page it reads is on the device)? Its per-layer work
        must be device work only: no per-token logits, no key / query / attention statistics of the chunks, 16/32-bit
        pages, the Triton kernel and a scratch slot for the padding."""
        return bool(self.graphs) and not all_logits and self.keys is None and not self.feedback.wants and \
            "queries" not in self.policy.needs and not self.layout.scaled and self.config.max_batch > 1 and \
            self.prefill_attention.triton

    def _iteration_inputs(self) -> dict:
        """Static inputs and outputs of captured iterations: chunk token ids and positions ``[CAPTURE_TOKENS]``, the
        kept token indices ``[2R]`` and their logits ``[2R, V]``."""
        if self._inputs is None:
            R, dev = self.config.max_batch, self.device
            self._inputs = {"ids": torch.zeros(CAPTURE_TOKENS, dtype=torch.int64, device=dev),
                            "pos": torch.zeros(CAPTURE_TOKENS, dtype=torch.int64, device=dev),
                            "keep": torch.zeros(2 * R, dtype=torch.int64, device=dev),
                            "logits": torch.zeros(2 * R, self.model.config.vocab_size, device=dev)}
        return self._inputs

    def _captured_iteration(self, B: int, Tb: int) -> None:
        inputs, R = self._iteration_inputs(), self.config.max_batch
        row = torch.cat([self.tokens[:B], inputs["ids"][:Tb]])[None]  # [1, B + Tb]
        positions = torch.cat([self.positions[:B], inputs["pos"][:Tb]])[None]
        inputs["logits"][:B + R] = self._run_iteration(row, positions, inputs["keep"][:B + R], B)

    def _run_iteration(self, row: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, B: int) -> torch.Tensor:
        """The forward of an iteration's token row ``[1, B + T]`` (decode rows first): logits of the tokens ``keep``
        ``[k, V]``; the decode rows' logits and greedy next tokens into ``logits[:B]`` / ``tokens[:B]``."""
        self._start_step(B)
        token = ACTIVE_CACHE.set(self.kv)
        try:
            logits = self._forward_chunks(row, positions, self.kv, keep)[0]  # [k, V]
        finally:
            ACTIVE_CACHE.reset(token)
        if B:
            self._finish_step(B)
            self.logits[:B] = logits[:B]
            self.tokens[:B] = logits[:B].argmax(-1)
            if self.recall is not None:
                self.recall.next_step()
        return logits

    def _begin(self, prefill: list[tuple[int, int]], decode: bool, tokens: dict[int, int] | None = None,
               bucket: int | None = None) -> int:
        """Plan an iteration (host work, uploads): a decode row for every running sequence (``decode``) and the
        prompt chunks ``prefill`` (``(sequence, tokens)``), padded to ``bucket`` tokens (a captured iteration) when
        every page they read is then on the device. Its decode bucket's row count (0: no decode rows)."""
        active = [r for r, s in enumerate(self.row_seq) if s is not None and r not in self._prefilling] \
            if decode else []
        if decode and not active:
            raise KVTierError("no running sequence: add() one first")
        if not decode and not prefill:
            raise KVTierError("an iteration needs decode rows or prompt chunks")
        rows = [self._prefilling_row(s) for s, _ in prefill]
        offsets = np.concatenate([[0], np.cumsum([q for _, q in prefill])]).tolist()
        chunks = [Chunk(s, r, self.table.seq_len(s), q, a) for (s, q), r, a in zip(prefill, rows, offsets)]
        if len(set(rows)) < len(rows):
            raise KVTierError(f"two chunks of one sequence in one iteration: {[s for s, _ in prefill]}")
        self._drop_step_state()  # what a step that did not finish (an error mid-forward) left
        if active:  # before any row grows: every sequence's stored tokens are written
            self.scope.prepare()
        self._open_step(active + rows, [1] * len(active) + [c.q_len for c in chunks])
        B = 0
        if active:
            B = next(b for b in self.buckets if b > max(active))
            self._switch_moved()
            self._ensure_tails(active)
            for r in active:
                self.span_host[r] = self._spans(self.row_seq[r], int(self.lens[r]))
            if tokens:
                for seq, tok in tokens.items():
                    if seq not in self.row_seq:
                        raise KVTierError(f"token for unknown sequence {seq!r}")
                    self.tokens[self.row_seq.index(seq)] = int(tok)
            if self.priority is not None:
                self._upload_priority()
            self._upload()
        self._prefill_queued = bool(chunks)
        self._chunks = chunks
        if chunks:
            T = sum(c.q_len for c in chunks)
            device_only = self.scope.prefill_device_only and not self.exact_prefill
            self.prefill_attention.begin(chunks, device_only, bucket or T)
            if bucket is not None and not self.prefill_attention.planned_all:  # some call reads pages off the device
                bucket = None
                self.prefill_attention.begin(chunks, device_only, T)
            self._bucket = bucket
            for layers, calls in self.prefill_attention.groups:  # what they attend is known now: the policy hears it
                self._accessed(layers, calls)
        self._B = B
        self._mode = "mixed" if chunks and active else "prefill" if chunks else "decode"
        return B

    def begin_decode(self, tokens: dict[int, int] | None = None) -> int:
        """Plan a decode step for every running sequence (host work, uploads); the bucket's row count."""
        B = self._begin([], True, tokens)
        self._start_step(B)
        return B

    def _start_step(self, B: int) -> None:
        """At a step's start: the scope's per-step state goes; the block table of the ``B`` decode rows, every layer,
        from the host's placement and the recall slots' pages."""
        self.scope.start_step()
        if self.recall is not None and B:
            self.recall.overlay(self.home[:, :B], self.block_table[:, :B])

    def end_decode(self) -> None:
        """The step's statistics towards the host, and the event that marks its end."""
        self._finish_step(self._B)  # a forward driven from outside (TieredKVCache): the step's batched tail
        self._drop_step_state()
        self.feedback.record(self._B)
        self._mode = "idle"
        self.stats.steps += 1

    def _decode(self, B: int) -> None:
        """The captured work: ``tokens[:B]`` -> ``logits[:B]``, greedy next tokens into ``tokens[:B]``."""
        self._start_step(B)
        token = ACTIVE_CACHE.set(self.kv)
        try:
            logits = self._forward(self.tokens[:B, None], self.positions[:B, None], self.kv, 1,
                                   (self.predictor.point, self._ahead) if self.predictor is not None else None)
        finally:
            ACTIVE_CACHE.reset(token)
        self._finish_step(B)
        self.logits[:B] = logits[:, 0]
        self.tokens[:B] = logits[:, 0].argmax(-1)
        if self.recall is not None:
            self.recall.next_step()

    def _replay(self, key, work) -> None:
        """Replay the CUDA graph of ``key`` (a decode bucket, or an iteration's rows and token bucket), captured from
        ``work`` at its first use."""
        graph = self._graphs.get(key)
        if graph is None:
            saved = [t.clone() for t in self._step_state()]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                work()  # warm-up: Triton compiles, cuBLAS picks kernels
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                work()
            self._graphs[key] = graph
            warm = self.recall.page.clone() if self.recall is not None else None
            for t, before in zip(self._step_state(), saved):  # the warm-up step did not happen
                t.copy_(before)
            if warm is not None:  # but its admissions wrote pages into recall slots: those slots are emptied
                self.recall.page.masked_fill_(warm != self.recall.page, -1)
        graph.replay()

    def _step_state(self) -> list[torch.Tensor]:
        """Device state a step advances besides the pages: input tokens, counters, statistics, the recall cache."""
        state = [self.tokens, self.counts, *self.feedback.state()]
        for stats in [*self.attention, *self.salience]:
            state += stats.tensors()
        if self.keys is not None:
            state += self.keys.tensors()
        if self.queries is not None:
            state += [self.queries.ring, self.queries.seen]
        if getattr(self.scope, "recent", None) is not None:
            state += [self.scope.recent, self.scope.seen]
        if self.recall is not None:
            state += self.recall.tensors()
        return state

    def _ahead(self, layer: int, hidden: torch.Tensor, rope: tuple) -> None:
        """Prediction ahead (the compact runner calls it in layer ``layer - 1``, at the predictor's point):
        ``layer``'s query estimated from ``hidden [B, 1, hidden]``, its pages chosen for the estimate and fetched
        into its recall slots."""
        self._prefetch(layer, self.predictor.query(self.runner, layer, hidden, rope))

    @torch.compiler.disable
    def _prefetch(self, layer: int, query: torch.Tensor) -> None:
        """The scope's choice of ``layer``'s pages for the estimated query ``[B, H, D]``, admitted ahead."""
        B = self._B
        picks = pages_of(self.scope.pick(layer, query.contiguous(), self.view(B)), self.max_pages,
                         self.layout.page_size)
        if picks is not None:
            self.recall.prefetch(layer, picks, self.home[layer, :B], self.block_table[layer, :B])

    # -- what the attention modules call (left out of torch.compile: host logic, Triton launches) --
    @torch.compiler.disable
    def store(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write the step's K/V ``[B, N_kv, q, D]`` of ``layer`` into its pages."""
        if (key.shape[1], key.shape[-1]) != (self.layout.num_kv_heads, self.layout.head_dim):
            raise ConfigError("layout.head_dim", f"the model's K/V have {key.shape[1]} kv heads of {key.shape[-1]} "
                                                 f"dims, the layout {self.layout.num_kv_heads} of "
                                                 f"{self.layout.head_dim}: build it with kv_layout_for(model.config)")
        if self._mode in ("prefill", "mixed"):
            keys, values = self._chunk_tokens(key), self._chunk_tokens(value)  # [T, N_kv, D]
            planned = self.prefill_attention.writes.get(layer)
            if self.prefill_attention.own_contiguous:  # the chunks' own causal part reads them contiguous
                self.prefill_attention.own_kv = (layer, keys, values)
            if planned is not None:  # every token's page on the device: one write of all chunks
                store_rows(self.layout, self.table.tiers[0].pool(layer), *planned, keys, values)
            for c in self._chunks if planned is None or self.keys is not None else ():
                kv = torch.stack([keys[c.offset:c.offset + c.q_len], values[c.offset:c.offset + c.q_len]])
                if planned is None:
                    write_tokens(self.table, layer, c.seq, kv, c.start)  # kv [2, q, N_kv, D]
                if self.keys is not None:
                    pids = self.table.pages(c.seq)[np.arange(c.start, c.start + c.q_len) // self.layout.page_size]
                    self.keys.add(layer, torch.from_numpy(pids).to(self.device), kv[0].to(self.device))
            if self._mode == "prefill":
                return
            key, value = self._decode_rows(key), self._decode_rows(value)
        B = self._B
        pos = self.positions[:B]  # [B]
        self._write_decode(self.table.tiers[0].pool(layer), self.block_table[layer, :B], pos, key, value,
                           self.layout.page_size, self.layout.scaled)
        if self.keys is not None:
            self._step_keys[layer] = key[:, :, 0]  # [B, N_kv, D], into the statistics when the step ends

    @torch.compiler.disable
    def attend(self, layer: int, query: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
        """Attention of ``query [B, H, q, D]`` of ``layer``: ``[B, q, H, D]``."""
        if self.queries is None and "queries" in self.policy.needs:
            self.queries = QueryStats(self.layout.num_layers, max(1, self.policy.query_rows), query.shape[1],
                                      query.shape[-1], self.device)
            self.policy.bind(self.keys, self.queries)
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        if self._mode not in ("prefill", "decode", "mixed"):
            raise KVTierError("attend outside a step: the model's attention must run inside Engine.step or a "
                              "TieredKVCache")
        if self._mode == "prefill":
            if self.queries is not None:  # the first chunk's newest query rows
                c = self._chunks[0]
                last = self._chunk_tokens(query)[c.offset:c.offset + c.q_len][-self.queries.rows:]  # [r, H, D]
                self.queries.add(layer, last)
            out = self._attend_prefill(layer, self._chunk_tokens(query).contiguous(), scale)  # [T, H, D]
            return out.view(query.shape[0], -1, *out.shape[1:])  # [B, q, H, D]
        decode = self._decode_rows(query) if self._mode == "mixed" else query  # [B, H, 1, D]
        if self.queries is not None:
            self._step_queries[layer] = decode[0, :, 0]  # [H, D], into the ring when the step ends
        out = self._attend_decode(layer, decode, scale)  # [B, 1, H, D]
        if self._mode == "decode":
            return out
        chunks = self._attend_prefill(layer, self._chunk_tokens(query).contiguous(), scale)  # [T, H, D]
        return torch.cat([out[:, 0], chunks])[None]  # [1, B + T, H, D]

    def _accessed(self, layers, calls: list) -> None:
        """The pages chunk calls attend in a layer, or alike in each of ``layers [L']``: counted, heard by the policy."""
        attended = np.concatenate([c.pids for c in calls])
        n = np.size(layers)
        self.stats.attended_pages += attended.size * n
        self.stats.resident_pages += int(sum(c.resident.sum() for c in calls)) * n
        if np.ndim(layers) == 0:
            self.policy.on_access(int(layers), attended, self.step_idx)
        elif n == self.layout.num_layers:
            self.policy.on_access(slice(None), attended, self.step_idx)
        else:
            self.policy.on_access(np.repeat(layers, attended.size), np.tile(attended, n), self.step_idx)

    def _chunk_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """The prefill chunks' tokens of an attention input ``x [B', N, q, D]``, one chunk after another:
        ``[T, N, D]`` (mixed: the token row after the decode rows; prefill: every row's ``q``)."""
        if self._mode == "mixed":
            return x[0, :, self._B:].transpose(0, 1)
        return x.transpose(1, 2).reshape(-1, *x.shape[1:2], x.shape[-1])

    def _decode_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The decode rows of a mixed iteration's attention input ``x [1, N, B + T, D]``: ``[B, N, 1, D]``."""
        return x[0, :, :self._B].transpose(0, 1)[:, :, None]

    def _attend_prefill(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """The chunks' queries ``q [T, H, D]`` over their rows' pages: ``[T, H, D]``; their statistics to the
        policy."""
        chunks, want = self._chunks, self.feedback.wants
        calls = self.prefill_attention.calls(layer)
        out, lse = self.prefill_attention.run(calls, q, scale)
        if layer not in self.prefill_attention.planned:
            self._accessed(layer, calls)
        if "salience" in want:
            last = torch.tensor([c.offset + c.q_len - 1 for c in chunks], device=q.device)  # [R]
            for pids, sal in self.prefill_attention.salience(calls, q[last], lse[last], scale):
                for stats in self.salience:
                    stats.add(layer, torch.from_numpy(pids).to(self.device), sal)
        rows = self.policy.attention_rows
        if self.attention and rows != 0:  # one row of the policy's window per query row, all calls' pages
            for i, c in enumerate(chunks):
                r = c.q_len if rows is None else min(rows, c.q_len)
                a = c.offset + c.q_len - r
                pos = torch.arange(c.start + c.q_len - r, c.start + c.q_len, device=q.device)
                parts = self.prefill_attention.mass(calls, i, q[a:a + r], lse[a:a + r], pos, scale, layer)
                pids = torch.from_numpy(np.concatenate([p for p, _ in parts])).to(self.device)  # [n]
                for stats in self.attention:
                    stats.add(layer, pids, torch.cat([m for _, m in parts], 1))  # [r, n, N_kv]
        return out

    def _attend_decode(self, layer: int, query: torch.Tensor, scale: float) -> torch.Tensor:
        B, H, _, D = query.shape
        q = query[:, :, 0].contiguous()  # [B, H, D]
        table, lens = self.block_table[layer, :B], self.seq_lens[:B]  # [B, M], [B]
        view = self.view(B)
        if self._lists is None:
            self._lists = self._plan_lists(view) if self.scope.query_free else {}
        choice = self._lists[layer] if self.scope.query_free else self.scope.pick(layer, q, view)
        keys = choice.keys if isinstance(choice, KeyList) else None  # [B, N_kv, W] single keys
        picks = keys if keys is not None else choice  # [B, (N_kv,) K] the listed entries (None: every page)
        host = self.host.pool(layer) if self.host is not None else None
        stage = self.staging.pool(layer) if self.staging is not None else None
        budgeted = self.budget is not None and layer >= self.dense_layers
        stats = self.feedback.buffers(B, picks, H)
        if self.recall is not None:
            self.recall.wait(layer)  # its pages fetched ahead have landed
        landing = self.recall.landing(layer, B, picks.shape[-1]) if self.recall is not None and picks is not None \
            else {}
        out, lse = self.kernel.decode(q, self.table.tiers[0].pool(layer), host, table, lens,
                                      self._plan(B, H, D, None if picks is None else picks.shape[-1], keys is not None),
                                      scale, page_list=None if keys is not None else picks, key_list=keys,
                                      window_left=self._window_left(layer),
                                      spans=self.spans[:B] if budgeted and keys is None else None,
                                      stage_pool=stage, **stats, **landing)  # a key list shows its keys: no spans
        self.feedback.observe(layer, picks, lse, keys is not None)
        batch = self._admit_after.get(layer) if self.recall is not None else None
        if batch is not None and picks is not None:  # a batch of layers attended: their host reads into recall slots
            self.recall.admit(batch, self.feedback.group_pages(batch), self.block_table[batch.start:batch.stop, :B])
        if self.fidelity is not None:
            self._measure_fidelity(layer, q, out, lse, scale, view)
        return out[:, None]  # [B, 1, H, D]

    def _plan_lists(self, view: StepView) -> dict:
        """The page lists of every layer of a ``query_free`` scope, one batch of device ops per layer group."""
        lists = {}
        for layers in self.groups:
            planned = self.scope.plan(layers, view)  # [L', B, (N_kv,) K] or None
            lists.update({layer: None if planned is None else planned[i] for i, layer in enumerate(layers)})
        return lists

    def _finish_step(self, B: int) -> None:
        """The step's batched tail, per layer group: the attended-page tally, the step's keys and queries into
        their statistics, the feedback's per-page statistics (once every layer has attended); the recall cache's
        copies joined."""
        if not self.feedback.complete():
            if self.recall is not None:
                self.recall.join()
            return
        if self.keys is not None and self._step_keys:
            pos = self.positions[:B]
            pids = self.pid_table[:B].gather(1, (pos // self.layout.page_size)[:, None])[:, 0].long()  # [B]
            live = (self.seq_lens[:B] > 0) & (pids >= 0)  # idle rows of the bucket write nothing real
            self.keys.add_step(pids.clamp(min=0), torch.stack([self._step_keys[i] for i in sorted(self._step_keys)]),
                               live)
        if self._step_queries:
            self.queries.add_step(torch.stack([self._step_queries[i] for i in sorted(self._step_queries)]))
        for layers in self.groups:
            picks, keys = self.feedback.group_lists(layers)  # [L', B, (N_kv,) K] or None; of keys or pages
            table = self.block_table[layers.start:layers.stop, :B]  # [L', B, M]
            self.counts += self._tally(table, self.seq_lens[:B], picks, self.layout.page_size, keys)
            self.feedback.finish(layers, B, picks, self.visible_tokens(layers, B, picks, keys))
        if self.recall is not None:  # the recall copies of the step, on their side stream, end with it
            self.recall.join()
        self._drop_step_state()

    def _drop_step_state(self) -> None:
        self._lists, self._step_keys, self._step_queries = None, {}, {}
        self.feedback.drop_step()

    def visible_tokens(self, layers: range, B: int, picks: torch.Tensor | None, keys: bool = False) -> torch.Tensor:
        """Keys the step's query of each row sees in each of ``layers`` (a group), mean over rows (and kv-head
        lists): ``[L']``; ``keys``: the lists are key lists."""
        P = self.layout.page_size
        window = self.layout.window(layers[0])
        lens = self.seq_lens[:B].long()[:, None]  # [B, 1]
        if picks is None:
            seen = lens[:, 0].clamp(max=window) if window else lens[:, 0]
            return seen.float().mean().expand(len(layers))
        lists = picks.reshape(len(layers), B, -1).long()  # [L', B, (N_kv *) K]
        lo = (lens - window).clamp(min=0) if window else torch.zeros_like(lens)
        start, end = torch.maximum(lists * P, lo), torch.minimum(lists * P + P, lens)
        count = (end - start).clamp(min=0)
        if keys:  # each entry one key
            count = ((lists >= lo) & (lists < lens)).long()
        elif self.budget is not None and layers[0] >= self.dense_layers:  # the sinks and the window's keys, or whole
            sinks, win = (x[:, None] for x in self.spans[:B].long().unbind(1))
            middle = (lists >= -(-sinks // P)) & (lists < win // P)
            spans = (torch.minimum(end, sinks) - start).clamp(min=0) + (end - torch.maximum(start, win)).clamp(min=0)
            count = torch.where(middle, count, spans)
        count = count * (lists >= 0)
        return count.sum(-1).float().mean(-1) / (picks.shape[-2] if picks.dim() == 4 else 1)

    def view(self, B: int) -> StepView:
        once = self.budget is not None and self.budget.mode == "once"
        return StepView(self.block_table, self.seq_lens, self.spans, self.pid_table, self.priority, B,
                        self.layout.page_size, self.budget, once, self.dense_layers, self.layout.sliding_windows)

    def _measure_fidelity(self, layer, q, out, lse, scale, view) -> None:
        """Attend every live page (uncounted) and record the scope's recall and error; its time goes to
        ``stats.fidelity_s`` so that TPOT leaves it out."""
        self._sync()
        t0 = time.perf_counter()
        B = q.shape[0]
        every = All()
        every.engine = self
        picks = every.pick(layer, q, dataclasses.replace(view, budget=None, once=False, dense_layers=0))  # [B, M]
        host = self.host.pool(layer) if self.host is not None else None
        stage = self.staging.pool(layer) if self.staging is not None else None
        out_all, lse_all = self.kernel.decode(q, self.table.tiers[0].pool(layer), host, self.block_table[layer, :B],
                                              self.seq_lens[:B], self._plan(B, q.shape[1], q.shape[2],
                                              None if picks is None else picks.shape[-1]), scale, page_list=picks,
                                              window_left=self._window_left(layer), stage_pool=stage)
        self.fidelity.add(layer, *attention_fidelity(out, lse, out_all, lse_all))
        self._sync()
        self.stats.fidelity_s += time.perf_counter() - t0

    def _window_left(self, layer: int) -> int:
        """FlashInfer's ``window_left`` of ``layer`` (HF's sliding window W is W - 1; -1: global)."""
        return self.layout.window(layer) - 1 if self.layout.window(layer) else -1

    def _plan(self, B: int, H: int, D: int, listed: int | None, keys: bool = False):
        from kvtier.kernels.triton_decode import plan_static_decode

        key = (B, H, listed, keys)
        if key not in self._plans:
            self._plans[key] = plan_static_decode(B, self.max_pages, H, self.layout.num_kv_heads, D,
                                                  self.layout.page_size, self.device, max_listed=listed,
                                                  kv_bytes=self.layout.kv_dtype.itemsize, keys=keys)
        return self._plans[key]

    # -- host bookkeeping ----------------------------------------------------------------------
    def _open_step(self, rows: list[int], q_lens: list[int]) -> None:
        """Plan: the policy hears the past, pages leave sliding windows, the scheduler moves pages, rows grow."""
        self.feedback.take(upto=self.step_idx + 1 - self.lookahead if self.lookahead else None)
        self._ranking = None
        self._free_finished(block=False)
        self._drop_out_of_window()
        # pages a prefill step wrote may still be queued: the copies wait for the compute stream then; a decode
        # step's unsettled pages are pinned instead (_pin_unsettled), so its copies need not wait
        self._schedule(reserve=self._reserve(rows) + self.prompt_room, after_compute=self._prefill_queued)
        self._prefill_queued = False
        self.step_idx += 1
        self.policy.on_step(self.step_idx)
        for r, q in zip(rows, q_lens):
            self._grow(self.row_seq[r], r, q)
        self.stats.observe_occupancy(self.step_idx, self.table)

    def _reserve(self, rows: list[int]) -> int:
        """Device pages kept free for the rows' next pages: one each when the host waits for every step
        (lookahead <= 1), else those the next ``lookahead + 2`` steps append."""
        if self.lookahead <= 1:
            return len(rows)
        ahead, pages_for = self.lookahead + 2, self.layout.pages_for
        active = self.lens[[s is not None for s in self.row_seq]]
        return int((pages_for(active + ahead) - pages_for(active)).sum())

    def _grow(self, seq: int, row: int, n: int) -> None:
        """Append ``n`` tokens to ``seq`` (room made on the device first) and point the table at new pages."""
        P = self.layout.page_size
        need = self.layout.pages_for(self.table.seq_len(seq) + n) - self.table.num_pages(seq)
        if need and self._device_free() < need and self._to_free:
            self._free_finished(block=True)  # finished sequences' pages first, once the steps that read them ran
        if need and self._device_free() < need:
            self._schedule(reserve=need, after_compute=True)
            if self._device_free() < need:
                self._wait_room()
        new, cow = self.table.append(seq, n)
        for old, fresh in cow:  # a shared, partly filled last page copied before its first write
            if self.keys is not None:
                self.keys.on_copy(old, fresh)
        if new or cow:
            if self.keys is not None and new:
                self.keys.on_append(np.asarray(new, dtype=np.int64), self.step_idx)
            first = self.table.num_pages(seq) - len(new) - len(cow)  # the copied page is pointed at anew too
            pids = self.table.pages(seq)[first:]
            self.policy.on_append(pids, self.step_idx)
            self.pid_mirror[row, first:first + pids.size] = pids
            if row not in self._prefilling:
                self.mirror[:, row, first:first + pids.size] = self._encode(self._layers[:, None], pids)
            self._dirty.add(row)
        length = self.table.seq_len(seq)
        if row not in self._prefilling:
            self.lens[row] = length
        if length > self.max_pages * P:
            raise KVTierError(f"sequence {seq} outgrew max_context={self.max_pages * P}")

    def _place_row(self, row: int, seq: int) -> None:
        """Point ``row``'s table at ``seq``'s pages (a sequence that starts decoding)."""
        pids = self.table.pages(seq)
        self.transfer.wait(None, pids)  # pages moved while it prefilled are read at their new place
        self.mirror[:, row, :pids.size] = self._encode(self._layers[:, None], pids)
        self.pid_mirror[row, :pids.size] = pids
        self.lens[row] = self.table.seq_len(seq)
        self._dirty.add(row)

    def _encode(self, layer, pids: np.ndarray) -> np.ndarray:
        """Block-table values of ``pids`` in ``layer`` (an int, or layers broadcast against ``pids``; the broadcast
        shape): device slot, host slot ``-s - 1``, staged slot, or dropped."""
        tiers, slots = self.table.locate(layer, pids)
        loc = np.where(tiers == 0, slots, -slots - 1)
        far = (tiers > 1) | ((tiers == 1) & (self.host is None))
        if far.any():
            if self.staging is None:
                loc[far] = DROPPED
            else:
                layers, pids = np.broadcast_arrays(layer, pids)
                loc[far] = self.staging.encode(layers[far], pids[far])
        return np.where(tiers < 0, DROPPED, loc).astype(np.int32)

    def _spans(self, seq: int, n: int) -> tuple[int, int]:
        """The budget's ``(sinks, win_start)`` for a sequence of ``n`` tokens (``(0, 0)``: attended whole)."""
        if self.budget is None:
            return 0, 0
        view = self.budget.view(n, self.win_start.get(seq))
        return (0, 0) if view is None else (view.sinks, view.win_start)

    def _priority(self, ranking: Ranking | None = None) -> np.ndarray:
        """The policy's priority of every live page by pid ``[L, pid capacity]`` (0 for a pid no page holds), from
        ``ranking`` (None: asked now)."""
        ranking = ranking or Ranking.of(self.table, self.policy, self.step_idx)
        prio = np.zeros((self.layout.num_layers, self.table.ref.size))
        prio[:, ranking.info.pids] = ranking.priority  # [1 or L, n]
        return prio

    def _upload_priority(self) -> None:
        """The policy's priority of every live page into ``priority [L, pids]``, for scopes that choose by the
        policy (on the device, higher first, equal ones the earlier page: :func:`~kvtier.scopes.base.best_of`);
        -inf and NaN as the lowest finite values, in the order a host sort puts them (-inf, then NaN). The step's
        placement plan's ranking serves when the policy has heard nothing since that changes an old page's priority
        (pages appended since are each sequence's newest: in the budget's window, never ranked)."""
        prio = self._priority(None if self.policy.hears_step else self._ranking)  # [L, pids]
        low = np.finfo(np.float64).min
        host = np.zeros(tuple(self.priority.shape))  # [L, pids]
        host[:, :prio.shape[1]] = np.where(prio > -np.inf, prio, np.where(np.isnan(prio), low, np.nextafter(low, 0)))
        self.priority.copy_(torch.from_numpy(host), non_blocking=True)

    def _device_free(self) -> int:
        return int(self.table.tiers[0].num_free(self._layers).min())

    def _schedule(self, reserve: int, after_compute: bool) -> None:
        """Plan and issue moves (every step: a policy's priorities follow its statistics, the positions, the
        queries); the device keeps ``reserve`` slots free per layer."""
        if len(self.table.tiers) < 2:
            return
        self._switch_moved()  # moves give their source slots back once their copy and fence pass
        self._pin_unsettled(True)
        step = max(self.step_idx, 0)
        self._ranking = Ranking.of(self.table, self.policy, step)
        try:
            plan = self.scheduler.plan(self.table, self.policy, step, reserve=reserve, ranking=self._ranking)
        except TierFullError:  # slots of moves still in flight: wait for their fences, once
            self._wait_room()
            plan = self.scheduler.plan(self.table, self.policy, step, reserve=reserve, ranking=self._ranking)
        finally:
            self._pin_unsettled(False)
        self.stats.planned_pages += plan.num_pages()
        for dst in sorted({m.dst for m in plan.demote}, reverse=True):  # a cascade: the lowest tier makes room first
            layers, pids = pairs([m for m in plan.demote if m.dst == dst])
            try:
                self.transfer.migrate_many(layers, pids, dst, after_compute=after_compute, fenced=True)
            except TierFullError:  # room the tier above frees once its moves' fences pass
                self._wait_room()
                self.transfer.migrate_many(layers, pids, dst, after_compute=after_compute, fenced=True)
        layers, pids = pairs(plan.promote)  # [n]
        wanted = np.bincount(layers, minlength=self.layout.num_layers)  # [L]
        free = self.table.tiers[0].num_free(self._layers) - reserve  # [L]
        if self.lookahead <= 1 and (wanted > free).any():
            # slots the demotions free once copied: the host waits for the copies only (its last step is done),
            # so promotions land as on a CPU, where copies are synchronous; with lookahead >= 2 the host does
            # not wait for the GPU, and such promotions follow a step later
            self._wait_room()
            free = self.table.tiers[0].num_free(self._layers) - reserve
        fits = rank_in_layer(layers, wanted) < free[layers]  # [n] each layer's first promotions, as many as fit
        self.transfer.migrate_many(layers[fits], pids[fits], 0, after_compute=after_compute, fenced=True)
        self._switch_moved()

    def _pin_unsettled(self, pinned: bool) -> None:
        """Each row's page before the newest may still be written by a queued step (the host runs ahead of the
        GPU when lookahead >= 2): not movable."""
        if self.lookahead < 2:
            return
        prev = [self.table.seqs[s].pids[-2] for s in self.row_seq if s is not None and self.table.num_pages(s) > 1]
        if prev:
            self.table.set_pinned(prev, pinned)

    def _switch_moved(self) -> None:
        """Point the table at the new place of every move issued (the step's compute waits for the copies): every
        row's entries of a moved ``(layer, pid)``, found through a mask of the moved pairs (``BlockTable.marked``)."""
        layers, pids = self.transfer.take_moved(fence=self._queued_fence)  # [n]
        rows = [r for r, seq in enumerate(self.row_seq) if seq is not None and r not in self._prefilling]
        if not pids.size or not rows:
            return
        pages = [self.table.pages(self.row_seq[r]) for r in rows]
        sizes = np.array([p.size for p in pages])
        held = np.concatenate(pages)  # [N] every row's pages (a shared page: each holder)
        with self.table.marked(layers, pids) as moved:
            layer, entry = np.nonzero(moved[:, held])  # [m] (layer, held entry) pairs moved
        if not layer.size:
            return
        row_of = np.repeat(rows, sizes)[entry]  # [m]
        logical = entry - np.repeat(np.cumsum(sizes) - sizes, sizes)[entry]  # [m]
        self.mirror[layer, row_of, logical] = self._encode(layer, held[entry])
        self._dirty.update(np.unique(row_of).tolist())

    def _ensure_tails(self, active: list[int]) -> None:
        """The page each row writes this step must be in the device pool."""
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
            self._dirty.add(r)

    def _queued_fence(self):
        """An event after everything queued on the compute stream so far (every decode step and prefill chunk that
        may still read a page's old place); None on a CPU, where nothing is queued."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _wait_room(self) -> None:
        """Block until fenced moves release their device slots and finished sequences their pages."""
        self._switch_moved()
        if self._last_event is not None:
            self._last_event.synchronize()
        self.transfer.synchronize()
        self._switch_moved()
        self._free_finished(block=True)

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

    def _upload(self) -> None:
        """Lengths, positions and spans every step; the block-table rows that changed."""
        lens = torch.from_numpy(self.lens)
        self.seq_lens.copy_(lens, non_blocking=True)
        self.positions.copy_((lens - 1).clamp(min=0), non_blocking=True)
        self.spans.copy_(torch.from_numpy(self.span_host), non_blocking=True)
        if 2 * len(self._dirty) > self.config.max_batch:
            self.home.copy_(torch.from_numpy(self.mirror), non_blocking=True)
            self.pid_table.copy_(torch.from_numpy(self.pid_mirror), non_blocking=True)
        else:
            for r in self._dirty:
                self.home[:, r].copy_(torch.from_numpy(self.mirror[:, r]), non_blocking=True)
                self.pid_table[r].copy_(torch.from_numpy(self.pid_mirror[r]), non_blocking=True)
        if self.recall is None and self.block_table is not self.home:
            self.block_table.copy_(self.home)
        self._dirty.clear()

    def _free_finished(self, block: bool) -> None:
        still = []
        for seq, event in self._to_free:
            if event is None or block or event.query():
                if event is not None:
                    event.synchronize()
                freed = self.table.free(seq)
                if self.staging is not None:
                    self.staging.forget(freed)
            else:
                still.append((seq, event))
        self._to_free = still

    def _sync(self) -> None:
        if self.config.sync_timing:
            synchronize(self.device)

    def page_counts(self) -> tuple[int, int]:
        """Pages attended (prefill and decode, every layer), and of them read from the device tier (one sync); a
        step driven from outside and not ended yet counts once every layer has attended."""
        self._finish_step(self._B)
        attended, resident = self.counts.tolist()
        return attended + self.stats.attended_pages, resident + self.stats.resident_pages

    def hit_rate(self) -> float:
        """Attended pages read from the device tier / attended pages (one host sync)."""
        attended, resident = self.page_counts()
        return resident / attended if attended else 1.0

    def close(self) -> None:
        self.feedback.take(upto=None)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.transfer.take_moved()
        self.transfer.synchronize()
        for t in self.table.tiers:
            t.close()


def _pid_capacity(pages: int) -> int:
    """Pids a table holding ``pages`` pages per layer may name (its free list grows by doubling from 64)."""
    cap = 64
    while cap < pages:
        cap *= 2
    return cap
