"""Requests for the simulator: a Mooncake trace's (:mod:`kvtier.serve.trace`), open loop at the trace's own
arrival times (scaled), or a synthetic long-context mix. A request's ``blocks`` are its prefix's 512-token hash
blocks (equal ids: reusable KV)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from kvtier.errors import ConfigError
from kvtier.serve.trace import BLOCK, load_trace


@dataclass(frozen=True, slots=True)
class SimRequest:
    rid: int
    arrival_s: float
    prompt: int  # tokens
    output: int  # tokens to generate (>= 1; the first comes from the prefill)
    blocks: tuple[int, ...] = ()  # hash ids of the prompt's 512-token blocks (prefix reuse)


def trace_workload(name: str, requests: int, time_scale: float = 1.0, start: int = 0,
                   max_prompt: int | None = None) -> list[SimRequest]:
    """Requests ``start .. start + requests`` of Mooncake trace ``name`` (conversation | synthetic | a path),
    arrivals divided by ``time_scale``; prompts longer than ``max_prompt`` are cut (their blocks with them).

    More requests than the trace holds tile it: copy ``j`` arrives ``j`` trace spans (plus one mean gap) later,
    its block ids moved past every id of the copies before it, so copies share no prefix (another tenant's
    prompts with the same statistics; the within-copy reuse is the trace's own)."""
    if requests < 1:
        raise ConfigError("workload.requests", f"must be >= 1, got {requests}")
    trace = [(r.arrival_s / time_scale, r) for r in _trace(name, start)]
    last = trace[-1][0]
    span = last + last / max(1, len(trace) - 1)
    stride = 1 + max((max(r.hash_ids, default=0) for _, r in trace), default=0)
    out = []
    for i in range(requests):
        copy, j = divmod(i, len(trace))
        t, r = trace[j]
        prompt = r.input_length if max_prompt is None else min(r.input_length, max_prompt)
        blocks = r.hash_ids[:-(-prompt // BLOCK)]
        out.append(SimRequest(i, t + copy * span, max(1, prompt), max(1, r.output_length),
                              tuple(b + copy * stride for b in blocks) if copy else blocks))
    return out


@lru_cache(maxsize=4)
def _trace(name: str, start: int) -> tuple:
    return tuple(load_trace(name, 1.0, start))


def prefix_hit_ideal(requests: list[SimRequest]) -> float:
    """The prompt tokens an unbounded cache shared by every instance would serve, in arrival order: each
    request's leading blocks seen before (the last token always computed), over all prompt tokens."""
    seen, hit = set(), 0
    for r in sorted(requests, key=lambda r: r.arrival_s):
        n = 0
        for b in r.blocks[:(r.prompt - 1) // BLOCK]:
            if b not in seen:
                break
            n += 1
        hit += n * BLOCK
        seen.update(r.blocks[:r.prompt // BLOCK])
    return hit / max(1, sum(r.prompt for r in requests))


def long_context_mix(requests: int, prompt: int, output: int, rate: float = 0.0, spread: float = 0.0,
                     shared_prefix: int = 0, seed: int = 0) -> list[SimRequest]:
    """``requests`` synthetic requests of about ``prompt`` tokens and ``output`` new tokens (each uniform within
    ``± spread`` of it), Poisson arrivals at ``rate`` per second (0: all at once); the first ``shared_prefix``
    tokens are one prefix all requests share (a system prompt), the rest unique."""
    if requests < 1 or prompt < 1 or output < 1 or not 0 <= spread < 1 or rate < 0:
        raise ConfigError("workload", "requests, prompt and output must be >= 1, spread in [0, 1), rate >= 0")
    rng = np.random.default_rng(seed)
    lengths = np.round(prompt * (1 + spread * rng.uniform(-1, 1, requests))).astype(int)
    outputs = np.maximum(1, np.round(output * (1 + spread * rng.uniform(-1, 1, requests)))).astype(int)
    arrivals = np.cumsum(rng.exponential(1 / rate, requests)) if rate else np.zeros(requests)
    shared = shared_prefix // BLOCK
    out, next_block = [], shared
    for i, (t, n, o) in enumerate(zip(arrivals, lengths, outputs)):
        own = -(-n // BLOCK) - min(shared, -(-n // BLOCK))
        out.append(SimRequest(i, float(t - arrivals[0]), int(n), int(o),
                              tuple(range(min(shared, -(-n // BLOCK)))) + tuple(range(next_block, next_block + own))))
        next_block += own
    return out
