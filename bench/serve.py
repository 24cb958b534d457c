"""Serving bench (H200, Llama-8B shape, random bf16 weights) through kvtier.serve on FastEngine.

1. TTFT of an 8k prompt whose prefix is fully cached in the radix tree vs the same prompt cold
   (target: cached <= 10% of cold); anchor: the prompt's compute-bound limit, 2 * params * S / peak.
2. Decode ITL p99 of 16 running requests while 2k-token prefill chunks of long prompts run in the
   same iterations (target: < 12 ms); anchors: the same decode with no prefill, and the compute-bound
   limit of one iteration's 2k + 16 tokens.
3. Goodput vs request rate of long-context sessions (8k prompt, 32 new tokens) for an all-HBM engine
   and a tiered one with the same HBM plus host DRAM (each session ~20% in HBM: sink + window pinned,
   scope resident; 16 rows): SLO-met requests/s (TTFT < 250 ms, ITL p99 < 12 ms), TTFT / ITL p99 and the peak
   of sessions decoding at once (target: tiered >= 3x the sessions of all-HBM before the SLOs break).

    PYTHONPATH=. python3 -m bench.serve            # table + $OUT/serve.json, about 3 minutes
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from bench.common import MODELS, bench_ms, print_table, write_json
from kvtier.fast.engine import FastEngine
from kvtier.models import kv_layout_for, random_llama
from kvtier.policies import LRU, SinkWindow
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.serve.replay import SLO, replay
from kvtier.serve.scheduler import Request, ServeScheduler
from kvtier.tiers import DeviceTier, HostTier

PAGE = 16


def peak_tflops() -> float:
    """bf16 matmul TFLOP/s measured now (the compute ceiling)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ a, warmup=5, rep=20)
    return 2 * 8192 ** 3 / ms / 1e9


def engine_for(model, hbm_pages: int, host_pages: int, max_batch: int, max_context: int,
               window: int | None = None) -> FastEngine:
    layout = kv_layout_for(model.config, page_size=PAGE, dtype=torch.bfloat16)
    tiers = [DeviceTier(layout, hbm_pages)] + ([HostTier(layout, host_pages)] if host_pages else [])
    policy = SinkWindow(sinks=4, window=window) if window else LRU()
    # no torch.compile: a serving batch visits every bucket, and compiling each would take minutes
    return FastEngine(model, layout, tiers, policy, scope="resident" if window else "all", max_batch=max_batch,
                      max_context=max_context, prefill=ChunkedPrefill(8192), compile=False)


