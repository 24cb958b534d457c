"""Where a decode step's time goes: HF's own attention vs kvtier, host syncs, host functions.

Rows (SmolLM2-shaped model, random weights, B=1, bf16, context written into the tiers as in
:mod:`bench.e2e`): plain HF (sdpa, DynamicCache) on the same context, and :class:`kvtier.engine.Engine`'s
step (CUDA graph, triton kernel, no timing syncs of its own) at 100% HBM (``all``) and 20% (``resident``,
``topk``). The device machine's host is shared and its step times
drift between calls, so the runs are timed in interleaved rounds and the minimum is reported. Then
per step: host<->device copies and stream syncs (torch profiler) and kvtier's hottest host
functions (cProfile).
Run on a GPU:  python -m bench.step_profile   (writes $OUT/step_profile.json)
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections import Counter

import numpy as np
import torch

from bench.common import MODELS, print_table, write_json
from kvtier.engine import Engine, EngineConfig
from kvtier.models import kv_layout_for, random_llama
from kvtier.policies import LRU, SinkWindow
from kvtier.scopes import TopK
from kvtier.tiers import DeviceTier, HostTier

SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaEventSynchronize")


def hf_step(model, context: int):
    """A decode-step closure of plain HF attention (``sdpa``, DynamicCache) after a ``context`` prefill."""
    from transformers import DynamicCache

    cache = DynamicCache()
    ids = torch.randint(0, model.config.vocab_size, (1, context), device="cuda")
    with torch.no_grad():
        state = {"token": model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)}

    def step():
        with torch.no_grad():
            state["token"] = model(state["token"], past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    return step


def median_ms(step, n: int) -> float:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def make_engine(model, layout, context, budget, scope, steps) -> Engine:
    """An engine holding ``context`` tokens of random K/V (written into its pages, as a prefill would leave
    them) in one decoding sequence, room for ``steps`` more."""
    total = layout.pages_for(context + steps + 16)
    dev = max(int(total * budget), 40)
    policy = LRU() if budget == 1.0 else SinkWindow(sinks=4, window=256)
    chooser = TopK(max(dev // 2, 8)) if scope == "topk" else scope
    engine = Engine(model, layout, [DeviceTier(layout, dev), HostTier(layout, total + 64)], policy, chooser,
                    config=EngineConfig(max_context=context + steps + 16, sync_timing=False))
    shape = (layout.num_kv_heads, layout.head_dim)
    engine.add_written(context, lambda layer, a, b: torch.randn(2, b - a, *shape, device="cuda", dtype=layout.dtype))
    return engine


def profile(step, steps: int, top: int) -> dict:
    """Copies and syncs per step (torch profiler) and kvtier's hottest host functions (cProfile)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
    calls = Counter(ev.name for ev in prof.events() if ev.name in SYNC_EVENTS or ev.name.startswith("Memcpy"))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        step()
    pr.disable()
    kv = [(f"{fn[0].split('kvtier/')[-1]}:{fn[2]}", tt / steps * 1e3, ct / steps * 1e3)
          for fn, (_, _, tt, ct, _) in pstats.Stats(pr).stats.items() if "/kvtier/" in fn[0]]
    return {"per_step": {k: v / steps for k, v in calls.items()},
            "syncs_per_step": sum(v for k, v in calls.items() if k in SYNC_EVENTS) / steps,
            "host_top": [{"fn": f, "self_ms_per_step": s, "cum_ms_per_step": c}
                         for f, s, c in sorted(kv, key=lambda x: -x[1])[:top]]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (the host is shared: min of medians)")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    model = random_llama(**MODELS["smollm2-shape"], device="cuda", dtype="bfloat16")
    layout = kv_layout_for(model.config, page_size=16, dtype=torch.bfloat16)
    scopes = [(1.0, "all"), (0.2, "resident"), (0.2, "topk")]
    steps_total = args.steps * (args.rounds + 3)
    model.set_attn_implementation("sdpa")
    hf = hf_step(model, args.context)
    engines = [make_engine(model, layout, args.context, b, s, steps_total) for b, s in scopes]
    runners = {"hf_sdpa": hf, **{f"{s}@{b:g}": e.step for (b, s), e in zip(scopes, engines)}}
    times = {name: [] for name in runners}
    for r in range(args.rounds + 1):  # round 0 warms up
        for name, step in runners.items():
            if name == "hf_sdpa":  # the engines' forward switches it to the kvtier hook
                model.set_attn_implementation("sdpa")
            ms = median_ms(step, args.steps)
            if r:
                times[name].append(ms)
    rows = []
    for name, step in runners.items():
        if name == "hf_sdpa":
            model.set_attn_implementation("sdpa")
        row = {"run": name, "tpot_ms_min": min(times[name]), "tpot_ms_median": float(np.median(times[name])),
               "rounds_ms": times[name], **profile(step, args.steps, args.top)}
        row["vs_hf"] = row["tpot_ms_min"] / min(times["hf_sdpa"])
        rows.append(row)
        print(name, f"tpot min {row['tpot_ms_min']:.1f} ms", row["per_step"])
        for h in row["host_top"]:
            print(f"   {h['fn']:<48} self {h['self_ms_per_step']:7.2f} ms  cum {h['cum_ms_per_step']:7.2f} ms")
    for e in engines:
        e.close()
    print_table(f"decode step, smollm2-shape, {args.context} tokens, B=1, bf16, triton; min of {args.rounds} "
                f"interleaved rounds of {args.steps}-step medians", rows,
                ["run", "tpot_ms_min", "tpot_ms_median", "vs_hf", "syncs_per_step"])
    write_json("step_profile.json", {"gpu": torch.cuda.get_device_name(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
