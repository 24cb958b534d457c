"""Engine: the one data plane. Every caller (recipes, ``generate`` through :class:`~kvtier.cache.TieredKVCache`,
serving, disaggregation, benches) drives the same step over the same block table, tiers and policy.

A step is plan (host, :mod:`kvtier.engine.plan`) -> run (the forward, eager or one CUDA-graph replay; per layer
:mod:`kvtier.engine.attention`) -> feedback (:mod:`kvtier.engine.feedback`); docs/architecture.md draws it. The
step's research semantics live here once: the token budget, compress-once, sliding windows, every scorer's
statistics, fidelity against an uncounted exact pass.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from kvtier.budget import TokenBudget, token_budget
from kvtier.cache_base import PassCache
from kvtier.checks import (check_dense_layers, check_device_room, check_engine_args, check_kernel, check_recall_room,
                           check_scheduler, graphs_for)
from kvtier.compiling import make_room
from kvtier.engine.attention import AttentionCallbacks
from kvtier.engine.config import EngineConfig
from kvtier.engine.feedback import Feedback
from kvtier.engine.graphs import StepGraphs
from kvtier.engine.pages import SequencePages
from kvtier.engine.plan import Planner, layer_groups
from kvtier.engine.prefill import PrefillAttention
from kvtier.engine.runner import LlamaRunner, StepForward, make_runner
from kvtier.engine.step_buffers import StepBuffers
from kvtier.errors import ConfigError, KVTierError
from kvtier.eval.fidelity import FidelityStats
from kvtier.kernels.registry import backend_for
from kvtier.layout import KVLayout
from kvtier.metrics import CacheStats, synchronize
from kvtier.mover.paged_io import read_tokens
from kvtier.mover.staging import Staging
from kvtier.mover.transfer import TransferEngine
from kvtier.policies.base import Policy
from kvtier.policies.stats import NEEDS
from kvtier.scheduler.base import Scheduler
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.scheduler.lookahead import LookaheadScheduler
from kvtier.scopes import All, Scope, make_scope
from kvtier.scopes.recall import RecallCache
from kvtier.stats import AttentionStats, DeviceScores, DeviceStats, KeyStats, SalienceStats
from kvtier.table import BlockTable, pid_capacity
from kvtier.tiers.base import Tier


@dataclasses.dataclass
class Iteration:
    """What one :meth:`Engine.iterate` computed."""

    logits: torch.Tensor | None  # [B, V] the decode rows' (row r is Engine.row_seq[r]); None: no decode rows
    chunk_logits: list  # per chunk [q or 1, V]


class Engine:
    """Batched, tiered, paged attention for ``model`` over ``tiers`` with ``policy`` and ``scope``.

    ``model`` may be None when the forward is driven from outside (``generate`` through
    :class:`~kvtier.cache.TieredKVCache`). ``kernel``: a backend or its name (None: ``auto``, triton on a GPU);
    ``budget``: the keys each decode step attends (:class:`~kvtier.budget.TokenBudget`, its page size the layout's;
    None: the scope's own choice); ``exact_prefill``: prefill chunks
    attend every page until the prompt is in; ``dense_layers``: the first layers attend every page;
    ``fidelity``: measure each decode call against exact attention (an uncounted second pass).

    The engine is a facade over its parts: the :class:`~kvtier.engine.plan.Planner` (``planner``) and the step's
    :class:`~kvtier.engine.plan.StepPlan` (``plan``), the step's device buffers (``buffers``), the per-layer
    attention callbacks (``callbacks``), the CUDA graphs (``capture``) and the feedback (``feedback``).
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
        self.layout, self.policy, self.budget, self.model = layout, policy, budget, model
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
        check_feedback(policy, self.scope, config.lookahead)
        check_kernel(self.kernel, policy, self.scope, layout, len(tiers) > 1, budget is not None,
                     fidelity and not isinstance(self.scope, All), dense_layers)
        self.host = tiers[1] if len(tiers) > 1 and tiers[1].pool(0) is not None else None
        if self.device.type == "cuda" and self.host is not None and not self.host.pool(0).is_pinned():
            raise ConfigError(f"tiers.{self.host.name}", "the engine reads host pages through their mapped "
                                                         "address: the host tier must be pinned (pin_memory=True)")
        spare = config.max_batch > 1  # idle rows of a bucket write into one device slot per layer that nothing reads
        room = tiers[0].capacity - spare
        check_device_room(room, policy, layout.page_size, 0, f"tiers.{tiers[0].name}.capacity", config.max_batch)
        recall_slots = check_recall_room(room, policy, layout.page_size, self.scope, config.max_batch)
        held = sum(t.capacity for t in tiers) - spare - recall_slots  # pages a row may hold
        self.max_pages = min(layout.pages_for(config.max_context), held) if config.max_context else held
        buckets = self._set_up_run(fidelity)
        layers = np.arange(layout.num_layers)  # [L]
        scratch = (tiers[0].alloc(layers).numpy() if spare else np.zeros(layout.num_layers)).astype(np.int32)  # [L]
        self.planner = Planner(self, scratch)
        self.plan = self.planner.plan  # the step's host plan, which the parts below read
        self.buffers = StepBuffers(self.plan, model.config.vocab_size if model is not None else None,
                                   pid_capacity(held) if self.scope.needs_rank(budget) else None, bool(recall_slots),
                                   self.device)
        self.keys, self.snapshot_slots, self.policy_stats, self.attention, self.salience, self.scores = \
            policy_statistics(policy, self.scope, layout, pid_capacity(held), self.device, config.lookahead)
        self.queries = None  # QueryStats, made once the heads are known (the first attention call)
        far = any(t.pool(0) is None for t in tiers[1:]) or len(tiers) > 2  # tiers the kernel cannot address
        # staged copies only for scopes that may read pages off the device (resident reads HBM only: memory stays
        # bounded by the tiers, as a long context through device -> host -> disk needs)
        self.staging = Staging(self.table, self.stats, self.host is not None, config.max_batch * self.max_pages,
                               self.device.type == "cuda") if far and not self.scope.device_only else None
        self.scope.bind(self)
        self.recall = recall_cache(self.scope, tiers, self.host, config.max_batch, self.max_pages, scratch,
                                   self.compiled) if recall_slots else None
        self.predictor = getattr(self.scope, "predictor", None)  # the recall cache's prediction ahead
        if self.predictor is not None and not isinstance(self.runner, LlamaRunner):
            raise ConfigError("scope.predictor", "prediction ahead reads the hidden state between layers, which "
                                                 "only the compact runner shows: a Llama-family model with "
                                                 "engine.runner auto or llama")
        self.width = self.scope.width(budget, budget is not None and budget.mode == "once", self.max_pages)
        self.feedback = Feedback(self)
        self.callbacks = AttentionCallbacks(self, self.compiled)
        self.capture = StepGraphs(self, buckets)
        self.prefill_attention = PrefillAttention(self.table, self.transfer, self.kernel, self.stats,
                                                  config.max_batch, self.max_pages, scratch if spare else None)
        if model is not None:  # the Triton kernel's tiles are planned with the iteration
            self.prefill_attention.heads = model.config.num_attention_heads
        self.kv = PassCache(self)
        self.ttft_s: list[float] = []
        self.tpot_s: list[float] = []

    # -- construction ----------------------------------------------------------------------------
    def _set_up_run(self, fidelity: bool) -> tuple[int, ...]:
        """The runner, the fidelity observer, the graphs and torch.compile rules; the decode buckets."""
        config, model = self.config, self.model
        R = config.max_batch
        self.runner = make_runner(model, config.runner) if model is not None else None
        self.fidelity = FidelityStats() if fidelity and not isinstance(self.scope, All) else None
        self.graphs = graphs_for(config.graphs, self.device, not self.kernel.can.captures, self.fidelity is not None,
                                 model is not None)
        self.compiled = compiled = self.device.type == "cuda" if config.compile is None else config.compile
        self.forward = StepForward(self, self.runner, compiled) if self.runner is not None else None
        buckets = config.buckets or tuple(sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < R} | {R}))
        if compiled:  # per layer: each decode bucket, the prompt forward (its first shape, then dynamic), spare
            make_room(self.layout.num_layers * (len(buckets) + 3))
        self.lookahead = config.lookahead
        return buckets

    @property
    def kv_bytes_per_token(self) -> float:
        """Bytes of K/V pages per token (every layer; 8-bit pages with their scale rows)."""
        return self.layout.num_layers * self.layout.page_bytes / self.layout.page_size

    @property
    def stats_bytes_per_token(self) -> float:
        """Device bytes of key statistics (the key sketch among them) per stored token, which the device budget pays
        for beside the pages it holds."""
        return self.keys.bytes_per_token() if self.keys is not None else 0.0

    # -- sequences -----------------------------------------------------------------------------
    @torch.no_grad()
    def add(self, prompt: torch.Tensor, all_logits: bool = False) -> tuple[int, torch.Tensor]:
        """Prefill ``prompt [S]`` as a new sequence and start decoding it: ``(sequence id, logits [S or 1, V])``.
        The greedy next token becomes its input of the next :meth:`step`."""
        seq = self.open(int(check_ids(prompt, self.model).numel()))
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
        check_fits(n_tokens, self.max_pages, self.layout, self.config.max_context)
        seq, row = self.planner.open(prefix_pids, prefix_len)
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
        self.planner.begin(list(zip(seqs, q_lens)), decode=False)

    def start_decode(self, seq: int, next_token) -> None:
        """``seq``'s prompt is in its pages: (compress it once, under such a budget) and decode it from the next
        :meth:`step`, fed ``next_token`` (an int, or a device tensor ``[1]``: no wait for it)."""
        row = self.planner.prefilling_row(seq)
        self.end_prefill([seq])
        self.plan.prefilling.discard(row)
        self.planner.place_row(row, seq)
        if isinstance(next_token, torch.Tensor):
            self.buffers.tokens[row:row + 1] = next_token.reshape(1)
        else:
            self.buffers.tokens[row] = int(next_token)

    def end_prefill(self, seqs: list[int]) -> None:
        """The prompts of ``seqs`` are in: the policy hears the last chunk; with ``budget.mode == "once"`` the
        middle pages it ranks below the budget are dropped for good (as kvpress presses do), once it has heard every
        step so far (otherwise it hears the last chunk when the next step is planned, as any step's)."""
        if self.budget is not None and self.budget.mode == "once":
            self.planner.compress_once(seqs)

    @torch.no_grad()
    def add_written(self, n_tokens: int, kv_of, next_token: int = 0) -> int:
        """A new sequence whose first ``n_tokens`` K/V are given, not computed: ``kv_of(layer, start, end)``
        returns ``[2, end - start, N_kv, D]`` (stored KV, or synthetic context for benchmarks)."""
        seq = self.open(n_tokens)
        for a, b in self.prefill.chunks(n_tokens):
            self.planner.begin([(seq, b - a)], decode=False)
            for layer in range(self.layout.num_layers):
                kv = kv_of(layer, a, b).transpose(1, 2)[:, None]  # [2, 1, N_kv, q, D]
                self.store(layer, kv[0], kv[1])
            self.plan.mode = "idle"
        self.start_decode(seq, next_token)
        return seq

    def finish(self, seq: int) -> None:
        """Drop ``seq``: its row goes idle now, its pages are freed once no queued step can use them."""
        self.planner.finish(seq)

    def reorder(self, rows) -> list[int]:
        """Rows ``0..n-1`` go on with copy-on-write forks (:meth:`BlockTable.fork`) of the sequences decoding now on
        ``rows[r]`` (``[n]``; beam search's reorder, or a prompt prefilled once and decoded on several rows); every
        sequence decoding now finishes, its pages freed once no fork holds them and no queued step reads them. A
        fork's first write into a shared, partly filled page copies it first. The new sequence ids, by row."""
        rows = [int(r) for r in rows]
        old, win_start = list(self.plan.row_seq), self.planner.win_start
        if not 0 < len(rows) <= self.config.max_batch or \
                any(not 0 <= r < len(old) or old[r] is None or r in self.plan.prefilling for r in rows):
            raise KVTierError(f"reorder onto {rows}: each must be a row decoding now ({self.running} run on rows "
                              f"{[r for r, s in enumerate(old) if s in self.running]}), at most max_batch="
                              f"{self.config.max_batch} of them")
        new = []
        for r in rows:
            seq = self.planner.new_seq()
            self.table.fork(old[r], seq)
            if old[r] in win_start:
                win_start[seq] = win_start[old[r]]
            new.append(seq)
        tokens = self.buffers.tokens[torch.tensor(rows, device=self.device)]  # [n] each row's next input
        for seq in old:
            if seq is not None:
                self.finish(seq)
        for r, seq in enumerate(new):
            self.plan.row_seq[r] = seq
            if self.recall is not None:
                self.recall.forget_row(r)
            self.scope.reset_row(r)
            self.planner.place_row(r, seq)
        self.buffers.tokens[:len(rows)] = tokens
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
        self.planner.prompt_room = pages

    def reclaim(self) -> None:
        """Free the pages of finished sequences now (waiting for the queued steps that read them)."""
        self.planner.free_finished(block=True)

    @property
    def max_batch(self) -> int:
        return self.config.max_batch

    @property
    def buckets(self) -> tuple[int, ...]:
        """The decode batch sizes a step's rows are padded to (each one CUDA graph)."""
        return self.capture.buckets

    @property
    def captured(self) -> int:
        """CUDA graphs captured so far (decode buckets and iteration shapes; each capture costs hundreds of ms)."""
        return len(self.capture.graphs)

    @property
    def decodes_like_prefill(self) -> bool:
        """A decode row attends what a prefill query at its place would (scope all, no token budget): a prompt's
        last token may run as its sequence's first decode row."""
        return isinstance(self.scope, All) and self.budget is None

    @property
    def running(self) -> list[int]:
        """Sequences decoding now."""
        return [self.plan.row_seq[r] for r in self.plan.running_rows()]

    @property
    def row_seq(self) -> list:
        """The sequence on each row (None: idle); decode logits' row r is ``row_seq[r]``."""
        return self.plan.row_seq

    @property
    def step_idx(self) -> int:
        """The step being computed (or the last one); -1 before the first."""
        return self.planner.step_idx

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
        ids = [check_ids(x, self.model).to(self.device, non_blocking=True) for _, x in chunks]
        T = sum(int(x.numel()) for x in ids)
        bucket = self.capture.token_bucket(T, all_logits) if ids else None
        B = self.planner.begin([(seq, int(x.numel())) for (seq, _), x in zip(chunks, ids)], decode, tokens, bucket)
        buffers = self.buffers
        if not ids:
            if self.graphs:
                self.capture.replay(B, lambda: self.forward.decode(B))
            else:
                self.forward.decode(B)
            self.end_decode()
            return Iteration(buffers.logits[:B].clone(), [])  # a copy: the next step writes buffers.logits
        lens = [c.q_len for c in self.plan.chunks]
        ends = B + np.cumsum(lens)  # [n] one past each chunk's last token
        keep = np.arange(B + T) if all_logits else np.concatenate([np.arange(B), ends - 1])  # [k]
        pos = torch.from_numpy(np.concatenate([np.arange(c.start, c.start + c.q_len) for c in self.plan.chunks]))
        try:
            if self.plan.bucket is not None:  # captured at a token bucket: the inputs into the static buffers, padded
                logits = self.capture.iteration(ids, pos, keep, B)
            else:
                row = torch.cat([buffers.tokens[:B]] + ids)[None]  # [1, B + T]
                positions = torch.cat([buffers.positions[:B], pos.to(self.device, non_blocking=True)])[None]
                keep_at = torch.from_numpy(keep).to(self.device, non_blocking=True)
                logits = self.forward.iteration(row, positions, keep_at, B)  # [k, V]
        finally:
            self.plan.mode = "idle" if not B else "decode"
        if B:
            self.end_decode()
        cuts = np.concatenate([[0], np.cumsum(lens) if all_logits else np.arange(1, len(lens) + 1)]) + B
        return Iteration(buffers.logits[:B].clone() if B else None, [logits[a:b] for a, b in zip(cuts, cuts[1:])])

    def begin_decode(self, tokens: dict[int, int] | None = None) -> int:
        """Plan a decode step for every running sequence (host work, uploads); the bucket's row count."""
        B = self.planner.begin([], True, tokens)
        self.callbacks.start(B)
        return B

    def end_decode(self) -> None:
        """The step's statistics towards the host, and the event that marks its end."""
        self.callbacks.finish(self.plan.rows)  # a forward driven from outside (TieredKVCache): the step's batched tail
        self.callbacks.drop_step()
        self.feedback.record(self.plan.rows)
        self.plan.mode = "idle"
        self.stats.steps += 1

    # -- what the attention modules call (left out of torch.compile: host logic, Triton launches) --
    @torch.compiler.disable
    def store(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write the step's K/V ``[B, N_kv, q, D]`` of ``layer`` into its pages."""
        self.callbacks.store(layer, key, value)

    @torch.compiler.disable
    def attend(self, layer: int, query: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
        """Attention of ``query [B, H, q, D]`` of ``layer``: ``[B, q, H, D]``."""
        return self.callbacks.attend(layer, query, scaling)

    # -- figures and the end -------------------------------------------------------------------
    def _sync(self) -> None:
        if self.config.sync_timing:
            synchronize(self.device)

    def page_counts(self) -> tuple[int, int]:
        """Pages attended (prefill and decode, every layer), and of them read from the device tier (one sync); a
        step driven from outside and not ended yet counts once every layer has attended."""
        self.callbacks.finish(self.plan.rows)
        attended, resident = self.buffers.counts.tolist()
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


def check_feedback(policy: Policy, scope: Scope, lookahead: int) -> None:
    """Every statistic ``policy`` needs must come from the step: named errors here, never zeros later."""
    needs = set(policy.needs)
    unknown = needs - NEEDS
    if unknown:
        raise ConfigError("policy", f"needs unknown statistics {sorted(unknown)}; the engine gives {sorted(NEEDS)}")
    if lookahead == 0 and (needs or policy.hears_access):
        raise ConfigError("engine.lookahead", f"0 feeds nothing back, and policy '{policy.name}' hears "
                                              f"{sorted(needs) or ['accesses']}: use lookahead >= 1")
    missing = (needs & {"attention", "salience"}) - set(scope.gives)
    if missing:
        raise ConfigError("scope", f"policy '{policy.name}' needs {sorted(missing)}, which scope "
                                   f"'{scope.name}' does not give (it gives {sorted(scope.gives)}); "
                                   "pick a policy that needs less or a scope that gives it")


def policy_statistics(policy: Policy, scope: Scope, layout: KVLayout, pids: int, dev, lookahead: int) -> tuple:
    """The statistics ``scope`` and ``policy`` read, over ``pids`` pids, made here and owned by the engine: ``(keys,
    snapshot slots, the policy's DeviceStats, attention, salience, device scores)``; the key statistics
    (:meth:`KeyStats.needed`) where either needs them, the rest as the policy requests them (queries are made at the
    first attention call, once the heads are known)."""
    L = layout.num_layers
    keys = KeyStats(layout, pids, dev, *KeyStats.needed(scope, policy, layout)) \
        if scope.needs_keys or "keys" in policy.needs else None
    policy.reset(L)
    slots = max(lookahead, 1) + 2  # the feedback's: in flight, shown, one taken now
    requests = policy.requests()
    stats = [DeviceStats(keys, None,
                         AttentionStats(L, pids, layout.num_kv_heads, *r.attention, dev, slots) if r.attention else None,
                         SalienceStats(L, pids, r.salience, dev, slots) if r.salience else None) for r in requests]
    for s, r in zip(stats, requests):
        if r.score is not None:  # the scorer's own function over the engine's statistics, once a step
            s.scores = DeviceScores(lambda n, s=s, score=r.score: score(s.keys, s.queries, n), L, pids, dev, slots)
    policy.attach(stats)
    attention, salience, scores = ([getattr(s, name) for s in stats if getattr(s, name) is not None]
                                   for name in ("attention", "salience", "scores"))
    if scores and keys is None:
        raise ConfigError("policy", f"policy '{policy.name}' scores pages on the device (score_device) from the key "
                                    "statistics, but does not need 'keys': add 'keys' to its scorer's needs")
    if "attention" in policy.needs and not attention:
        raise ConfigError("policy", f"policy '{policy.name}' needs attention but requests no attention statistics: "
                                    "a policy asks for observed attention through requests() (as ScoredPolicy does)")
    return keys, slots, stats, attention, salience, scores


def recall_cache(scope: Scope, tiers: list[Tier], host: Tier | None, R: int, max_pages: int, scratch: np.ndarray,
                 compiled: bool) -> RecallCache:
    """``scope``'s recall cache: its device slots per layer for pages picked from the ``host`` tier (and its landing
    slots for ``R`` rows) in ``tiers[0]``; ``scratch [L]``: the slot idle rows point at."""
    layout = tiers[0].layout
    L, layers, n_land = layout.num_layers, np.arange(layout.num_layers), getattr(scope, "landing_slots", 0)
    if host is None:
        raise ConfigError("scope.recall_slots", "the recall cache holds pages picked from the host tier: "
                                                "add a host tier")
    slots = tiers[0].alloc(layers, scope.recall_slots).numpy().reshape(L, -1)  # [L, C]
    if n_land and layout.scaled:
        raise ConfigError("scope.landing_slots", "the decode lands 16/32-bit pages only (the layout's pages "
                                                 "are 8-bit): set scope.landing_slots=0")
    land = tiers[0].alloc(layers, R * n_land).numpy().reshape(L, R, n_land) if n_land else None
    return RecallCache(slots, max_pages, scratch, tiers[0], host, tiers[0].device, compile=compiled, land=land)


def check_ids(ids, model) -> torch.Tensor:
    """Prompt tokens ``ids [q]``: a non-empty 1-D integer tensor of ids in ``model``'s vocabulary (None: any)."""
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32) or ids.dim() != 1 or \
            ids.numel() < 1:
        raise ConfigError("prompt", "token ids must be a non-empty 1-D integer tensor [S], got "
                                    f"{getattr(ids, 'dtype', type(ids).__name__)} of shape "
                                    f"{tuple(getattr(ids, 'shape', ()))}")
    vocab = model.config.vocab_size if model is not None else None
    if vocab is not None and not 0 <= int(ids.min()) <= int(ids.max()) < vocab:
        raise ConfigError("prompt", f"token ids must be in [0, {vocab}) (the model's vocabulary), got ids from "
                                    f"{int(ids.min())} to {int(ids.max())}")
    return ids.long()


def check_fits(n_tokens, max_pages: int, layout: KVLayout, max_context: int | None) -> None:
    """A prompt of ``n_tokens`` (and the token decoded after it) fits a sequence of ``max_pages`` pages."""
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, (int, np.integer)) or n_tokens < 1 or \
            n_tokens + 1 > max_pages * layout.page_size:
        capped = max_context and layout.pages_for(max_context) == max_pages
        limit = f"engine.max_context={max_context}" if capped else "what the tiers hold"
        raise ConfigError("engine.max_context" if capped else "prompt",
                          f"a prompt of {n_tokens!r} tokens (and the token decoded after it) does not fit "
                          f"{max_pages * layout.page_size} tokens per sequence ({limit})")
