"""What one captured decode step launches: each CUDA kernel's count and time per step, and the host's hottest
kvtier functions, through :class:`kvtier.engine.Engine` (random weights, random K/V written into the pages as in
:mod:`bench.e2e`; its tiered rows' tiers, policy and scope).

    python -m bench.step_kernels smollm2-shape 1 8192 [all 1.0 | topk 0.2 | resident 0.2]   (writes step_kernels-*.json)
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
from collections import defaultdict

import numpy as np
import torch

from bench.common import MODELS, write_json
from kvtier.engine import Engine, EngineConfig
from kvtier.models import kv_layout_for, random_llama
from kvtier.policies import LRU, SinkWindow
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.scopes import TopK, make_scope
from kvtier.tiers import DeviceTier, HostTier


def engine_for(model, layout, batch: int, context: int, steps: int, scope: str, budget: float) -> Engine:
    """``batch`` sequences of ``context`` random K/V tokens; tiers, policy and scope as :func:`bench.e2e.kvtier_row`."""
    total = layout.pages_for(context + steps + 8) * batch
    dev = total + 1 if budget >= 1 else max(int(total * budget), batch * 24)
    tiers = [DeviceTier(layout, dev)] + ([HostTier(layout, total + 64)] if budget < 1 else [])
    policy = SinkWindow(sinks=4, window=256) if scope == "resident" else LRU()
    topk = max(int(total // batch * budget) // 2, 16)
    chooser = TopK(topk, recall_slots=topk * batch if budget < 1 else 0) if scope == "topk" else make_scope(scope)
    engine = Engine(model, layout, tiers, policy, chooser, prefill=ChunkedPrefill(4096),
                    config=EngineConfig(max_batch=batch, max_context=context + steps + 8, lookahead=2,
                                        buckets=[batch], sync_timing=False))
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (layout.num_kv_heads, layout.head_dim)
    for _ in range(batch):
        engine.add_written(context, lambda layer, a, b: torch.randn(2, b - a, *shape, generator=gen, device="cuda",
                                                                     dtype=torch.bfloat16))
    return engine


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", choices=list(MODELS))
    ap.add_argument("batch", type=int)
    ap.add_argument("context", type=int)
    ap.add_argument("scope", nargs="?", default="all", choices=["all", "resident", "topk"])
    ap.add_argument("budget", nargs="?", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=10, help="steps profiled (after 40 timed)")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    model = random_llama(**MODELS[args.shape], device="cuda", dtype="bfloat16")
    layout = kv_layout_for(model.config, page_size=16, dtype=torch.bfloat16)
    engine = engine_for(model, layout, args.batch, args.context, 40 + 2 * args.steps, args.scope, args.budget)
    events = []
    for _ in range(40):
        engine.step()
        events.append(engine._last_event)
    torch.cuda.synchronize()
    tpot = [events[i - 1].elapsed_time(events[i]) for i in range(10, len(events))]  # ms, GPU timeline
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    per_kernel = defaultdict(lambda: [0, 0.0])  # name -> [launches, us]
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[ev.name][0] += 1
            per_kernel[ev.name][1] += ev.device_time
    kernels = sorted(((k, c / args.steps, t / args.steps) for k, (c, t) in per_kernel.items()), key=lambda x: -x[2])
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    pr.disable()
    host = sorted(((f"{fn[0].split('kvtier/')[-1]}:{fn[2]}", cum / args.steps * 1e3)
                   for fn, (_, _, _, cum, _) in pstats.Stats(pr).stats.items() if "/kvtier/" in fn[0]),
                  key=lambda x: -x[1])[:14]
    print(f"{args.shape} B={args.batch} S={args.context} {args.scope}@{args.budget:g}: TPOT p50 {np.median(tpot):.3f} "
          f"ms; {sum(k[1] for k in kernels):.0f} kernels, {sum(k[2] for k in kernels):.0f} us of kernels per step")
    for name, count, us in kernels[:args.top]:
        print(f"  {count:6.1f} x {us:8.1f} us  {name[:110]}")
    for name, ms in host:
        print(f"  host cum {ms:7.2f} ms  {name}")
    write_json(f"step_kernels-{args.shape}-{args.batch}-{args.scope}{args.budget:g}.json",
               {"gpu": torch.cuda.get_device_name(), "args": vars(args), "tpot_ms": tpot, "kernels": kernels,
                "host_cum_ms": host})


if __name__ == "__main__":
    main()
