"""Replay requests against a :class:`ServeScheduler` in real time and summarize the serving figures:
TTFT / ITL / E2E p50 and p99, goodput under SLOs (DistServe's: requests/s that meet every SLO),
prefix hit ratio, tier occupancy over time and preemptions."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from kvtier.metrics import percentile
from kvtier.serve.scheduler import Request, RequestState, ServeScheduler
from kvtier.serve.trace import BLOCK, TraceRequest, prompt_tokens


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 0.250  # seed 002
    itl_s: float = 0.012  # seed 002: every request's ITL p99 below this

    def met(self, state: RequestState) -> bool:
        itl = np.diff(state.token_s)
        return state.first_token_s - state.req.arrival_s < self.ttft_s and \
            (itl.size == 0 or float(np.percentile(itl, 99)) < self.itl_s)

    def goodput(self, done: list[RequestState]) -> tuple[float, float]:
        """(requests/s meeting this SLO over ``done``'s span, their share of ``done``); (0, 0) if none."""
        if not done:
            return 0.0, 0.0
        good = sum(self.met(s) for s in done)
        return good / span_s(done), good / len(done)


def span_s(done: list[RequestState]) -> float:
    """Seconds from the first arrival to the last finish of ``done`` (NaN if empty)."""
    return max(s.finish_s for s in done) - min(s.req.arrival_s for s in done) if done else float("nan")


def trace_requests(trace: list[TraceRequest], vocab: int, block_tokens: int = BLOCK,
                   max_context: int | None = None) -> list[Request]:
    """Trace records -> requests. ``block_tokens < 512`` shrinks every request by ``block_tokens / 512``
    (each hash block becomes ``block_tokens`` tokens, outputs scale alike), keeping the prefix structure
    for small models; ``max_context`` cuts prompts so that prompt + output fit."""
    out = []
    for i, r in enumerate(trace):
        ids = prompt_tokens(r, vocab)
        if block_tokens != BLOCK:  # keep the first block_tokens tokens of each block
            keep = (np.arange(ids.size) % BLOCK) < block_tokens
            ids = ids[keep][:-(-r.input_length * block_tokens // BLOCK)]
        new = max(1, -(-r.output_length * block_tokens // BLOCK))
        if max_context is not None:
            new = min(new, max_context // 2)
            ids = ids[:max_context - new]
        out.append(Request(i, ids, new, r.arrival_s))
    return out


def replay(sched: ServeScheduler, requests: list[Request], slo: SLO = SLO(), progress=None) -> dict:
    """Submit each request at its arrival time (seconds from now, on ``sched.clock``), iterate until all
    finish; the summary (:func:`summarize`)."""
    t0 = sched.clock()
    pending = sorted(requests, key=lambda r: r.arrival_s)
    pending = [Request(r.rid, r.prompt, r.max_new_tokens, t0 + r.arrival_s) for r in pending]
    while pending or not sched.idle:
        now = sched.clock()
        while pending and pending[0].arrival_s <= now:
            sched.submit(pending.pop(0))
        if sched.idle:
            time.sleep(max(0.0, pending[0].arrival_s - now))
            continue
        for _ in sched.iterate():
            if progress is not None:
                progress()
    return summarize(sched, slo, t0)


def summarize(sched: ServeScheduler, slo: SLO, t0: float) -> dict:
    done = sched.done
    ttft = [s.first_token_s - s.req.arrival_s for s in done]
    itl = [float(x) for s in done for x in np.diff(s.token_s)]
    e2e = [s.finish_s - s.req.arrival_s for s in done]
    goodput, met = slo.goodput(done)
    st = sched.stats
    tiers = sorted({t for _, occ, _ in st.occupancy for t in occ})
    return {
        "requests": len(done), "span_s": span_s(done),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
        "e2e_p50_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99),
        "slo_ttft_s": slo.ttft_s, "slo_itl_s": slo.itl_s,
        "goodput_rps": goodput, "slo_met_fraction": met,
        "prefix_hit_tokens": st.cached_tokens / st.prompt_tokens if st.prompt_tokens else 0.0,
        "preemptions": {"swap": st.swaps, "recompute": st.recomputes},
        "iterations": st.iterations, "peak_running": st.peak_running,
        "iteration": _composition(st),
        "occupancy": {"time_s": [t - t0 for t, _, _ in st.occupancy],
                      "pages": {tier: [occ.get(tier, 0) for _, occ, _ in st.occupancy] for tier in tiers},
                      "radix_pages": [n for _, _, n in st.occupancy]},
    }


def _composition(st) -> dict:
    """What the iterations held: mean decode rows and chunk tokens, the share with chunks, time p50 / p99."""
    comp = np.asarray(st.composition, dtype=float).reshape(-1, 3)  # [iterations, (decode rows, tokens, chunks)]
    if not comp.size:
        return {}
    return {"decode_rows_mean": float(comp[:, 0].mean()), "chunk_tokens_mean": float(comp[:, 1].mean()),
            "with_chunks": float((comp[:, 2] > 0).mean()), "chunks_max": int(comp[:, 2].max()),
            "time_p50_s": percentile(st.iteration_s, 50), "time_p99_s": percentile(st.iteration_s, 99)}
