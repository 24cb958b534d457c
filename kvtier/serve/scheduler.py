"""ServeScheduler: continuous batching of requests over :class:`~kvtier.engine.Engine`.

Each iteration has a token budget shared by decode tokens (one per running request) and prefill
chunks (Sarathi-Serve, Agrawal et al. OSDI'24; vLLM v1's unified budget): running requests decode
first, the rest of the budget goes to prompt chunks, the oldest request first (several prompts' chunks
may share an iteration), and a request that finishes its prompt emits its first token at once. The
decode tokens and the chunks run as one forward (:meth:`kvtier.engine.Engine.iterate`); an iteration
without chunks is the engine's captured decode step. Each iteration's composition (decode rows, prefill
tokens, chunks) is recorded in :attr:`ServeStats.composition`.

With scope ``all`` and no token budget a request whose uncached prompt suffix is a single token (a
radix hit of all but its last token) joins the decode rows at once, fed that token: its first token
costs one decode step (:attr:`kvtier.engine.Engine.decodes_like_prefill`).

A new request starts from the longest cached page-aligned prefix of its prompt (:class:`~kvtier.radix.RadixCache`
over the engine's block table, whichever tier the pages are in: prefill gathers them, decode reads
host pages in place and the engine's scheduler promotes them). Its prompt pages enter the tree when
its prefill ends, its generated pages when it finishes; pages no request holds are evicted from the
tree, leaf first in the engine policy's order, whenever room is short. On an engine with a tier below the device,
each step keeps a budget's chunk of device slots free (at most a quarter of the device,
:meth:`~kvtier.engine.Engine.keep_room`): the tree's pages go down first, while earlier requests run, so a prompt
that arrives at an idle engine full of them need not wait for its room to be copied out.

**Preemption.** Before each iteration the engine must hold one free page per running request (its
next token may open a page); when the tiers cannot, even after evicting the tree, the most recently
arrived request is preempted (vLLM's rule) until they can. Rule for the victim's K/V: *swap* when it
fits the free swap space (host DRAM outside the engine's tiers, ``swap_tokens``): its pages are
copied out and written back into fresh pages on resume, nothing recomputed; else *recompute*: its full
pages go to the radix tree (freed only if room is still short, so a resume re-matches what survived)
and the rest is prefilled again. Either way it resumes with its last generated token as input, so it
produces the same tokens as an uninterrupted run.

**One iteration in flight.** With an engine whose host runs ahead (``EngineConfig(lookahead >= 2)``) the
scheduler plans and launches iteration ``t + 1`` before it reads iteration ``t``'s tokens back: decode rows take
their inputs from the engine's device tokens, a prompt that ended in ``t`` starts decoding on its first token
still on the device, and a request whose last token is in flight leaves its row at once. Tokens reach the host
through pinned memory behind an event, so the host's planning overlaps the GPU's iteration (vLLM v1's async
scheduling). With ``lookahead <= 1`` every iteration's tokens are read before the next is planned.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.errors import ConfigError, KVTierError, TierFullError
from kvtier.engine import Engine
from kvtier.radix import PrefixMatch

PREEMPT_MODES = ("auto", "recompute")


@dataclass
class Request:
    rid: int
    prompt: np.ndarray  # [S] token ids
    max_new_tokens: int
    arrival_s: float = 0.0


@dataclass
class RequestState:
    req: Request
    seq: int | None = None  # engine sequence (None: waiting or preempted)
    decoding: bool = False
    output: list[int] = field(default_factory=list)
    match: PrefixMatch | None = None
    swapped: list[torch.Tensor] | None = None  # per layer [2, T, N_kv, D] on the host, while swapped out
    cached_tokens: int = 0  # prompt tokens taken from the radix tree at admission
    first_token_s: float | None = None
    token_s: list[float] = field(default_factory=list)  # time of every output token
    finish_s: float | None = None
    preemptions: int = 0

    @property
    def tokens(self) -> np.ndarray:
        """Tokens whose K/V the sequence holds or will: the prompt and every output token but the last."""
        return np.concatenate([self.req.prompt, np.asarray(self.output[:-1], dtype=np.int64)])

    def held(self, n: int) -> np.ndarray:
        """The first ``n`` tokens of the prompt and the outputs read back (those whose K/V the sequence holds)."""
        known = np.concatenate([self.req.prompt, np.asarray(self.output, dtype=np.int64)])
        if known.size < n:
            raise KVTierError(f"request {self.req.rid}: {n} tokens held, {known.size} known")
        return known[:n]


@dataclass
class InFlight:
    """An iteration launched and not read back: its new tokens ``[n]`` on their way to the host (pinned memory,
    ``event`` marks their arrival); ``owners``: ``(request, index of its token)``."""

    tokens: torch.Tensor
    event: torch.cuda.Event | None
    owners: list[tuple[RequestState, int]]
    start_s: float


@dataclass
class ServeStats:
    iterations: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served by the radix tree
    swaps: int = 0
    recomputes: int = 0
    peak_running: int = 0  # most requests decoding in one iteration
    composition: list = field(default_factory=list)  # per iteration run (decode rows, prefill tokens, chunks)
    iteration_s: list = field(default_factory=list)  # per iteration run, seconds from its plan to its tokens read
    plan_s: list = field(default_factory=list)  # per iteration run, host seconds from its start to its launch
    wait_s: list = field(default_factory=list)  # per iteration run, host seconds blocked reading its tokens back
    occupancy: list = field(default_factory=list)  # (time s, {tier: pages used in layer 0}, radix pages)


class ServeScheduler:
    """Requests -> engine sequences, one budgeted iteration at a time (:meth:`iterate`)."""

    def __init__(self, engine: Engine, token_budget: int = 512, prefix_cache: bool = True,
                 preempt: str = "auto", swap_tokens: int = 0, clock=time.perf_counter):
        if not isinstance(token_budget, int) or token_budget < engine.max_batch + 1:
            raise ConfigError("task.token_budget", f"must exceed max_batch={engine.max_batch} (one decode token "
                                                    f"per row, plus prefill), got {token_budget!r}")
        device_pages = engine.pages.device_capacity
        if device_pages - 1 < 2 * engine.max_batch:  # the scratch page, and each row's written and next page
            raise ConfigError("task.max_batch", f"the device tier holds {device_pages} pages per layer; serving "
                                                 f"{engine.max_batch} rows needs at least {2 * engine.max_batch + 1}")
        if preempt not in PREEMPT_MODES:
            raise ConfigError("task.preempt", f"use one of {PREEMPT_MODES}, got {preempt!r}")
        if not isinstance(swap_tokens, int) or swap_tokens < 0 or (swap_tokens and preempt == "recompute"):
            raise ConfigError("task.swap_tokens", f"host tokens of swap space, >= 0 and only with preempt 'auto'; "
                                                   f"got {swap_tokens!r} with {preempt!r}")
        self.engine, self.budget, self.clock = engine, token_budget, clock
        self.swap_tokens, self.swap_used = swap_tokens, 0
        self.tree = engine.pages.prefix_tree() if prefix_cache else None
        self.waiting: list[RequestState] = []  # arrival order, preempted ones back in their place
        self.active: list[RequestState] = []  # holding an engine row (prefilling or decoding)
        self.done: list[RequestState] = []
        self.stats = ServeStats()
        self.ahead = engine.lookahead >= 2  # one iteration in flight while the next is planned
        if engine.pages.tiered:  # room for a budget's chunk, made ahead: a prompt need not wait for copies
            engine.keep_room(min(engine.layout.pages_for(token_budget) + 1, device_pages // 4))
        self.inflight: InFlight | None = None

    def submit(self, req: Request) -> RequestState:
        S = int(len(req.prompt))
        limit = self.engine.max_pages * self.engine.layout.page_size
        if S < 1 or req.max_new_tokens < 1 or S + req.max_new_tokens > limit:
            raise ConfigError("request", f"request {req.rid}: {S} prompt + {req.max_new_tokens} new tokens must be "
                                         f">= 1 each and fit max_context={limit}")
        state = RequestState(req)
        self.waiting.append(state)
        self.waiting.sort(key=lambda s: s.req.arrival_s)
        self.stats.prompt_tokens += S
        return state

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.active and self.inflight is None

    def drop_prefix_cache(self) -> None:
        """Give every page of the prefix tree back to the engine (an idle scheduler handing its engine on): the
        finished sequences' pages first, so that no tree page is still shared with one."""
        if not self.idle:
            raise KVTierError("drop_prefix_cache needs an idle scheduler: requests still hold tree pages")
        self.engine.reclaim()
        if self.tree is not None:
            self.tree.evict(self.tree.num_pages)

    # -- one iteration -------------------------------------------------------------------------
    def iterate(self) -> list[RequestState]:
        """Make room (evict, preempt), spend the budget on prompt chunks, then decode one token for every
        running request. Returns the requests whose last token was read back."""
        self.stats.iterations += 1
        t0 = self.clock()
        finished: list[RequestState] = []
        self._make_room(finished)
        decoding = [s for s in self.active if s.decoding]
        chunks = self._chunks(self.budget - len(decoding))
        decoding = [s for s in self.active if s.decoding]  # with those that joined as decode rows
        if not decoding and not chunks:  # nothing to run: the tokens in flight
            self._read_back(finished)
            self._record()
            return finished
        self.stats.peak_running = max(self.stats.peak_running, len(decoding))
        self.stats.composition.append((len(decoding), sum(len(ids) for _, ids in chunks), len(chunks)))
        out = self.engine.iterate([(s.seq, torch.from_numpy(ids)) for s, ids in chunks], decode=bool(decoding))
        new = [out.logits.argmax(-1)] if decoding else []  # [B] on the device: each decode row's next token
        owners = [(s, self.engine.row_seq.index(s.seq)) for s in decoding]
        for (state, _), logits in zip(chunks, out.chunk_logits):
            if self.engine.pages.seq_len(state.seq) == len(state.tokens):  # its prompt is in
                first = logits[-1].argmax(-1, keepdim=True)  # [1] its first output token, on the device
                if self._start_decode(state, first):
                    owners.append((state, sum(t.numel() for t in new)))
                    new.append(first)
        launched = self._launch(torch.cat(new) if new else  # a chunk that ends no prompt: none
                                torch.zeros(0, dtype=torch.int64, device=self.engine.device), owners, t0)
        self.stats.plan_s.append(self.clock() - t0)
        self._read_back(finished)  # the iteration before (when one runs ahead), else this one
        self.inflight = launched
        if not self.ahead:
            self._read_back(finished)
        self._release_due()
        self._record()
        return finished

    def _launch(self, tokens: torch.Tensor, owners: list, t0: float) -> InFlight:
        """Start copying an iteration's new tokens ``[n]`` to the host, behind the iteration (no wait)."""
        cuda = tokens.device.type == "cuda"
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=cuda)
        host.copy_(tokens, non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        return InFlight(host, event, owners, t0)

    def _read_back(self, finished: list) -> None:
        """Wait for the iteration in flight (if any) and emit its tokens."""
        flight, self.inflight = self.inflight, None
        if flight is None:
            return
        t = self.clock()
        if flight.event is not None:
            flight.event.synchronize()
        now = self.clock()
        self.stats.wait_s.append(now - t)
        self.stats.iteration_s.append(now - flight.start_s)
        tokens = flight.tokens.tolist()
        for state, i in flight.owners:
            self._emit(state, tokens[i], now, finished)

    def _in_flight(self, state: RequestState) -> int:
        """Tokens of ``state`` launched and not read back (0 or 1)."""
        return int(self.inflight is not None and any(s is state for s, _ in self.inflight.owners))

    def _release_due(self) -> None:
        """Requests whose last token is out (read back or in flight) leave their rows; their pages go to the tree."""
        for state in [s for s in self.active if s.decoding]:
            if len(state.output) + self._in_flight(state) >= state.req.max_new_tokens:
                self._release(state, keep=True)

    def _chunks(self, budget: int) -> list[tuple[RequestState, np.ndarray]]:
        """Admit requests and cut the iteration's prompt chunks ``(state, ids)`` from ``budget`` tokens, oldest
        request first."""
        chunks, pages = [], 0
        order = [s for s in self.active if not s.decoding] + list(self.waiting)
        for state in order:
            if budget <= 0:
                break
            if state.seq is None and self._shares_in_flight(state):
                break  # it waits until that prompt is in the tree, then matches it (SGLang's in-batch prefix check)
            if state.seq is None and not self._admit(state):
                if not self.active:
                    raise TierFullError(f"request {state.req.rid}: {len(state.tokens)} tokens do not fit the engine's "
                                        "empty tiers; raise their capacities or shorten the request")
                break  # FCFS: later requests wait behind the first that does not fit
            if state.decoding:  # swapped back in: nothing to compute
                continue
            tokens = state.tokens
            done = self.engine.pages.seq_len(state.seq)
            if len(tokens) - done == 1 and not state.output and self.engine.decodes_like_prefill:
                if not self._room(pages + 1):
                    break
                self._start_decode(state, int(tokens[-1]))  # a decode row from now on, emitting from the next
                budget -= 1
                continue
            q = min(budget, len(tokens) - done)
            need = self.engine.layout.pages_for(done + q) - self.engine.pages.num_pages(state.seq)
            if not self._room(pages + need):
                break
            pages += need
            chunks.append((state, tokens[done:done + q]))
            budget -= q
        return chunks

    def _shares_in_flight(self, state: RequestState) -> bool:
        """Does ``state``'s first page of tokens equal that of a request still prefilling (not in the tree yet)?"""
        if self.tree is None:
            return False
        P = self.engine.layout.page_size
        head = state.tokens[:P]
        return head.size == P and any(not s.decoding and s.seq is not None and np.array_equal(s.tokens[:P], head)
                                      for s in self.active)

    def _admit(self, state: RequestState) -> bool:
        """Give ``state`` a row: swap it back in, or open it on its longest cached prefix."""
        if None not in self.engine.row_seq:
            return False
        tokens = state.tokens
        if state.swapped is not None:
            if not self._room(self.engine.layout.pages_for(len(tokens)) + 1):
                return False
            kv = state.swapped
            dev = self.engine.device
            state.seq = self.engine.add_written(len(tokens), lambda layer, a, b: kv[layer][:, a:b].to(dev),
                                                next_token=state.output[-1])
            self.swap_used -= len(tokens)
            state.swapped, state.decoding = None, True
        else:
            m = self.tree.match(tokens, max_tokens=len(tokens) - 1) if self.tree is not None else None
            held = m.pids if m is not None else np.zeros(0, dtype=np.int64)
            with self.engine.pages.held(held):  # making room must not evict the pages it matched
                # admitted only when its whole prompt fits: a partly prefilled victim is work thrown away
                room = self._room(self.engine.layout.pages_for(len(tokens)) - held.size)
                if room:
                    shared = (m.pids, m.n_tokens) if m is not None else ((), 0)
                    state.seq, state.match = self.engine.open(len(tokens), *shared), m
            if not room:
                return False
            if not state.preemptions:
                state.cached_tokens = shared[1]
                self.stats.cached_tokens += shared[1]
        self.waiting.remove(state)
        self.active.append(state)
        return True

    def _start_decode(self, state: RequestState, first) -> bool:
        """``state``'s prompt is in: it decodes from the next iteration, fed ``first`` (its first output token, a
        device tensor ``[1]``, or its last prompt token, whose output the next iteration emits). False when it
        resumes after a preemption: its next input is its last output, and ``first`` is not emitted."""
        if self.tree is not None:
            n = self.engine.pages.seq_len(state.seq)
            self.tree.insert(state.held(n), self.engine.pages.pids(state.seq), after=state.match)
        resumed = bool(state.output)
        self.engine.start_decode(state.seq, state.output[-1] if resumed else first)
        state.decoding = True
        return not resumed

    def _emit(self, state: RequestState, token: int, now: float, finished: list) -> None:
        state.output.append(token)
        state.token_s.append(now)
        if state.first_token_s is None:
            state.first_token_s = now
        if len(state.output) == state.req.max_new_tokens:
            state.finish_s = now
            self.done.append(state)
            finished.append(state)

    # -- memory --------------------------------------------------------------------------------
    def _room(self, pages: int) -> bool:
        """Are ``pages`` (plus one per running request) free, after evicting the tree if needed?"""
        need = pages + sum(s.decoding for s in self.active)
        if need > self.engine.pages.free_pages():
            self.engine.reclaim()
        short = need - self.engine.pages.free_pages()
        if short > 0 and self.tree is not None:
            self.tree.step = max(self.engine.step_idx, 0)
            self.tree.evict(short)
        return self.engine.pages.free_pages() >= need

    def _make_room(self, finished: list) -> None:
        """Preempt the latest arrivals until the running requests' next pages fit."""
        if not self._room(0):
            self._read_back(finished)  # a victim resumes from its last output: read the tokens in flight first
            self._release_due()
        while not self._room(0):
            victims = sorted(self.active, key=lambda s: s.req.arrival_s)
            if len(victims) <= 1:
                raise TierFullError("the engine's tiers cannot hold a single request's next page: "
                                    "raise the tier capacities or shorten the requests")
            self._preempt(victims[-1])

    def _preempt(self, state: RequestState) -> None:
        """Swap ``state`` out if it fits the swap space, else hand its pages to the tree and recompute."""
        n = self.engine.pages.seq_len(state.seq)
        if state.decoding and self.swap_used + n <= self.swap_tokens:
            state.swapped = self.engine.read_sequence(state.seq, n)
            self.swap_used += n
            self.stats.swaps += 1
            self._release(state, keep=False)
        else:
            self.stats.recomputes += 1
            self._release(state, keep=True)
        state.decoding = False
        state.preemptions += 1
        self.waiting.append(state)
        self.waiting.sort(key=lambda s: s.req.arrival_s)

    def _release(self, state: RequestState, keep: bool) -> None:
        """Drop ``state``'s sequence; with ``keep`` its full computed pages enter the radix tree first."""
        if keep and self.tree is not None:
            n = self.engine.pages.seq_len(state.seq)
            self.tree.insert(state.held(n), self.engine.pages.pids(state.seq), after=state.match)
        self.engine.finish(state.seq)
        self.active.remove(state)
        state.seq, state.match = None, None

    def _record(self) -> None:
        occ = self.engine.pages.used_by_tier()
        self.stats.occupancy.append((self.clock(), occ, self.tree.num_pages if self.tree is not None else 0))
