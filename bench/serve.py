"""Serving bench (H200, Llama-8B shape, random bf16 weights) through kvtier.serve on :class:`kvtier.engine.Engine`.

Each part first runs, untimed, every path it then times: a Triton kernel compiles at its first launch of a
shape, a decode bucket captures its CUDA graph at its first step.

Compute floors count the matmuls (2 x the weights that multiply, embeddings and the unused logits left out, per
token) and causal attention (4 x heads x head_dim x layers per query-key pair seen), at the matmul peak measured
in the run.

1. TTFT of a cold 8k prompt in one chunk and in chunks of 512 (targets: <= 1.3x its compute floor), and of
   the same prompt once its 8k-token prefix is in the radix tree: its last token joins the decode rows of the
   next iteration, a captured decode step over 512 shared pages (target: <= 5% of cold); each the median over
   three fresh prompts. Warm-up: the same paths on another prompt.
2. Decode ITL p50 / p99 of 16 running requests (2k contexts) while four 8k prompts are prefilled in 2k
   chunks (token budget 16 + 2k), then in 256-token chunks (budget 16 + 256), each iteration one forward of
   the decode tokens and the chunk; anchors: the same decode with no prefill, and per chunk size the
   compute floor of the chunk (its matmuls and its attention over the prompt's mean context). Target at 256:
   p99 <= 1.3 x (decode-only p99 + the chunk's floor). Warm-up: one 8k prompt at each chunk size.
3. Goodput vs request rate on a Mooncake trace (``--trace``: conversation, whose arrivals come in bursts of
   10-16 on a 3 s grid, or synthetic; kvtier/traces: its first requests, their prompts, shared prefixes
   included, cut to 8k tokens (``--prompt-tokens``), outputs to 32 tokens (``--new-tokens``; ``--outputs
   fixed``: that many each); arrival gaps rescaled to mean 1 / rate: the rate is exact), token budget 512,
   radix cache on, for an all-HBM engine and a tiered one with the same HBM plus host DRAM (each session ~20%
   in HBM: sink + window pinned, scope resident; 16 rows, ``--rows``), the same requests for every rate and
   both systems. Per rate: goodput and SLO-met share under the seed SLOs (TTFT < 250 ms, ITL p99 < 12 ms)
   and under SLOs scaled to this model and shape, measured in the run on the idle all-HBM engine (one
   session served alone): TTFT < 3x its TTFT, ITL p99 < 5x its decode ITL (p50); TTFT / ITL p99, peak and
   mean of sessions decoding at once, preemptions. Sustained: per system the highest rate whose scaled-SLO
   share is >= 0.9, the sessions decoding at once then and the lower rates that missed (``missed_below``), and
   their ratios tiered / all-HBM (target >= 3x).
   Warm-up, per engine: 16 short requests whose batch shrinks through every decode bucket, per decode bucket
   one prompt of each token bucket below the budget and one S-token prompt beside that many decoders, then one
   session more than the HBM holds, at once, then the workload
   at its highest rate (an iteration's CUDA graph is captured at the first use of its decode rows and token
   bucket: hundreds of ms that would land in a timed request). A timed replay that still captured a graph runs
   once more (``replays`` 2; ``captured_in_timed``: the second's captures).

Every engine runs with ``lookahead=2``: the scheduler plans and launches an iteration before it reads the last
one's tokens back (one iteration in flight), so the host's planning overlaps the GPU.

    PYTHONPATH=. python3 -m bench.serve           # tables + $OUT/serve.json, 3-4 minutes on an H200
    PYTHONPATH=. python3 -m bench.serve --smoke   # CPU check of the whole script: tiny fp32 model, tiny sizes,
                                                  # about 15 s (writes serve_smoke.json)
"""

from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from bench.baselines import free_device_memory
from bench.common import MODELS, bench_ms, print_table, write_json
from kvtier.engine import Engine, EngineConfig
from kvtier.engine.graphs import TOKEN_BUCKETS
from kvtier.models import kv_layout_for, random_llama
from kvtier.policies import LRU, SinkWindow
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.serve.replay import SLO, replay, trace_requests
from kvtier.serve.trace import load_trace
from kvtier.serve.scheduler import Request, RequestState, ServeScheduler
from kvtier.tiers import DeviceTier, HostTier

