"""The discrete-event simulator of a serving cluster: instances (prefill, decode, or both), the router, the KV
links, each instance's KV memory (paged or contiguous), its prefix tiers, a KV pool shared by all, tiered decode.

One event per engine iteration of an instance, per arrival, per prefix load landing and per KV transfer landing.
An iteration of a ``both`` instance is one decode step of its running requests plus prefill chunks of the oldest
prompts (Sarathi-style: the token budget less one token per decoding row); a ``prefill`` instance runs chunks
within its token budget and streams each chunk's KV to the request's decode instance as the chunk ends (FIFO on
that instance's ingress link); a ``decode`` instance admits landed requests while its memory and ``max_batch``
allow. Iteration times come from :class:`~kvtier.sim.costs.StepCosts` (tiered decode: :class:`Offload`), times
``exp(sigma z)``: the step-time noise measured on the calibration's rows (decode steps: the decode group's,
iterations with prompt chunks: the serving group's).

Prefixes: the router (:mod:`kvtier.sim.routing`) picks the instance; the prompt's leading blocks found in that
instance's tiers or the shared pool (:mod:`kvtier.sim.prefixes` finds them in :mod:`kvtier.sim.pool`'s caches)
are read into HBM over their link (queued FIFO on it) when that is faster than recomputing them; a finished
prompt's blocks enter its instance's first tier and the pool. TTFT is the first token's time at the instance that
decodes: the end of the last prefill chunk (``both``), or the landing of the request's last KV bytes (P/D). When a
paged instance cannot grow its running requests' pages, the newest is preempted: ``swap`` moves its KV to host
memory and back over the host link (the iteration that does it waits for the copy), ``recompute`` drops it and
prefills its tokens again first.

Each running request's context is kept as (context, iteration) at its admission, so an iteration costs O(1)
whatever the batch: the keys attended and the pages held are running sums, a page boundary crossed is counted
per phase of the page, and finishes come off a heap.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from kvtier.errors import ConfigError
from kvtier.serve.trace import BLOCK
from kvtier.sim.costs import StepCosts
from kvtier.sim.events import EventQueue
from kvtier.sim.hardware import Link
from kvtier.sim.ledger import Flight, Ledger
from kvtier.sim.pool import Holders, Tier, Tiers
from kvtier.sim.prefixes import Prefixes, hbm_hit
from kvtier.sim.routing import Router
from kvtier.sim.workload import SimRequest

ROLES = ("both", "prefill", "decode")
RUN_AHEAD = 4096  # most decode steps one event stands for
PREEMPT = ("swap", "recompute")


@dataclass(frozen=True)
class Offload:
    """Decode over tiered KV: ``hbm_fraction`` of each sequence's KV in HBM, a step attends ``attended`` of the
    KV (1: exact; less: a sparse top-k scope), ``hit_rate`` of it is found in HBM (the rest is read over
    ``link`` in the step's critical path), and ``promoted`` of it is prefetched over ``link`` per step, overlapped
    with the step's compute (only the part longer than the compute shows)."""

    link: Link
    hbm_fraction: float = 1.0
    attended: float = 1.0
    hit_rate: float = 1.0
    promoted: float = 0.0

    def __post_init__(self):
        for key in ("hbm_fraction", "attended", "hit_rate", "promoted"):
            if not 0 <= getattr(self, key) <= 1:
                raise ConfigError(f"offload.{key}", f"must be in [0, 1], got {getattr(self, key)}")

    def step_ms(self, costs: StepCosts, rows: int, keys: float) -> float:
        """One decode step of ``rows`` sequences holding ``keys`` keys in all."""
        attended, token_bytes = keys * self.attended, costs.token_bytes()
        compute = costs.decode_ms(rows, attended * self.hit_rate)
        miss = self.link.seconds(attended * (1 - self.hit_rate) * token_bytes) * 1e3 if self.hit_rate < 1 else 0.0
        promote = self.link.seconds(attended * self.promoted * token_bytes) * 1e3 if self.promoted else 0.0
        return compute + miss + max(0.0, promote - compute)

    def chunk_ms(self, costs: StepCosts, tokens: int, compute_ms: float) -> float:
        """A prefill chunk whose offloaded share is demoted over ``link`` as it is written, overlapped with the
        chunk's compute (seed 000's chunked prefill with immediate demotion)."""
        demote = self.link.seconds(tokens * (1 - self.hbm_fraction) * costs.token_bytes()) * 1e3
        return max(compute_ms, demote)


@dataclass(frozen=True)
class InstanceSpec:
    """One engine (a GPU or a TP group): ``role``, costs, KV room ``kv_tokens``, ``max_batch`` rows,
    ``token_budget`` tokens per iteration, pages of ``page_size`` tokens (0: contiguous, each request reserving
    ``max_context``), its prefix tiers ``prefix`` (first: HBM), tiered decode ``offload``, how a request is
    ``preempt`` ed, its ``host_link`` (swaps; None: the calibration's pinned host rate on each of its GPUs)."""

    role: str
    costs: StepCosts
    kv_tokens: int
    max_batch: int = 256
    token_budget: int = 2048
    page_size: int = 16
    max_context: int = 0
    prefix: tuple = ()
    offload: Offload | None = None
    preempt: str = "swap"
    host_link: Link | None = None

    def __post_init__(self):
        if self.role not in ROLES:
            raise ConfigError("instance.role", f"use one of {ROLES}, got {self.role!r}")
        if self.preempt not in PREEMPT or (self.preempt == "recompute" and self.role == "decode"):
            raise ConfigError("instance.preempt", f"use one of {PREEMPT} (a decode instance cannot recompute: it "
                                                  f"runs no prefill), got {self.preempt!r}")
        if self.page_size == 0 and self.max_context < 1:
            raise ConfigError("instance.max_context", "a contiguous instance (page_size 0) needs max_context >= 1")
        if self.kv_tokens < 1 or self.max_batch < 1 or self.token_budget < 2:
            raise ConfigError("instance", "kv_tokens and max_batch must be >= 1, token_budget >= 2")
        if self.prefix and self.prefix[0].link is not None:
            raise ConfigError("instance.prefix", "the first prefix tier is the instance's HBM (link None)")

    def reserved(self, tokens: int) -> int:
        """KV tokens a request holding ``tokens`` tokens reserves."""
        if self.page_size == 0:
            return self.max_context
        return -(-tokens // self.page_size) * self.page_size


def hbm_prefix(tokens: int) -> tuple:
    """A prefix cache of ``tokens`` tokens in HBM, nothing below it."""
    return (Tier("HBM", max(1, tokens // BLOCK)),) if tokens >= BLOCK else ()


@dataclass(slots=True)
class RunAhead:
    """Decode steps of the same rows as one event: their ends (s) and times (ms), how many (fewer once cut
    short), the rows, those that joined at the first, pages opened by each step (paged), the event's version."""

    ends: np.ndarray
    ms: np.ndarray
    steps: int
    rows: int
    joined: int
    grown: np.ndarray | None
    version: int


class Instance:
    """One instance's state while the simulation runs: queues, running rows, iteration times and tallies."""

    def __init__(self, spec: InstanceSpec, index: int, holders: Holders | None = None, bit: int = 0):
        self.spec, self.index, self.costs = spec, index, spec.costs
        self.page = spec.page_size
        self.waiting: deque[Flight] = deque()  # prompts to prefill (prefill, both) or landed requests (decode)
        self.swapped: deque[Flight] = deque()  # preempted, resumed first
        self.prefilling: list[Flight] = []  # prompts started, oldest first
        self.running: dict[Flight, None] = {}  # admission order
        self.finishing: list = []  # heap of (iteration it ends after, seq, version, flight)
        self.iters = 0
        self.iter_end_s: list[float] = []
        self.iter_cont: list[int] = []  # rows of each iteration that ran the iteration before it too
        self.joined = 0  # rows admitted to the iteration being planned
        self.ctx_sum = 0  # keys the running rows attend
        self.pages = 0  # pages they hold (paged)
        self.phase = [0] * self.page  # rows by the iteration (mod page) at whose end they open a page
        self.prefill_res = 0  # KV tokens reserved by prompts being prefilled (both)
        self.queued = 0  # prompt tokens waiting or being prefilled, not yet computed
        self.extra_ms = 0.0  # swap copies the next iteration waits for
        self.run_ahead: RunAhead | None = None  # quiet decode steps as one event
        self.run_version = 0
        self.busy = False
        self.busy_s = self.flops = self.stored = self.held = self.row_s = 0.0
        self.peak_running = 0
        self.ingress_free_s = 0.0  # its NIC / P -> D link: when the last queued transfer lands
        self.host_free_s = 0.0  # its host link (local prefix tiers)
        self.assigned = 0  # tokens (prompt + output) of the unfinished requests routed here to decode
        self.tiers = Tiers(list(spec.prefix), holders, bit) if spec.prefix else None
        self.host_link = spec.host_link or Link("host", spec.costs.cal.host_GBps * spec.costs.tp)
        c = spec.costs
        self.token_ms = c.iteration_ms(0, 0.0, [(spec.token_budget, 0)], serve=False) / spec.token_budget
        self.block_bytes = BLOCK * c.token_bytes() * c.tp
        noise = c.cal.noise if c.engine else {}  # kvtier's measured spread; the roofline is the ideal
        self.sigma_decode, self.sigma_mixed = noise.get("decode", 0.0), noise.get("serving", 0.0)

    def reservation(self, grow: bool = False) -> int:
        """KV tokens reserved now, or once each running row holds one more token."""
        if self.page:
            return (self.pages + (self.phase[self.iters % self.page] if grow else 0)) * self.page + self.prefill_res
        return len(self.running) * self.spec.max_context + self.prefill_res


@dataclass
class ClusterSpec:
    instances: list[InstanceSpec]
    kv_link: Link | None = None  # each decode instance's ingress from the prefill instances (P/D)
    pool: tuple = ()  # the KV pool shared by every instance: its tiers, fastest first, each read over the NIC
    nic: Link | None = None  # each instance's NIC, which pool reads and writes cross (needed with a pool)
    router: str = "least_loaded"  # kvtier.sim.routing.ROUTES

    def __post_init__(self):
        roles = {s.role for s in self.instances}
        if not self.instances or roles not in ({"both"}, {"prefill", "decode"}):
            raise ConfigError("cluster", f"give 'both' instances, or 'prefill' and 'decode' ones; got {sorted(roles)}")
        if "prefill" in roles and self.kv_link is None:
            raise ConfigError("cluster.kv_link", "a P/D cluster needs the link that carries KV to the decode side")
        if self.pool and self.nic is None:
            raise ConfigError("cluster.nic", "a shared KV pool is read over each instance's NIC: give the nic link")
        Router(self.router)


class Cluster:
    """Run ``requests`` through ``spec``: :meth:`run` returns the :class:`~kvtier.sim.ledger.Ledger` (what
    happened to every request, token and byte) and each instance's record. ``closed_loop``: keep that many
    requests in the system, each finish admitting the next (arrival times ignored). ``seed``: the step-time
    noise's random stream."""

    def __init__(self, spec: ClusterSpec, requests: list[SimRequest], closed_loop: int = 0, seed: int = 0):
        self.spec, self.requests, self.closed_loop = spec, list(requests), closed_loop
        bit = {i: b for b, i in enumerate(i for i, s in enumerate(spec.instances) if s.role != "decode")}
        holders = Holders(len(bit))  # the front instances' HBM prefixes, a bit each
        self.instances = [Instance(s, i, holders if i in bit else None, bit.get(i, 0))
                          for i, s in enumerate(spec.instances)]
        self.front = [self.instances[i] for i in bit]
        self.decoders = [i for i in self.instances if i.spec.role in ("both", "decode")]
        self.prefixes = Prefixes(holders, spec.pool, spec.nic)
        self.router = Router(spec.router)
        self.q, self.ledger = EventQueue(), Ledger()
        self._next, self._seq = 0, 0
        self._rng = np.random.default_rng(seed)
        self._z, self._zi = self._rng.standard_normal(1 << 16), 0

    def _noise(self, sigma: float) -> float:
        if not sigma:
            return 1.0
        if self._zi == len(self._z):
            self._z, self._zi = self._rng.standard_normal(1 << 16), 0
        self._zi += 1
        return math.exp(sigma * self._z[self._zi - 1])

    # -- arrivals, routing and prefix loads ------------------------------------------------------
    def _arrive(self, req: SimRequest) -> None:
        f = Flight(req, arrival_s=self.q.now)
        self.ledger.flights.append(f)
        self.ledger.arrived += 1
        self.ledger.prompt_tokens += req.prompt
        _, inst, reach, loads = self.router.route(self.prefixes, self.front, req, self.q.now)
        inst.queued += req.prompt
        ready = self.q.now
        for name, blocks, link, own in loads:  # read the prefix into the instance's HBM, FIFO on each link
            attr = "host_free_s" if own else "ingress_free_s"
            begin = max(self.q.now, getattr(inst, attr))
            end = begin + link.seconds(blocks * inst.block_bytes)
            setattr(inst, attr, end)
            ready = max(ready, end)
            read = self.ledger.prefix_read_bytes
            read[name] = read.get(name, 0.0) + blocks * inst.block_bytes
        f.loaded, f.reach = sum(k for _, k, _, _ in loads), reach if loads else 0
        if loads and inst.tiers is not None:
            inst.tiers.touch(req.blocks[:reach])
        if ready > self.q.now:
            self.q.push(ready, "ready", (inst, f))
        else:
            self._enqueue(inst, f)

    def _release_next(self, now: float) -> None:
        if self._next < len(self.requests):
            self.q.push(now, "arrival", self.requests[self._next])
            self._next += 1

    # -- rows joining and leaving ----------------------------------------------------------------
    def _join(self, inst: Instance, f: Flight) -> None:
        a, c = inst.iters, f.ctx
        f.seg_a, f.seg_c0, f.seg_g0 = a, c, f.generated
        f.segments.append([inst.index, a, None])
        inst.running[f] = None
        inst.ctx_sum += c
        if inst.page:
            inst.pages += -(-c // inst.page)
            inst.phase[(a - c) % inst.page] += 1
        f.version += 1
        self._seq += 1
        heapq.heappush(inst.finishing, (a + f.req.output - f.generated, self._seq, f.version, f))
        inst.joined += 1

    def _leave(self, inst: Instance, f: Flight) -> None:
        k = inst.iters
        f.ctx = f.seg_c0 + k - f.seg_a
        f.generated = f.seg_g0 + k - f.seg_a
        del inst.running[f]
        inst.ctx_sum -= f.ctx
        if inst.page:
            inst.pages -= -(-f.ctx // inst.page)
            inst.phase[(f.seg_a - f.seg_c0) % inst.page] -= 1
        f.segments[-1][2] = k
        f.version += 1

    def _swap_ms(self, inst: Instance, f: Flight) -> float:
        nbytes = f.ctx * inst.costs.token_bytes() * inst.costs.tp
        self.ledger.swap_bytes += nbytes
        return inst.host_link.seconds(nbytes) * 1e3

    # -- iterations ------------------------------------------------------------------------------
    def _start(self, inst: Instance) -> None:
        if inst.busy:
            return
        s = inst.spec
        preempted = self._admit(inst) if s.role != "prefill" else False
        rows = len(inst.running)
        parts = self._chunks(inst, s.token_budget - rows) if s.role != "decode" else []
        if not rows and not parts:
            return
        if not parts and not preempted and s.offload is None:  # (a preemption frees room the next step may fill)
            steps, grown = self._quiet_steps(inst)
            if steps > 1:
                return self._start_run_ahead(inst, rows, steps, grown)
        keys = inst.ctx_sum
        inst.stored += keys
        inst.held += inst.reservation()
        c: StepCosts = inst.costs
        chunks = [(n, f.done) for f, n in parts]
        if s.offload:  # the decode step over tiered KV, the chunks demoting their offloaded share as they go
            ms = s.offload.step_ms(c, rows, keys) if rows else 0.0
            if chunks:
                ms += s.offload.chunk_ms(c, sum(n for n, _ in chunks), c.iteration_ms(0, 0.0, chunks))
        else:
            ms = c.iteration_ms(rows, keys, chunks)
        m = c.model
        inst.flops += 2 * m.decode_params * rows + 4 * m.layers * m.q_heads * m.head_dim * keys + \
            sum(2 * m.matmul_params * n + m.attention_flops(n, start) for n, start in chunks)
        ms = ms * self._noise(inst.sigma_mixed if parts else inst.sigma_decode) + inst.extra_ms
        inst.extra_ms = 0.0
        inst.busy, inst.busy_s, inst.row_s = True, inst.busy_s + ms / 1e3, inst.row_s + rows * ms / 1e3
        inst.peak_running = max(inst.peak_running, rows)
        joined, inst.joined = inst.joined, 0
        self.q.push(self.q.now + ms / 1e3, "iteration", (inst, rows, joined, parts))

    def _quiet_steps(self, inst: Instance) -> tuple[int, np.ndarray | None]:
        """Decode steps the instance can run before anything of its own changes: its next finish, or the step
        whose page growth its memory would refuse (work routed to it meanwhile cuts them short: :meth:`_wake`);
        and the pages its rows will have opened by each of them (paged)."""
        h = inst.finishing
        while h and h[0][2] != h[0][3].version:
            heapq.heappop(h)
        steps = min(h[0][0] - inst.iters if h else RUN_AHEAD, RUN_AHEAD)
        if not inst.page or steps < 2:
            return steps, None
        grown = np.cumsum(np.asarray(inst.phase)[(inst.iters + np.arange(steps)) % inst.page])
        over = np.flatnonzero(grown > (inst.spec.kv_tokens - inst.prefill_res) // inst.page - inst.pages)
        return (int(over[0]) if over.size else steps), grown

    def _start_run_ahead(self, inst: Instance, rows: int, steps: int, grown: np.ndarray | None) -> None:
        """``steps`` decode steps of the same rows as one event; each step's time is the one :meth:`_start` would
        give it (the step is affine in the keys it attends), its own noise drawn."""
        c = inst.costs
        base = c.decode_ms(rows, 0.0)
        ms = base + (c.decode_ms(rows, 1.0) - base) * (inst.ctx_sum + rows * np.arange(steps, dtype=np.float64))
        if inst.sigma_decode:
            ms *= np.exp(inst.sigma_decode * self._rng.standard_normal(steps))
        ms[0] += inst.extra_ms
        inst.extra_ms = 0.0
        inst.run_version += 1
        run = inst.run_ahead = RunAhead(self.q.now + np.cumsum(ms) / 1e3, ms, steps, rows, inst.joined, grown,
                                        inst.run_version)
        inst.busy, inst.joined = True, 0
        inst.peak_running = max(inst.peak_running, rows)
        self.q.push(float(run.ends[-1]), "run_ahead", (inst, run.version))

    def _wake(self, inst: Instance) -> None:
        """Work arrived at ``inst``: if it is running decode steps ahead, stop them at the first step ending now
        or later (the step in progress), where a single step would have let it in."""
        run = inst.run_ahead
        if run is not None:
            cut = int(np.searchsorted(run.ends, self.q.now, side="left"))
            if cut < run.steps - 1:
                run.steps = cut + 1
                inst.run_version += 1
                run.version = inst.run_version
                self.q.push(float(run.ends[cut]), "run_ahead", (inst, run.version))

    def _end_run_ahead(self, inst: Instance, version: int) -> None:
        run = inst.run_ahead
        if run is None or version != run.version:
            return  # cut short since: a later event stands for it
        k, rows, P = run.steps, run.rows, inst.page
        inst.iter_end_s.extend(run.ends[:k].tolist())
        inst.iter_cont.extend([rows - run.joined] + [rows] * (k - 1))
        keys = k * inst.ctx_sum + rows * k * (k - 1) / 2  # attended over the k steps
        inst.stored += keys
        if P:
            inst.held += k * (inst.pages * P + inst.prefill_res) + P * float(run.grown[:k - 1].sum())
            inst.pages += int(run.grown[k - 1])
        else:
            inst.held += k * inst.reservation()
        m = inst.costs.model
        inst.flops += k * 2 * m.decode_params * rows + 4 * m.layers * m.q_heads * m.head_dim * keys
        busy = float(run.ms[:k].sum()) / 1e3
        inst.busy_s += busy
        inst.row_s += rows * busy
        inst.iters += k
        inst.ctx_sum += rows * k
        self.ledger.output_tokens += rows * k
        inst.run_ahead, inst.busy = None, False
        self._finish_rows(inst)
        self._start(inst)

    def _enqueue(self, inst: Instance, f: Flight) -> None:
        inst.waiting.append(f)
        self._wake(inst)
        self._start(inst)

    def _finish_rows(self, inst: Instance) -> None:
        """The rows whose last token the instance's last iteration produced leave it."""
        h = inst.finishing
        while h and h[0][0] <= inst.iters:
            _, _, version, f = heapq.heappop(h)
            if version == f.version:
                self._leave(inst, f)
                self._finish(f)

    def _chunks(self, inst: Instance, budget: int) -> list:
        """``[(flight, tokens)]``: this iteration's prefill chunks, the started prompts first, then new ones
        (a ``both`` instance starts a prompt only when its memory holds it)."""
        s, parts = inst.spec, []
        for f in inst.prefilling:
            if budget <= 0:
                return parts
            n = min(budget, f.target - f.done)
            parts.append((f, n))
            budget -= n
        while budget > 0 and inst.waiting and (s.role == "prefill" or inst.reservation()
                                               + s.reserved(inst.waiting[0].target + 1) <= s.kv_tokens):
            f = inst.waiting.popleft()
            self._begin_prefill(inst, f)
            n = min(budget, f.target - f.done)
            parts.append((f, n))
            budget -= n
        return parts

    def _admit(self, inst: Instance) -> bool:
        """Swapped requests first, then landed ones, while rows and memory allow; then make room for the step's
        growth by preempting the newest. Whether it preempted."""
        s, preempted = inst.spec, False
        for queue in (inst.swapped, inst.waiting if s.role == "decode" else ()):
            while queue and len(inst.running) < s.max_batch and \
                    inst.reservation() + s.reserved(queue[0].ctx + 1) <= s.kv_tokens:
                f = queue.popleft()
                if queue is inst.swapped:
                    inst.extra_ms += self._swap_ms(inst, f)
                self._join(inst, f)
        while inst.running and inst.reservation(grow=True) > s.kv_tokens:
            f = next(reversed(inst.running))
            self._leave(inst, f)
            self.ledger.preemptions += 1
            preempted = True
            if s.preempt == "swap":
                inst.extra_ms += self._swap_ms(inst, f)
                inst.swapped.appendleft(f)
            else:  # recompute: its tokens are prefilled again before any new prompt
                f.target, f.done = f.ctx, 0
                inst.queued += f.ctx
                self.ledger.recomputed_tokens += f.ctx
                inst.waiting.appendleft(f)
        return preempted

    def _begin_prefill(self, inst: Instance, f: Flight) -> None:
        inst.prefilling.append(f)
        if inst.spec.role == "both":
            inst.prefill_res += inst.spec.reserved(f.target + 1)
        if f.generated:  # a recompute: whatever of its prompt the instance's HBM still holds
            f.done = hbm_hit(inst, f.req)
            inst.queued -= f.done
            return
        f.prefill_start_s = self.q.now
        hit = max(hbm_hit(inst, f.req), f.reach)
        f.cached = min(hit * BLOCK, f.req.prompt - 1)
        f.done = f.cached
        inst.queued -= f.cached
        self.ledger.cached_tokens += f.cached
        self.ledger.read_tokens += min(f.loaded * BLOCK, f.cached)
        f.decoder = inst if inst.spec.role == "both" else min(self.decoders, key=lambda i: (i.assigned, i.index))
        f.decoder.assigned += f.req.prompt + f.req.output

    def _end_prefill(self, inst: Instance, f: Flight) -> None:
        inst.prefilling.remove(f)
        if inst.spec.role == "both":
            inst.prefill_res -= inst.spec.reserved(f.target + 1)
        if f.generated:
            return
        f.prefill_end_s = self.q.now
        self.ledger.pool_write_bytes += self.prefixes.keep(inst, f.req) * inst.block_bytes

    def _first_token(self, f: Flight, inst: Instance) -> None:
        f.first_token_s, f.ctx, f.generated = self.q.now, f.req.prompt + 1, 1
        self.ledger.output_tokens += 1
        if f.generated >= f.req.output:
            self._finish(f)
        elif inst.spec.role == "both":
            self._join(inst, f)
        else:
            self._enqueue(inst, f)

    def _finish(self, f: Flight) -> None:
        f.finish_s = self.q.now
        f.decoder.assigned -= f.req.prompt + f.req.output
        self.ledger.finished += 1
        if self.closed_loop:
            self._release_next(self.q.now)

    def _iteration(self, inst: Instance, rows: int, joined: int, parts: list) -> None:
        inst.busy = False
        k = inst.iters
        inst.iter_end_s.append(self.q.now)
        inst.iter_cont.append(rows - joined)
        inst.iters = k + 1
        if rows:
            inst.ctx_sum += rows
            if inst.page:
                inst.pages += inst.phase[k % inst.page]
            self.ledger.output_tokens += rows
            self._finish_rows(inst)
        for f, chunk in parts:
            start, f.done = f.done, f.done + chunk
            inst.queued -= chunk
            self.ledger.prefilled_tokens += chunk
            if inst.spec.role == "prefill":
                self._send(f, start, chunk)
            if f.done >= f.target:
                resumed = f.generated > 0
                self._end_prefill(inst, f)
                if resumed:
                    self._join(inst, f)
                elif inst.spec.role == "both":
                    self._first_token(f, inst)
        self._start(inst)

    def _send(self, f: Flight, start: int, chunk: int) -> None:
        """The chunk's KV (and, with the first chunk, the cached prefix's) to the decode instance's ingress."""
        tokens = chunk + (start if start == f.cached else 0)
        nbytes = tokens * f.decoder.costs.token_bytes() * f.decoder.costs.tp
        dst = f.decoder
        begin = max(self.q.now, dst.ingress_free_s)
        dst.ingress_free_s = begin + self.spec.kv_link.seconds(nbytes)
        f.transfer_s += dst.ingress_free_s - begin
        self.ledger.kv_sent_bytes += nbytes
        self.q.push(dst.ingress_free_s, "landed", (f, nbytes, start + chunk >= f.req.prompt))

    def run(self) -> Ledger:
        if self.closed_loop:
            for _ in range(self.closed_loop):
                self._release_next(0.0)
        else:
            for r in self.requests:
                self.q.push(r.arrival_s, "arrival", r)
        q = self.q
        while len(q):
            kind, payload = q.pop()
            if kind == "iteration":
                self._iteration(*payload)
            elif kind == "arrival":
                self._arrive(payload)
            elif kind == "run_ahead":
                self._end_run_ahead(*payload)
            elif kind == "ready":
                self._enqueue(*payload)
            else:  # landed
                f, nbytes, last = payload
                self.ledger.kv_landed_bytes += nbytes
                if last:
                    f.landed_s = q.now
                    self._first_token(f, f.decoder)
        self.ledger.elapsed_s = q.now
        self.ledger.instances = self.instances
        return self.ledger
