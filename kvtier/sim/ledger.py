"""What a simulation did: every request's :class:`Flight` and the cluster's :class:`Ledger` (counts of requests,
tokens and bytes that must balance) with its summary figures."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvtier.sim.workload import SimRequest


@dataclass(eq=False)
class Flight:
    """One request through the cluster; times in seconds."""

    req: SimRequest
    arrival_s: float = 0.0
    cached: int = 0  # prompt tokens found in the radix prefix cache
    done: int = 0  # prompt tokens whose KV exists (cached + prefilled)
    ctx: int = 0  # tokens in the decode KV
    generated: int = 0
    prefill_start_s: float = float("nan")
    prefill_end_s: float = float("nan")
    landed_s: float = float("nan")
    first_token_s: float = float("nan")
    finish_s: float = float("nan")
    transfer_s: float = 0.0  # time its KV occupied the P -> D link
    decoder: object = None  # the Instance that decodes it
    segments: list = field(default_factory=list)  # [instance, first iteration, end iteration) while running

    def token_times(self, instances) -> np.ndarray:
        """``[generated]`` times its tokens came out: the first token, then each decode iteration it ran in."""
        parts = [np.array([self.first_token_s])]
        for inst, a, b in self.segments:
            parts.append(np.asarray(instances[inst].iter_end_s[a:b]))
        return np.concatenate(parts)


def pct(x, q) -> float:
    return float(np.percentile(x, q)) if len(x) else float("nan")


@dataclass
class Ledger:
    arrived: int = 0
    finished: int = 0
    prompt_tokens: int = 0  # of the arrived requests
    cached_tokens: int = 0  # served by the radix cache
    prefilled_tokens: int = 0  # computed by prefill chunks
    output_tokens: int = 0  # generated
    kv_sent_bytes: float = 0.0  # P -> D
    kv_landed_bytes: float = 0.0
    preemptions: int = 0
    swap_bytes: float = 0.0  # KV of swapped-out requests
    elapsed_s: float = 0.0
    flights: list = field(default_factory=list)
    instances: list = field(default_factory=list)

    def summary(self, slo_ttft_s: float = float("inf"), slo_itl_s: float = float("inf"), warmup: int = 0) -> dict:
        """TTFT (s) and ITL (ms) percentiles over finished requests, throughput, goodput under the SLOs (TTFT and
        the request's ITL p99), peak rows, memory efficiency (KV tokens stored / reserved, over iterations),
        FLOP utilisation per role (executed FLOPs / the GPUs' datasheet peak over the run). Latencies leave out
        the first ``warmup`` requests to arrive (a closed loop's initial burst)."""
        done = [f for f in self.flights[warmup:] if not np.isnan(f.finish_s)]
        ttft = np.array([f.first_token_s - f.arrival_s for f in done])
        gaps = [np.diff(f.token_times(self.instances)) for f in done]
        itl = np.concatenate(gaps) if gaps else np.zeros(0)
        req_itl99 = np.array([pct(g, 99) if len(g) else 0.0 for g in gaps])
        good = int(np.sum((ttft <= slo_ttft_s) & (req_itl99 <= slo_itl_s)))
        span = max(self.elapsed_s, 1e-12)
        out = {"requests": len(done), "elapsed_s": self.elapsed_s,
               "ttft_p50_s": pct(ttft, 50), "ttft_p95_s": pct(ttft, 95), "ttft_p99_s": pct(ttft, 99),
               "itl_p50_ms": pct(itl, 50) * 1e3, "itl_p99_ms": pct(itl, 99) * 1e3,
               "itl_std_ms": float(itl.std()) * 1e3 if len(itl) else float("nan"),
               "output_tok_s": self.output_tokens / span, "goodput_rps": good / span,
               "slo_met": good / max(1, len(done)),
               "preemptions": self.preemptions, "prefix_hit": self.cached_tokens / max(1, self.prompt_tokens)}
        peak_all = sum(i.spec.costs.gpu.bf16_tflops * 1e12 * i.spec.costs.tp for i in self.instances) * span
        out["flop_util"] = sum(i.flops for i in self.instances) / peak_all if peak_all else float("nan")
        for role in ("both", "prefill", "decode"):
            insts = [i for i in self.instances if i.spec.role == role]
            if not insts:
                continue
            peak = sum(i.spec.costs.gpu.bf16_tflops * 1e12 * i.spec.costs.tp for i in insts) * span
            out[f"{role}_flop_util"] = sum(i.flops for i in insts) / peak
            out[f"{role}_busy"] = sum(i.busy_s for i in insts) / (span * len(insts))
            out[f"{role}_peak_rows"] = max(i.peak_running for i in insts)
            held = sum(i.held for i in insts)
            out[f"{role}_memory_efficiency"] = sum(i.stored for i in insts) / held if held else float("nan")
        xfer = [f.transfer_s / (f.prefill_end_s - f.prefill_start_s) for f in done if f.transfer_s]
        if xfer:
            out["transfer_over_prefill"] = float(np.median(xfer))
        return out