PAGE = 16
TTFT_X, ITL_X = 3.0, 5.0  # scaled SLOs: multiples of an idle session's TTFT and decode ITL, measured in the run
SYSTEMS = (("all-HBM", False), ("tiered 20% HBM + host", True))  # (name, tiered); all-HBM first: it sets the SLO
SMOKE_MODEL = dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, vocab_size=256)
RIDS = itertools.count()
COLUMNS = {"ttft": ["part", "system", "ttft_ms", "x_floor", "x_cold", "cached_tokens"],
           "itl": ["part", "system", "itl_p50_ms", "itl_p99_ms", "x_target", "plan_p50_ms", "plan_p99_ms",
                   "wait_p50_ms"],
           "goodput": ["part", "system", "rate_rps", "ttft_ms", "itl_p50_ms", "ttft_p99_ms", "itl_p99_ms",
                       "goodput_rps", "slo_met", "scaled_goodput_rps", "scaled_slo_met", "peak_running",
                       "decoding_mean", "preempted", "replays", "missed_below", "wall_s"]}


@dataclass(frozen=True)
class Sizes:
    long: int = 8192  # tokens of a long prompt: the TTFT prompt, the ITL part's prefills
    session: int = 8192  # goodput: prompts cut to this many tokens
    ctx: int = 2048  # ITL part: context of each decoding request
    batch: int = 16  # ITL part: decoding requests
    rows: int = 16  # goodput: rows of each engine
    trace: str = "conversation"  # goodput: the Mooncake trace replayed (conversation or synthetic)
    outputs: str = "trace"  # goodput: output lengths, the trace's cut to ``new`` or ``new`` each ("fixed")
    chunks: tuple[int, ...] = (2048, 256)  # ITL part: prefill chunk sizes, one row each
    budget: int = 512  # goodput: token budget of an iteration
    new: int = 32  # goodput: output tokens of a session


SMOKE = Sizes(long=128, session=128, ctx=32, batch=4, rows=4, chunks=(64, 16), budget=48, new=8)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_tflops(device: torch.device, dtype: torch.dtype) -> float:
    """Matmul TFLOP/s in ``dtype`` measured now (the compute ceiling)."""
    n = 8192 if device.type == "cuda" else 256
    a = torch.randn(n, n, device=device, dtype=dtype)
    if device.type == "cuda":
        ms = bench_ms(lambda: a @ a, warmup=5, rep=20)
    else:
        a @ a
        t = time.perf_counter()
        a @ a
        ms = (time.perf_counter() - t) * 1e3
    return 2 * n ** 3 / ms / 1e9


def engine_for(model, hbm_pages: int, host_pages: int, max_batch: int, max_context: int,
               window: int | None = None) -> Engine:
    layout = kv_layout_for(model.config, page_size=PAGE, dtype=model.dtype)
    tiers = [DeviceTier(layout, hbm_pages, device=model.device)] + \
        ([HostTier(layout, host_pages)] if host_pages else [])
    policy = SinkWindow(sinks=4, window=window) if window else LRU()
    # compiled on a GPU (the engine's default): each decode bucket once, iterations with chunks once for every token
    # count; lookahead 2: the scheduler plans an iteration while the GPU runs the one before
    return Engine(model, layout, tiers, policy, "resident" if window else "all", prefill=ChunkedPrefill(8192),
                  config=EngineConfig(max_batch=max_batch, max_context=max_context, lookahead=2))


