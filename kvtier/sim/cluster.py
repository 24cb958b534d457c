"""The discrete-event simulator of a serving cluster: instances (prefill, decode, or both), the router, the
P -> D KV links, each instance's KV memory (paged or contiguous), its radix prefix cache, and tiered decode.

One event per engine iteration of an instance, one per arrival and one per KV transfer landing. An iteration
of a ``both`` instance is one decode step of its running requests plus prefill chunks of the oldest prompts
(Sarathi-style: the token budget less one token per decoding row); a ``prefill`` instance runs chunks of the
oldest prompts within its token budget per iteration and streams each chunk's KV to the request's decode
instance as the chunk ends (FIFO on that instance's ingress link); a
``decode`` instance admits landed requests while its memory and ``max_batch`` allow. Step times come from
:class:`~kvtier.sim.costs.StepCosts`; a decode step over tiered KV from :class:`Offload`.

TTFT is the first token's time at the instance that decodes: the end of the last prefill chunk (``both``), or
the landing of the request's last KV bytes (P/D). When a paged instance cannot grow its running requests'
pages, the newest is swapped out (its KV kept off the device, bytes counted) and resumes first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from kvtier.errors import ConfigError
from kvtier.serve.radix import RadixCache
from kvtier.serve.trace import BLOCK
from kvtier.sim.costs import StepCosts
from kvtier.sim.events import EventQueue
from kvtier.sim.hardware import Link
from kvtier.sim.ledger import Flight, Ledger
from kvtier.sim.workload import SimRequest

ROLES = ("both", "prefill", "decode")


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
    """One engine (a GPU or a TP group): ``role``, costs, KV room ``kv_tokens`` (all its tiers), ``max_batch``
    rows, ``token_budget`` tokens per iteration, pages of ``page_size`` tokens (0: contiguous, each request
    reserving ``max_context``), a radix prefix cache of ``prefix_tokens``, tiered decode ``offload``."""

    role: str
    costs: StepCosts
    kv_tokens: int
    max_batch: int = 256
    token_budget: int = 2048
    page_size: int = 16
    max_context: int = 0
    prefix_tokens: int = 0
    offload: Offload | None = None

    def __post_init__(self):
        if self.role not in ROLES:
            raise ConfigError("instance.role", f"use one of {ROLES}, got {self.role!r}")
        if self.page_size == 0 and self.max_context < 1:
            raise ConfigError("instance.max_context", "a contiguous instance (page_size 0) needs max_context >= 1")
        if self.kv_tokens < 1 or self.max_batch < 1 or self.token_budget < 2:
            raise ConfigError("instance", "kv_tokens and max_batch must be >= 1, token_budget >= 2")

    def reserved(self, tokens: int) -> int:
        """KV tokens a request holding ``tokens`` tokens reserves."""
        if self.page_size == 0:
            return self.max_context
        return -(-tokens // self.page_size) * self.page_size


class Instance:
    """One instance's state while the simulation runs: its queues, running rows, iteration times and tallies."""

    def __init__(self, spec: InstanceSpec, index: int):
        self.spec, self.index = spec, index
        self.waiting: deque[Flight] = deque()  # prompts to prefill (prefill, both) or landed requests (decode)
        self.swapped: deque[Flight] = deque()  # preempted, resumed first
        self.prefilling: list[Flight] = []  # prompts started, oldest first
        self.running: list[Flight] = []
        self.busy = False
        self.iter_end_s: list[float] = []
        self.busy_s = self.flops = self.stored = self.held = 0.0
        self.peak_running = 0
        self.link_free_s = 0.0  # this instance's ingress link (P -> D)
        self.assigned = 0  # tokens (prompt + output) of the unfinished requests routed here to decode
        self.radix = RadixCache(None, page_size=1) if spec.prefix_tokens >= BLOCK else None
        self.next_pid = 0

    def reservation(self, grow: int = 0) -> int:
        """KV tokens reserved now, or once each running request holds ``grow`` more tokens."""
        r = sum(self.spec.reserved(f.ctx + grow) for f in self.running)
        if self.spec.role == "both":
            r += sum(self.spec.reserved(f.req.prompt + 1) for f in self.prefilling)
        return r

    def queued_tokens(self) -> int:
        return sum(f.req.prompt - f.done for f in self.waiting)


