"""Research speed: every shipped policy under each way of spending a token budget, through the one engine.

The real SmolLM2-135M, one sequence of ``--context`` Opticks tokens prefilled exactly, then ``--steps`` decode
steps that each attend ``--fraction`` of the context (4 sinks, a 64-token window, the middle chosen by the
policy (``resident``), once when the prompt is in (``once``), or by Quest (``topk``)); the first row is dense
(scope ``all``, no budget). TPOT is the time between the ends of consecutive steps on the GPU's timeline
(CUDA events, graphs replayed, the host ``--lookahead`` steps ahead; ``torch.compile`` only with ``--compile``);
on a CPU, wall time per step.

    python -m bench.policy_speed --smollm2 /tmp/smollm2/hf [--context 8192] [--fraction 0.2] [--repeats 3]
                                                                              (writes policy_speed.json)
    python -m bench.policy_speed --smoke                                                        (CPU, tiny)
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from bench.common import print_table, write_json
from kvtier.budget import TokenBudget
from kvtier.data import token_stream
from kvtier.engine import Engine, EngineConfig
from kvtier.models import kv_layout_for, load_model
from kvtier.policies import POLICIES
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.scopes import All, Resident, TopK
from kvtier.tiers import DeviceTier, HostTier

SHIPPED = ["lru", "sink_window", "aspe", "h2o", "tova", "snapkv", "knorm", "quest", "expected_attention"]
WARMUP = 4


def row(model, layout, prompt, policy_name, scope, fraction, steps, lookahead, cuda, compile_=False):
    context = prompt.numel()
    total = layout.pages_for(context + steps + WARMUP + 8) + 4
    policy = POLICIES[policy_name]() if policy_name == "lru" else POLICIES[policy_name](sinks=4, window=64)
    budget = None
    if scope != "dense":
        budget = TokenBudget(int(fraction * context), 4, 64, layout.page_size, "once" if scope == "once" else "continuous")
    chooser = {"dense": All(), "resident": Resident(), "once": Resident(), "topk": TopK()}[scope]
    device = budget.step_pages if scope == "resident" else total  # resident: HBM holds what a step attends
    tiers = [DeviceTier(layout, device), HostTier(layout, total)]
    engine = Engine(model, layout, tiers, policy, chooser, prefill=ChunkedPrefill(4096), budget=budget,
                    exact_prefill=budget is not None,
                    config=EngineConfig(lookahead=lookahead, sync_timing=not cuda, compile=compile_))
    seq, logits = engine.add(prompt)
    marks, host_s = [], 0.0
    for i in range(WARMUP + steps):
        if i == WARMUP:
            planned, waited = engine.stats.planned_pages, engine.stats.host_wait_s
        t0 = time.perf_counter()
        engine.step()
        host_s += (time.perf_counter() - t0) if i >= WARMUP else 0.0
        marks.append(engine.feedback.last_event if cuda else time.perf_counter())
    if cuda:
        torch.cuda.synchronize()
        tpot = [marks[i - 1].elapsed_time(marks[i]) for i in range(WARMUP + 1, len(marks))]
    else:
        tpot = list(np.diff(marks[WARMUP:]) * 1e3)
    engine.feedback.take(upto=engine.step_idx)
    out = {"policy": policy_name, "scope": scope, "budget_tokens": budget.tokens if budget else context,
           "tpot_p50_ms": float(np.median(tpot)), "tpot_p99_ms": float(np.percentile(tpot, 99)),
           "keys_per_step": engine.stats.attended_tokens_mean, "hit_rate": engine.hit_rate(),
           "host_wait_ms": engine.stats.host_wait_s / (WARMUP + steps) * 1e3,
           "host_busy_ms": (host_s - engine.stats.host_wait_s + waited) / steps * 1e3,
           "layer_pages_moved_per_step": (engine.stats.planned_pages - planned) / steps}
    engine.close()
    return out


TIMED = ("tpot_p50_ms", "tpot_p99_ms", "host_wait_ms", "host_busy_ms")


def repeated(repeats: int, *args) -> dict:
    """:func:`row` ``repeats`` times, a fresh engine each: its timings the median over the runs, each run's TPOT p50
    in ``tpot_p50_runs`` (the host's run-to-run spread on the H200 is 20-40% on host-bound rows)."""
    runs = [row(*args) for _ in range(repeats)]
    out = dict(runs[-1], **{k: float(np.median([r[k] for r in runs])) for k in TIMED})
    if repeats > 1:
        out["tpot_p50_runs"] = [round(r["tpot_p50_ms"], 3) for r in runs]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smollm2", default=None, help="the real SmolLM2 (converted folder or GGUF); default: the package's")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--fraction", type=float, default=0.2)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--lookahead", type=int, default=2)
    ap.add_argument("--policies", default=",".join(SHIPPED))
    ap.add_argument("--scopes", default="resident,once,topk")
    ap.add_argument("--smoke", action="store_true", help="CPU, 256 tokens, 4 steps, two policies")
    ap.add_argument("--compile", action="store_true", help="torch.compile each engine's forward (minutes per row)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per row, a fresh engine each; timings: their median")
    ap.add_argument("--json", default="policy_speed.json")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    if args.smoke:
        args.context, args.steps, args.policies, args.fraction = 256, 4, "sink_window,h2o", 0.5
    model, tok = load_model(args.smollm2, dtype="bfloat16" if cuda else "float32", device="cuda" if cuda else "cpu")
    layout = kv_layout_for(model.config, page_size=16, dtype=model.dtype)
    prompt = token_stream(tok, "opticks", args.context)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    rows = [repeated(args.repeats, model, layout, prompt, "sink_window", "dense", 1.0, args.steps, args.lookahead, cuda,
                     args.compile)]
    print(rows[-1], flush=True)
    for scope in args.scopes.split(","):
        for name in args.policies.split(","):
            t0 = time.time()
            rows.append(repeated(args.repeats, model, layout, prompt, name, scope, args.fraction, args.steps,
                                 args.lookahead, cuda, args.compile))
            print(rows[-1], f"({time.time() - t0:.0f}s)", flush=True)
            write_json(args.json, {"args": vars(args), "gpu": torch.cuda.get_device_name() if cuda else None,
                                   "rows": rows})
    dense = rows[0]["tpot_p50_ms"]
    for r in rows:
        r["x_dense"] = r["tpot_p50_ms"] / dense
    write_json(args.json, {"args": vars(args), "gpu": torch.cuda.get_device_name() if cuda else None, "rows": rows})
    print_table(f"decode TPOT per policy, SmolLM2 {'bf16 GPU' if cuda else 'fp32 CPU'}, {args.context} tokens, "
                f"{args.fraction:.0%} attended, lookahead {args.lookahead}", rows,
                ["policy", "scope", "budget_tokens", "tpot_p50_ms", "tpot_p99_ms", "x_dense", "keys_per_step",
                 "hit_rate", "host_wait_ms", "host_busy_ms", "layer_pages_moved_per_step"])


if __name__ == "__main__":
    main()