def prompt(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    return rng.integers(0, vocab, n, dtype=np.int64)


def serve_now(sched: ServeScheduler, requests: list[tuple[np.ndarray, int]]) -> list[RequestState]:
    """``requests`` (prompt, new tokens) arriving now at an idle scheduler, served to the end; their states."""
    sync()
    states = [sched.submit(Request(next(RIDS), ids, new, sched.clock())) for ids, new in requests]
    while not sched.idle:
        sched.iterate()
    sync()
    return states


def prefill_beside(sched: ServeScheduler, prompts: list[np.ndarray]) -> None:
    """Prefill ``prompts`` (one output token each) in the budget the running decoders leave, to the last."""
    for ids in prompts:
        sched.submit(Request(next(RIDS), ids, 1, sched.clock()))
    while any(not s.decoding for s in sched.active) or sched.waiting:
        sched.iterate()


def floor_s(model, flops, tokens: int, pairs: float) -> float:
    """Compute floor of ``tokens`` query tokens that see ``pairs`` query-key pairs in all: their matmuls (2 x the
    weights that multiply, per token) and attention (QK^T and PV: 4 x heads x head_dim x layers per pair)."""
    c = model.config
    attention = 4 * c.num_attention_heads * (c.hidden_size // c.num_attention_heads) * c.num_hidden_layers
    return (2 * flops["matmul_params"] * tokens + attention * pairs) / (flops["tflops"] * 1e12)


def ttft_s(state: RequestState) -> float:
    return state.first_token_s - state.req.arrival_s


def ttft_rows(model, rng, flops, S: int, repeats: int = 3) -> list[dict]:
    """Each TTFT is the median over ``repeats`` fresh prompts (``runs_ms`` lists them)."""
    V = model.config.vocab_size
    eng = engine_for(model, hbm_pages=4 * S // PAGE, host_pages=0, max_batch=2, max_context=S + 64)
    whole = ServeScheduler(eng, token_budget=S + 64, prefix_cache=True)
    chunked = ServeScheduler(eng, token_budget=512, prefix_cache=False)
    warm = prompt(rng, S + 1, V)
    for _ in range(2):  # warm-up: the cold path, then the hit on its cached prefix
        serve_now(whole, [(warm, 2)])
    serve_now(chunked, [(warm, 2)])
    runs = {"cold": [], "hit": [], "in_512": []}  # TTFTs in ms
    for _ in range(repeats):
        ids = prompt(rng, S + 1, V)
        for name, sched, p in (("cold", whole, ids), ("hit", whole, ids), ("in_512", chunked, prompt(rng, S + 1, V))):
            state = serve_now(sched, [(p, 2)])[0]
            runs[name].append((ttft_s(state) * 1e3, state.cached_tokens))
            if name == "hit":
                whole.drop_prefix_cache()  # HBM for the next prompts (the chunked scheduler cannot evict this tree)
    floor = floor_s(model, flops, S + 1, (S + 1) * (S + 2) / 2) * 1e3
    eng.close()
    ms = {name: float(np.median([t for t, _ in r])) for name, r in runs.items()}
    row = lambda name, system, **more: {"part": f"ttft {S}", "system": system, "ttft_ms": ms[name],
                                        "runs_ms": [t for t, _ in runs[name]], "cached_tokens": runs[name][-1][1],
                                        **more}
    return [{"part": f"ttft {S}", "system": "floor (compute)", "ttft_ms": floor},
            row("cold", "cold, one chunk", x_floor=ms["cold"] / floor),
            row("in_512", "cold, chunks of 512", x_floor=ms["in_512"] / floor),
            row("hit", "radix hit", x_cold=ms["hit"] / ms["cold"])]


def itl_rows(model, rng, flops, sz: Sizes) -> list[dict]:
    V, B, long = model.config.vocab_size, sz.batch, sz.long
    mixed = sum(5 * -(-long // c) for c in sz.chunks)  # iterations: a warm-up and 4 timed prompts per chunk size
    new = 8 + 16 + mixed + 32  # decoding through the warm-up, the baseline and every chunk
    eng = engine_for(model, hbm_pages=(B * (sz.ctx + new + PAGE) + 4 * long) // PAGE + 64, host_pages=0,
                     max_batch=B + 2, max_context=max(long, sz.ctx + new) + 64)
    sched = ServeScheduler(eng, token_budget=B + max(sz.chunks), prefix_cache=False)
    decoders = [sched.submit(Request(next(RIDS), prompt(rng, sz.ctx, V), new, sched.clock())) for _ in range(B)]
    while not all(s.decoding for s in decoders):
        sched.iterate()
    for _ in range(8):  # warm-up
        sched.iterate()
    sync()

    def itl(a: float, b: float) -> dict:  # p50 / p99 of the decoders' inter-token gaps within [a, b]
        g = np.concatenate([np.diff([t for t in s.token_s if a <= t <= b]) for s in decoders])
        return {"itl_p50_ms": float(np.percentile(g, 50)) * 1e3, "itl_p99_ms": float(np.percentile(g, 99)) * 1e3}

    part = f"itl B={B}"
    t0 = sched.clock()
    for _ in range(16):
        sched.iterate()
    rows = [{"part": part, "system": "decode only", **itl(t0, sched.clock())}]
    for chunk in sz.chunks:
        sched.budget = B + chunk
        prefill_beside(sched, [prompt(rng, long, V)])  # warm-up: every chunk of a long prompt, beside decode
        t1, first = sched.clock(), len(sched.stats.iteration_s)
        prefill_beside(sched, [prompt(rng, long, V) for _ in range(4)])
        st = sched.stats
        took, plan, wait = (np.asarray(x[first:]) * 1e3 for x in (st.iteration_s, st.plan_s, st.wait_s))
        # one iteration in flight: the tokens of iteration i are read after iteration i + 1 is planned
        n = min(plan.size - 1, wait.size)
        gap, after = (plan[1:n + 1] + wait[:n], plan[1:n + 1]) if sched.ahead else (took, plan)
        slow = sorted(zip(gap, after, wait, st.composition[first:]), key=lambda x: -x[0])[:8]
        floor = floor_s(model, flops, chunk, chunk * long / 2)
        got = itl(t1, sched.clock())
        target = 1.3 * (rows[0]["itl_p99_ms"] + floor * 1e3)
        rows += [{"part": part, "system": f"floor ({chunk}-token chunk, compute)", "itl_p99_ms": floor * 1e3},
                 {"part": part, "system": f"decode + {chunk}-token chunks", **got,
                  "x_target": got["itl_p99_ms"] / target, "iteration_p50_ms": float(np.median(took)),
                  "plan_p50_ms": float(np.median(plan)), "plan_p99_ms": float(np.percentile(plan, 99)),
                  "wait_p50_ms": float(np.median(wait)),
                  "slowest_iterations": [(round(float(g), 2), round(float(p), 2), round(float(w), 2), *c)
                                         for g, p, w, c in slow]}]
        print(f"{chunk}-token chunks: the slowest iterations (ms from one read-back to the next, the host's plan, its "
              f"wait for the GPU; decode rows, chunk tokens, chunks): {rows[-1]['slowest_iterations']}", flush=True)
    eng.close()
    return rows


def trace_workload(trace: str, n: int, S: int, new: int, vocab: int, outputs: str = "trace") -> list[Request]:
    """The first ``n`` requests of a Mooncake trace, prompts cut to ``S`` tokens, outputs the trace's cut to ``new``
    (``outputs="fixed"``: ``new`` each, so that sessions last and pile up), arrival gaps rescaled to mean 1 s:
    divided by a rate r, the requests arrive at exactly r per second on average (n - 1 gaps over (n - 1) / r
    seconds)."""
    reqs = trace_requests(load_trace(trace, limit=n), vocab)
    gaps = np.diff([r.arrival_s for r in reqs])
    unit = np.concatenate([[0.0], np.cumsum(gaps / gaps.mean())]) if gaps.any() else np.arange(n, dtype=float)
    return [Request(r.rid, r.prompt[:S], new if outputs == "fixed" else max(2, min(r.max_new_tokens, new)), float(t))
            for r, t in zip(reqs, unit)]


def warm_up(sched: ServeScheduler, rng, vocab: int, S: int, new: int, sessions: int) -> None:
    """Untimed, the shapes a replay meets: ``max_batch`` short requests at once, each ending a token before the
    one admitted before it (the batch shrinks through every decode bucket); per decode bucket, prompts arriving
    one after another while that many requests decode (their chunks beside them, as at a low rate): one of each
    token bucket up to the budget (a trace's short prompts and the last chunks of long ones), then an S-token
    one; then ``sessions`` S-token requests at once (chunked prefills beside decode; on a tiered engine, pages
    moved to the host and read back)."""
    rows = sched.engine.max_batch
    serve_now(sched, [(prompt(rng, PAGE, vocab), rows + 2 - i) for i in range(rows)])
    lengths = [b for b in TOKEN_BUCKETS if b < sched.budget] + [S]
    for bucket in sched.engine.buckets:
        decoders = [sched.submit(Request(next(RIDS), prompt(rng, PAGE, vocab), 8 + S // 64 + 4 * len(lengths),
                                         sched.clock())) for _ in range(bucket)]
        while not all(s.decoding for s in decoders):
            sched.iterate()
        for n in lengths:  # each served to its end while the decoders run on
            state = sched.submit(Request(next(RIDS), prompt(rng, n, vocab), 2, sched.clock()))
            while state not in sched.done:
                sched.iterate()
        while not sched.idle:
            sched.iterate()
    serve_now(sched, [(prompt(rng, S, vocab), new) for _ in range(sessions)])


def scaled_slo(sched: ServeScheduler, ids: np.ndarray, new: int) -> tuple[SLO, list[dict]]:
    """SLOs scaled to this model and shape: ``ids`` served alone by an idle ``sched``; TTFT < TTFT_X x its TTFT,
    ITL p99 < ITL_X x its decode ITL (p50, one session decoding). The SLO and its rows."""
    alone = serve_now(sched, [(ids, new)])[0]
    ttft = alone.first_token_s - alone.req.arrival_s
    itl = float(np.median(np.diff(alone.token_s)))
    slo = SLO(TTFT_X * ttft, ITL_X * itl)
    return slo, [{"part": "goodput", "system": "1 session alone (idle all-HBM)", "ttft_ms": ttft * 1e3,
                  "itl_p50_ms": itl * 1e3},
                 {"part": "goodput", "system": f"scaled SLO ({TTFT_X:g}x, {ITL_X:g}x alone)",
                  "ttft_ms": slo.ttft_s * 1e3, "itl_p99_ms": slo.itl_s * 1e3}]


def fresh_scheduler(eng: Engine, budget: int, used: list) -> ServeScheduler:
    """A new scheduler on ``eng`` (prefix cache on, recompute on preemption); the last of ``used`` first gives its
    prefix tree's pages back."""
    if used:
        used[-1].drop_prefix_cache()
    used.append(ServeScheduler(eng, token_budget=budget, prefix_cache=True, preempt="recompute"))
    return used[-1]


def goodput_rows(model, rng, sz: Sizes, rates: list[float], n_requests: int, sessions_hbm: int) -> list[dict]:
    V, S, new = model.config.vocab_size, sz.session, sz.new
    hbm = sessions_hbm * ((S + new) // PAGE + 2)
    base = trace_workload(sz.trace, n_requests, S, new, V, sz.outputs)  # the same requests, every rate, both systems
    workload = {rate: [Request(next(RIDS), r.prompt, r.max_new_tokens, r.arrival_s / rate) for r in base]
                for rate in rates}
    rows = []
    for system, tiered in SYSTEMS:
        eng = engine_for(model, hbm, 4 * hbm if tiered else 0, max_batch=sz.rows, max_context=S + new + 16,
                         window=S // 5 if tiered else None)
        used: list[ServeScheduler] = []
        warm_up(fresh_scheduler(eng, sz.budget, used), rng, V, S, new, sessions_hbm + 1)
        # untimed, the workload at its highest rate: the (decode rows, token bucket) graphs it meets are captured
        replay(fresh_scheduler(eng, sz.budget, used), workload[max(rates)], SLO())
        if not tiered:
            slo, slo_rows = scaled_slo(fresh_scheduler(eng, sz.budget, used), prompt(rng, S, V), new)
            rows += slo_rows
            print(*slo_rows, sep="\n", flush=True)  # a run cut off before its table keeps the SLO it used
        for rate, reqs in workload.items():
            for attempt in range(2):  # a replay that captured a graph paid for it in a timed request: once more
                sched, before = fresh_scheduler(eng, sz.budget, used), eng.captured
                t = time.perf_counter()
                out = replay(sched, reqs, SLO())
                if eng.captured == before:
                    break
            scaled_rps, scaled_met = slo.goodput(sched.done)
            rows.append({"part": "goodput", "system": system, "rate_rps": rate, "hbm_sessions": sessions_hbm,
                         "goodput_rps": out["goodput_rps"], "slo_met": out["slo_met_fraction"],
                         "scaled_goodput_rps": scaled_rps, "scaled_slo_met": scaled_met,
                         "ttft_p99_ms": out["ttft_p99_s"] * 1e3, "itl_p99_ms": out["itl_p99_s"] * 1e3,
                         "peak_running": out["peak_running"], "preempted": out["preemptions"]["recompute"],
                         "decoding_mean": out["iteration"].get("decode_rows_mean", 0.0),
                         "replays": attempt + 1, "captured_in_timed": eng.captured - before,
                         "cached_share": sched.stats.cached_tokens / max(1, sched.stats.prompt_tokens),
                         "wall_s": time.perf_counter() - t})
            print(rows[-1], flush=True)
        eng.close()
        del eng, sched, used
        free_device_memory(keep_compiled=True)
    return rows + sustained_rows(rows)


def sustained_rows(rows: list[dict]) -> list[dict]:
    """Per system, the highest rate whose scaled-SLO share is >= 0.9 (None: no rate), the sessions decoding at
    once then (peak, and the mean over its iterations) and the lower rates that missed (``missed_below``: a
    sustained rate with a miss below it is not sustained by the stricter rule that every lower rate passes)."""
    out = []
    for system, _ in SYSTEMS:
        mine = [r for r in rows if r["system"] == system]
        best = max((r for r in mine if r["scaled_slo_met"] >= 0.9), key=lambda r: r["rate_rps"],
                   default={"rate_rps": None, "peak_running": 0, "decoding_mean": 0.0})
        missed = [r["rate_rps"] for r in mine if best["rate_rps"] is not None and r["rate_rps"] < best["rate_rps"]
                  and r["scaled_slo_met"] < 0.9]
        out.append({"part": "sustained", "system": system, "rate_rps": best["rate_rps"],
                    "peak_running": best["peak_running"], "decoding_mean": best["decoding_mean"],
                    "missed_below": missed})
    return out


def sessions_ratio(rows: list[dict]) -> dict:
    """Tiered / all-HBM at the rates each sustains: sessions decoding (peak, mean) and the rates (NaN when all-HBM
    sustains none)."""
    all_hbm, tiered = (r for r in rows if r["part"] == "sustained")
    return {key: (tiered[key] or 0) / all_hbm[key] if all_hbm[key] else float("nan")  # tiered none: 0
            for key in ("peak_running", "decoding_mean", "rate_rps")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default=None, help="goodput: requests/s (default 0.25,0.5,1,2; --smoke: 2,20)")
    ap.add_argument("--requests", type=int, default=10, help="goodput: requests per rate (>= 2)")
    ap.add_argument("--new-tokens", type=int, default=None, help=f"goodput: output tokens of a session, >= 2 "
                                                                 f"(default {Sizes.new}; --smoke: {SMOKE.new})")
    ap.add_argument("--hbm-sessions", type=int, default=4, help="HBM of both goodput engines, in whole sessions")
    ap.add_argument("--trace", default=None, choices=["conversation", "synthetic"], help="goodput: the trace")
    ap.add_argument("--rows", type=int, default=None, help=f"goodput: rows of each engine (default {Sizes.rows})")
    ap.add_argument("--outputs", default="trace", choices=["trace", "fixed"],
                    help="goodput: output lengths, the trace's cut to --new-tokens, or --new-tokens each (sessions "
                         "that outlast the arrivals between them: the HBM budget binds)")
    ap.add_argument("--prompt-tokens", type=int, default=None, help=f"goodput: prompts cut to this many tokens "
                                                                    f"(default {Sizes.session}; --smoke: {SMOKE.session})")
    ap.add_argument("--parts", default="ttft,itl,goodput")
    ap.add_argument("--smoke", action="store_true", help="CPU check of the whole script: tiny fp32 model, tiny sizes")
    ap.add_argument("--json", default=None, help="output file name (default serve.json; --smoke: serve_smoke.json)")
    args = ap.parse_args()
    base = SMOKE if args.smoke else Sizes()
    sz = replace(base, new=base.new if args.new_tokens is None else args.new_tokens,
                 session=base.session if args.prompt_tokens is None else args.prompt_tokens,
                 trace=args.trace or base.trace, rows=base.rows if args.rows is None else args.rows,
                 outputs=args.outputs)
    parts = args.parts.split(",")
    if sz.new < 2 or args.requests < 2 or sz.rows < 1 or sz.session < 1 or not set(parts) <= set(COLUMNS):
        ap.error(f"--new-tokens >= 2 (the scaled ITL SLO needs a decode gap), --requests >= 2 (a gap between "
                 f"arrivals), --rows and --prompt-tokens >= 1, --parts among {list(COLUMNS)}")
    rates = [float(r) for r in (args.rates or ("2,20" if args.smoke else "0.25,0.5,1,2")).split(",")]
    rng = np.random.default_rng(0)
    if args.smoke:
        torch.set_num_threads(1)  # a tiny model: more threads only contend for the cores
        model = random_llama(**SMOKE_MODEL, device="cpu", dtype="float32")
    else:
        model = random_llama(**MODELS["llama8b-shape"], device="cuda", dtype="bfloat16")
    flops = {"params": sum(p.numel() for p in model.parameters()), "tflops": peak_tflops(model.device, model.dtype)}
    flops["matmul_params"] = flops["params"] - model.model.embed_tokens.weight.numel() - model.lm_head.weight.numel()
    device = torch.cuda.get_device_name() if model.device.type == "cuda" else "cpu"
    shape = "tiny fp32 (smoke)" if args.smoke else "Llama-8B shape bf16"
    runs = {"ttft": lambda: ttft_rows(model, rng, flops, sz.long),
            "itl": lambda: itl_rows(model, rng, flops, sz),
            "goodput": lambda: goodput_rows(model, rng, sz, rates, args.requests, args.hbm_sessions)}
    result = {"device": device, **flops, "args": vars(args), "sizes": asdict(sz), "rows": []}
    for part in parts:  # each part's table and the JSON so far as soon as it ends (a cut-off run keeps them)
        t = time.perf_counter()
        rows = runs[part]()
        print_table(f"{part} ({time.perf_counter() - t:.0f} s): serving on {device}, {shape}, page {PAGE}; "
                    f"matmul peak {flops['tflops']:.3g} TFLOP/s", rows, COLUMNS[part])
        result["rows"] += rows
        if part == "goodput":
            ratio = result["sustained_ratio"] = sessions_ratio(rows)
            print(f"at the highest rate meeting the scaled SLOs, tiered / all-HBM: sessions decoding "
                  f"{ratio['peak_running']:.2f}x at peak, {ratio['decoding_mean']:.2f}x on average (target >= 3x); "
                  f"rate {ratio['rate_rps']:.2f}x", flush=True)
            for row in rows[-2:]:  # the sustained rows
                if row["missed_below"]:
                    print(f"  {row['system']} misses the scaled SLOs at the lower rates {row['missed_below']} req/s: "
                          f"by the rule that every lower rate passes it sustains none of them", flush=True)
        write_json(args.json or ("serve_smoke.json" if args.smoke else "serve.json"), result)


if __name__ == "__main__":
    main()
