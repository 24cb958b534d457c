"""What a simulation did: every request's :class:`Flight` and the cluster's :class:`Ledger` (counts of requests,
tokens and bytes that must balance) with its summary figures."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvtier.sim.workload import SimRequest


@dataclass(eq=False, slots=True)
class Flight:
    """One request through the cluster; times in seconds."""

    req: SimRequest
    arrival_s: float = 0.0
    cached: int = 0  # prompt tokens found in a prefix tier or the pool
    loaded: int = 0  # blocks read into HBM from a lower tier or the pool before the prefill
    reach: int = 0  # the prefix (blocks) those reads complete
    target: int = -1  # tokens to prefill: the prompt, or the context a recompute rebuilds
    done: int = 0  # of them, tokens whose KV exists
    ctx: int = 0  # tokens in the decode KV (when it last joined or left a batch)
    generated: int = 0
    prefill_start_s: float = float("nan")
    prefill_end_s: float = float("nan")
    landed_s: float = float("nan")
    first_token_s: float = float("nan")
    finish_s: float = float("nan")
    transfer_s: float = 0.0  # time its KV occupied the P -> D link
    decoder: object = None  # the Instance that decodes it
    segments: list = field(default_factory=list)  # [instance, first iteration, end iteration) while running
    seg_a: int = 0  # the running segment's first iteration, context and tokens generated then
    seg_c0: int = 0
    seg_g0: int = 0
    version: int = 0  # bumped when it joins or leaves a batch (stale finish entries are skipped)

    def __post_init__(self):
        if self.target < 0:
            self.target = self.req.prompt

    def token_times(self, instances) -> np.ndarray:
        """``[generated]`` times its tokens came out: the first token, then each decode iteration it ran in."""
        parts = [np.array([self.first_token_s])]
        for inst, a, b in self.segments:
            parts.append(np.asarray(instances[inst].iter_end_s[a:b]))
        return np.concatenate(parts)


def pct(x, q) -> float:
    return float(np.percentile(x, q)) if len(x) else float("nan")


def weighted_pct(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """The ``q``-th percentile of ``values`` each counted ``weights`` times (the lower value at a tie)."""
    keep = weights > 0
    if not keep.any():
        return float("nan")
    order = np.argsort(values[keep], kind="stable")
    v, cum = values[keep][order], np.cumsum(weights[keep][order])
    return float(v[np.searchsorted(cum, q / 100 * cum[-1], side="left")])


@dataclass
class Ledger:
    arrived: int = 0
    finished: int = 0
    prompt_tokens: int = 0  # of the arrived requests
    cached_tokens: int = 0  # served by a prefix tier or the pool
    read_tokens: int = 0  # of those, read into HBM from a lower tier or the pool
    prefilled_tokens: int = 0  # computed by prefill chunks (recomputes included)
    recomputed_tokens: int = 0  # prefilled again after a preemption dropped them
    output_tokens: int = 0  # generated
    kv_sent_bytes: float = 0.0  # P -> D
    kv_landed_bytes: float = 0.0
    prefix_read_bytes: dict = field(default_factory=dict)  # source tier -> bytes read into HBM
    pool_write_bytes: float = 0.0  # blocks new to the shared pool
    preemptions: int = 0
    swap_bytes: float = 0.0  # KV copied out to host memory and back
    elapsed_s: float = 0.0
    flights: list = field(default_factory=list)
    instances: list = field(default_factory=list)

    def gaps(self, flights: list[Flight]) -> tuple[np.ndarray, np.ndarray]:
        """The inter-token gaps of ``flights`` as (gap s, how many): every iteration's duration counted once per
        row of these flights that ran it and the one before it, plus each segment's first gap (from the token
        before: the first token, or the last before a preemption)."""
        marks = [np.zeros(len(i.iter_end_s) + 1) for i in self.instances]  # +1 / -1 at segment bounds
        first = []
        for f in flights:
            last = f.first_token_s
            for inst, a, b in f.segments:
                if b > a:
                    ends = self.instances[inst].iter_end_s
                    first.append(ends[a] - last)
                    marks[inst][a + 1] += 1
                    marks[inst][b] -= 1
                    last = ends[b - 1]
        values, weights = [np.asarray(first)], [np.ones(len(first))]
        for inst, m in zip(self.instances, marks):
            if len(inst.iter_end_s) > 1:
                values.append(np.diff(inst.iter_end_s))
                weights.append(np.cumsum(m)[1:-1])
        return np.concatenate(values), np.concatenate(weights)

    def summary(self, slo_ttft_s: float = float("inf"), slo_itl_s: float = float("inf"), warmup: int = 0) -> dict:
        """TTFT (s) and ITL (ms) percentiles over finished requests, throughput, goodput under the SLOs (TTFT and
        the request's ITL p99), peak rows, memory efficiency (KV tokens stored / reserved, over iterations),
        FLOP utilisation per role (executed FLOPs / the GPUs' datasheet peak over the run), rows decoding per
        instance (peak, time average), the prefix hit rate.
        Latencies leave out the first ``warmup`` requests to arrive (a closed loop's initial burst)."""
        done = [f for f in self.flights[warmup:] if f.finish_s == f.finish_s]
        ttft = np.array([f.first_token_s - f.arrival_s for f in done])
        values, weights = self.gaps(done)
        good = ttft <= slo_ttft_s
        if np.isfinite(slo_itl_s):
            for i, f in enumerate(done):
                if good[i] and len(f.segments):
                    good[i] = pct(np.diff(f.token_times(self.instances)), 99) <= slo_itl_s
        span = max(self.elapsed_s, 1e-12)
        mean = float(np.average(values, weights=weights)) if weights.sum() else float("nan")
        out = {"requests": len(done), "elapsed_s": self.elapsed_s,
               "ttft_p50_s": pct(ttft, 50), "ttft_p95_s": pct(ttft, 95), "ttft_p99_s": pct(ttft, 99),
               "itl_p50_ms": weighted_pct(values, weights, 50) * 1e3,
               "itl_p99_ms": weighted_pct(values, weights, 99) * 1e3,
               "itl_std_ms": float(np.sqrt(np.average((values - mean) ** 2, weights=weights))) * 1e3
               if weights.sum() else float("nan"),
               "output_tok_s": self.output_tokens / span, "goodput_rps": int(good.sum()) / span,
               "slo_met": int(good.sum()) / max(1, len(done)), "preemptions": self.preemptions,
               "prefix_hit": self.cached_tokens / max(1, self.prompt_tokens),
               "prefix_read": self.read_tokens / max(1, self.prompt_tokens)}
        peak_all = sum(i.costs.gpu_sheet.bf16_tflops * 1e12 * i.costs.tp for i in self.instances) * span
        out["flop_util"] = sum(i.flops for i in self.instances) / peak_all if peak_all else float("nan")
        for role in ("both", "prefill", "decode"):
            insts = [i for i in self.instances if i.spec.role == role]
            if not insts:
                continue
            peak = sum(i.costs.gpu_sheet.bf16_tflops * 1e12 * i.costs.tp for i in insts) * span
            out[f"{role}_flop_util"] = sum(i.flops for i in insts) / peak
            out[f"{role}_busy"] = sum(i.busy_s for i in insts) / (span * len(insts))
            out[f"{role}_peak_rows"] = max(i.peak_running for i in insts)
            out[f"{role}_mean_rows"] = sum(i.row_s for i in insts) / (span * len(insts))
            held = sum(i.held for i in insts)
            out[f"{role}_memory_efficiency"] = sum(i.stored for i in insts) / held if held else float("nan")
        xfer = [f.transfer_s / (f.prefill_end_s - f.prefill_start_s) for f in done if f.transfer_s]
        if xfer:
            out["transfer_over_prefill"] = float(np.median(xfer))
        return out