def prompt(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    return rng.integers(0, vocab, n, dtype=np.int64)


def serve_alone(sched: ServeScheduler, ids: np.ndarray, new: int):
    """One request through an otherwise idle scheduler; its state."""
    torch.cuda.synchronize()
    state = sched.submit(Request(len(sched.done), ids, new, sched.clock()))
    while not sched.idle:
        sched.iterate()
    torch.cuda.synchronize()
    return state


def ttft_rows(model, rng, flops, S: int = 8192) -> list[dict]:
    V = model.config.vocab_size
    eng = engine_for(model, hbm_pages=4 * S // PAGE, host_pages=0, max_batch=2, max_context=S + 64)
    sched = ServeScheduler(eng, token_budget=S + 64, prefix_cache=True)
    serve_alone(sched, prompt(rng, S + 1, V), 2)  # warm-up: kernels, the decode graph
    ids = prompt(rng, S + 1, V)
    cold = serve_alone(sched, ids, 2)
    cached = serve_alone(sched, ids, 2)
    t_cold = cold.first_token_s - cold.req.arrival_s
    t_hit = cached.first_token_s - cached.req.arrival_s
    limit = 2 * flops["params"] * S / (flops["tflops"] * 1e12)
    eng.close()
    return [{"part": "ttft 8k", "system": "limit (compute)", "ttft_ms": limit * 1e3},
            {"part": "ttft 8k", "system": "cold", "ttft_ms": t_cold * 1e3, "cached_tokens": cold.cached_tokens},
            {"part": "ttft 8k", "system": "radix hit", "ttft_ms": t_hit * 1e3, "cached_tokens": cached.cached_tokens,
             "x_cold": t_hit / t_cold}]


def itl_rows(model, rng, flops, B: int = 16, ctx: int = 2048, chunk: int = 2048, long: int = 8192) -> list[dict]:
    V = model.config.vocab_size
    new = 24 + 4 * (-(-long // chunk)) + 32  # decoding through the warm-up, the baseline and the chunks
    eng = engine_for(model, hbm_pages=(B * (ctx + new + PAGE) + 4 * long) // PAGE + 64, host_pages=0,
                     max_batch=B + 2, max_context=max(long, ctx + new) + 64)
    sched = ServeScheduler(eng, token_budget=B + chunk, prefix_cache=False)
    decoders = [sched.submit(Request(i, prompt(rng, ctx, V), new, sched.clock())) for i in range(B)]
    while not all(s.decoding for s in decoders):
        sched.iterate()
    for _ in range(8):  # warm-up and decode-only ITL
        sched.iterate()
    torch.cuda.synchronize()
    t0 = sched.clock()
    for _ in range(16):
        sched.iterate()
    t1 = sched.clock()
    for i in range(4):
        sched.submit(Request(B + i, prompt(rng, long, V), 1, sched.clock()))
    while any(not s.decoding for s in sched.active) or sched.waiting:
        sched.iterate()
    t2 = sched.clock()
    gaps = lambda a, b: np.concatenate([np.diff([t for t in s.token_s if a <= t <= b]) for s in decoders])  # noqa: E731
    alone, mixed = gaps(t0, t1), gaps(t1, t2)
    limit = 2 * flops["params"] * (chunk + B) / (flops["tflops"] * 1e12)
    eng.close()
    return [{"part": "itl B=16", "system": "limit (2k+16 tokens, compute)", "itl_p99_ms": limit * 1e3},
            {"part": "itl B=16", "system": "decode only", "itl_p50_ms": float(np.percentile(alone, 50)) * 1e3,
             "itl_p99_ms": float(np.percentile(alone, 99)) * 1e3},
            {"part": "itl B=16", "system": "decode + 2k chunks", "itl_p50_ms": float(np.percentile(mixed, 50)) * 1e3,
             "itl_p99_ms": float(np.percentile(mixed, 99)) * 1e3}]


def goodput_rows(model, rng, rates, n_requests, sessions_hbm, S: int = 8192, new: int = 32) -> list[dict]:
    V = model.config.vocab_size
    per_session = (S + new) // PAGE + 2
    hbm = sessions_hbm * per_session
    rows = []
    for system, host, window in (("all-HBM", 0, None), ("tiered 20% HBM + host", 4 * hbm, S // 5)):
        for rate in rates:
            eng = engine_for(model, hbm, host, max_batch=16, max_context=S + new + 16, window=window)
            sched = ServeScheduler(eng, token_budget=S + 32, prefix_cache=False, preempt="recompute")
            gaps = rng.exponential(1 / rate, n_requests)
            reqs = [Request(i, prompt(rng, S, V), new, float(t)) for i, t in enumerate(np.cumsum(gaps) - gaps[0])]
            serve_alone(sched, prompt(rng, 256, V), 4)  # warm-up
            sched.done.clear()
            t = time.perf_counter()
            out = replay(sched, reqs, SLO())
            rows.append({"part": "goodput", "system": system, "rate_rps": rate, "hbm_sessions": sessions_hbm,
                         "goodput_rps": out["goodput_rps"], "slo_met": out["slo_met_fraction"],
                         "ttft_p99_ms": out["ttft_p99_s"] * 1e3, "itl_p99_ms": out["itl_p99_s"] * 1e3,
                         "peak_running": out["peak_running"], "preempted": out["preemptions"]["recompute"],
                         "wall_s": time.perf_counter() - t})
            print(rows[-1], flush=True)
            eng.close()
            del eng, sched
            torch.cuda.empty_cache()
            torch._C._host_emptyCache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="1,2,4")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--hbm-sessions", type=int, default=4, help="HBM of both engines, in whole 8k sessions")
    ap.add_argument("--parts", default="ttft,itl,goodput")
    ap.add_argument("--json", default="serve.json")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    model = random_llama(**MODELS["llama8b-shape"], device="cuda", dtype="bfloat16")
    flops = {"params": sum(p.numel() for p in model.parameters()), "tflops": peak_tflops()}
    rows = []
    parts = args.parts.split(",")
    if "ttft" in parts:
        rows += ttft_rows(model, rng, flops)
        print(rows[-3:], flush=True)
    if "itl" in parts:
        rows += itl_rows(model, rng, flops)
        print(rows[-3:], flush=True)
    if "goodput" in parts:
        rows += goodput_rows(model, rng, [float(r) for r in args.rates.split(",")], args.requests, args.hbm_sessions)
    print_table(f"serving, Llama-8B shape bf16, page {PAGE}; bf16 peak {flops['tflops']:.0f} TFLOP/s", rows,
                ["part", "system", "rate_rps", "ttft_ms", "x_cold", "cached_tokens", "itl_p50_ms", "itl_p99_ms",
                 "goodput_rps", "slo_met", "ttft_p99_ms", "peak_running", "preempted", "wall_s"])
    write_json(args.json, {"gpu": torch.cuda.get_device_name(), **flops, "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