@dataclass
class ClusterSpec:
    instances: list[InstanceSpec]
    kv_link: Link | None = None  # each decode instance's ingress from the prefill instances (P/D)

    def __post_init__(self):
        roles = {s.role for s in self.instances}
        if not self.instances or roles not in ({"both"}, {"prefill", "decode"}):
            raise ConfigError("cluster", f"give 'both' instances, or 'prefill' and 'decode' ones; got {sorted(roles)}")
        if "prefill" in roles and self.kv_link is None:
            raise ConfigError("cluster.kv_link", "a P/D cluster needs the link that carries KV to the decode side")


class Cluster:
    """Run ``requests`` through ``spec``: :meth:`run` returns the :class:`~kvtier.sim.ledger.Ledger` (what
    happened to every request, token and byte) and each instance's record. ``closed_loop``: keep that many
    requests in the system, each finish admitting the next (arrival times ignored)."""

    def __init__(self, spec: ClusterSpec, requests: list[SimRequest], closed_loop: int = 0):
        self.spec, self.requests, self.closed_loop = spec, list(requests), closed_loop
        self.instances = [Instance(s, i) for i, s in enumerate(spec.instances)]
        self.q, self.ledger = EventQueue(), Ledger()
        self._next = 0

    # -- routing ---------------------------------------------------------------------------------
    def _front(self) -> list[Instance]:
        return [i for i in self.instances if i.spec.role in ("both", "prefill")]

    def _decoders(self) -> list[Instance]:
        return [i for i in self.instances if i.spec.role in ("both", "decode")]

    def _arrive(self, req: SimRequest) -> None:
        f = Flight(req, arrival_s=self.q.now)
        self.ledger.flights.append(f)
        self.ledger.arrived += 1
        self.ledger.prompt_tokens += req.prompt
        inst = min(self._front(), key=lambda i: (i.queued_tokens(), i.index))
        inst.waiting.append(f)
        self._start(inst)

    def _release_next(self, now: float) -> None:
        if self._next < len(self.requests):
            self.q.push(now, "arrival", self.requests[self._next])
            self._next += 1

    # -- iterations ------------------------------------------------------------------------------
    def _start(self, inst: Instance) -> None:
        if inst.busy:
            return
        s = inst.spec
        if s.role in ("both", "decode"):
            self._admit(inst)
        rows = list(inst.running)
        parts = self._chunks(inst, s.token_budget - len(rows)) if s.role != "decode" else []
        if not rows and not parts:
            return
        inst.stored += sum(f.ctx for f in rows)
        inst.held += inst.reservation()
        ms, keys = 0.0, float(sum(f.ctx for f in rows))
        c: StepCosts = s.costs
        if rows:
            ms += s.offload.step_ms(c, len(rows), keys) if s.offload else c.decode_ms(len(rows), keys)
            inst.flops += c.model.linear_flops(len(rows)) + c.model.attention_flops(1, keys / len(rows)) * len(rows)
        if parts:
            compute = c.batch_chunk_ms([(n, f.done) for f, n in parts])
            tokens = sum(n for _, n in parts)
            ms += s.offload.chunk_ms(c, tokens, compute) if s.offload else compute
            inst.flops += sum(c.model.linear_flops(n) + c.model.attention_flops(n, f.done) for f, n in parts)
        inst.busy, inst.busy_s = True, inst.busy_s + ms / 1e3
        self.q.push(self.q.now + ms / 1e3, "iteration", (inst, rows, parts))

    def _chunks(self, inst: Instance, budget: int) -> list:
        """``[(flight, tokens)]``: this iteration's prefill chunks, the started prompts first, then new ones
        (a ``both`` instance starts a prompt only when its memory holds it)."""
        s, parts = inst.spec, []
        for f in inst.prefilling:
            if budget <= 0:
                return parts
            n = min(budget, f.req.prompt - f.done)
            parts.append((f, n))
            budget -= n
        while budget > 0 and inst.waiting and (s.role == "prefill" or inst.reservation()
                                               + s.reserved(inst.waiting[0].req.prompt + 1) <= s.kv_tokens):
            f = inst.waiting.popleft()
            inst.prefilling.append(f)
            self._begin_prefill(inst, f)
            n = min(budget, f.req.prompt - f.done)
            parts.append((f, n))
            budget -= n
        return parts

    def _admit(self, inst: Instance) -> None:
        """Swapped requests first, then landed ones, while rows and memory allow; then make room for the step's
        growth by swapping out the newest."""
        s = inst.spec
        for queue in (inst.swapped, inst.waiting if s.role == "decode" else deque()):
            while queue and len(inst.running) < s.max_batch and \
                    inst.reservation() + s.reserved(queue[0].ctx + 1) <= s.kv_tokens:
                f = queue.popleft()
                f.segments.append([inst.index, len(inst.iter_end_s), None])
                inst.running.append(f)
        while inst.running and inst.reservation(grow=1) > s.kv_tokens:
            f = inst.running.pop()
            f.segments[-1][2] = len(inst.iter_end_s)
            self.ledger.preemptions += 1
            self.ledger.swap_bytes += f.ctx * s.costs.token_bytes() * s.costs.tp
            inst.swapped.appendleft(f)
        inst.peak_running = max(inst.peak_running, len(inst.running))

    def _begin_prefill(self, inst: Instance, f: Flight) -> None:
        f.prefill_start_s = self.q.now
        if inst.radix is not None and f.req.blocks:
            m = inst.radix.match(np.asarray(f.req.blocks, dtype=np.int64))
            f.cached = min(m.n_tokens * BLOCK, f.req.prompt - 1)
        f.done = f.cached
        self.ledger.cached_tokens += f.cached
        f.decoder = inst if inst.spec.role == "both" else min(self._decoders(), key=lambda i: (i.assigned, i.index))
        f.decoder.assigned += f.req.prompt + f.req.output

    def _end_prefill(self, inst: Instance, f: Flight) -> None:
        f.prefill_end_s = self.q.now
        inst.prefilling.remove(f)
        if inst.radix is not None:
            full = f.req.blocks[:f.req.prompt // BLOCK]
            inst.radix.insert(np.asarray(full, dtype=np.int64), np.arange(inst.next_pid, inst.next_pid + len(full)))
            inst.next_pid += len(full)
            cap = inst.spec.prefix_tokens // BLOCK
            if inst.radix.num_pages > cap:
                inst.radix.evict(inst.radix.num_pages - cap)

    def _first_token(self, f: Flight, inst: Instance) -> None:
        f.first_token_s, f.ctx, f.generated = self.q.now, f.req.prompt + 1, 1
        self.ledger.output_tokens += 1
        if f.generated >= f.req.output:
            self._finish(f)
        elif inst.spec.role == "both":
            f.segments.append([inst.index, len(inst.iter_end_s), None])
            inst.running.append(f)
        else:
            inst.waiting.append(f)
            self._start(inst)

    def _finish(self, f: Flight) -> None:
        f.finish_s = self.q.now
        f.decoder.assigned -= f.req.prompt + f.req.output
        self.ledger.finished += 1
        if self.closed_loop:
            self._release_next(self.q.now)

    def _iteration(self, inst: Instance, rows: list[Flight], parts: list) -> None:
        inst.busy = False
        inst.iter_end_s.append(self.q.now)
        for f in rows:
            f.ctx += 1
            f.generated += 1
            self.ledger.output_tokens += 1
            if f.generated >= f.req.output:
                f.segments[-1][2] = len(inst.iter_end_s)
                inst.running.remove(f)
                self._finish(f)
        for f, chunk in parts:
            start, f.done = f.done, f.done + chunk
            self.ledger.prefilled_tokens += chunk
            if inst.spec.role == "prefill":
                self._send(f, start, chunk)
            if f.done >= f.req.prompt:
                self._end_prefill(inst, f)
                if inst.spec.role == "both":
                    self._first_token(f, inst)
        self._start(inst)

    def _send(self, f: Flight, start: int, chunk: int) -> None:
        """The chunk's KV (and, with the first chunk, the cached prefix's) to the decode instance's ingress."""
        tokens = chunk + (start if start == f.cached else 0)
        nbytes = tokens * f.decoder.spec.costs.token_bytes() * f.decoder.spec.costs.tp
        dst = f.decoder
        begin = max(self.q.now, dst.link_free_s)
        dst.link_free_s = begin + self.spec.kv_link.seconds(nbytes)
        f.transfer_s += dst.link_free_s - begin
        self.ledger.kv_sent_bytes += nbytes
        self.q.push(dst.link_free_s, "landed", (f, nbytes, start + chunk >= f.req.prompt))

    def run(self) -> Ledger:
        if self.closed_loop:
            for _ in range(self.closed_loop):
                self._release_next(0.0)
        else:
            for r in self.requests:
                self.q.push(r.arrival_s, "arrival", r)
        while len(self.q):
            e = self.q.pop()
            if e.kind == "arrival":
                self._arrive(e.payload)
            elif e.kind == "iteration":
                self._iteration(*e.payload)
            else:  # landed
                f, nbytes, last = e.payload
                self.ledger.kv_landed_bytes += nbytes
                if last:
                    f.landed_s = self.q.now
                    self._first_token(f, f.decoder)
        self.ledger.elapsed_s = self.q.now
        self.ledger.instances = self.instances
        return self.ledger
