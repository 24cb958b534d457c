"""What one captured decode step launches: each CUDA kernel's count and time per step, and the host's hottest
kvtier functions, through :class:`kvtier.engine.Engine` (random weights, random K/V written into the pages: the
engine of a :mod:`bench.e2e` row, :func:`bench.e2e.tiered_engine`).

    python -m bench.step_kernels smollm2-shape 1 8192 [all 1.0 | topk 0.2 | resident 0.2]   (writes step_kernels-*.json)
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import numpy as np
import torch

from bench.common import MODELS, kernel_ms_by_kind, kernel_times, write_json
from bench.e2e import tiered_engine
from kvtier.models import random_llama


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
    engine, _ = tiered_engine(model, args.batch, args.context, 40 + 2 * args.steps, args.budget, args.scope, 2)
    events = []
    for _ in range(40):
        engine.step()
        events.append(engine.feedback.last_event)
    torch.cuda.synchronize()
    tpot = [events[i - 1].elapsed_time(events[i]) for i in range(10, len(events))]  # ms, GPU timeline
    kernels = kernel_times(engine.step, args.steps)
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
    print("  ms a step by kind:", {k: round(v, 3) for k, v in kernel_ms_by_kind(kernels).items()})
    for name, count, us in kernels[:args.top]:
        print(f"  {count:6.1f} x {us:8.1f} us  {name[:110]}")
    for name, ms in host:
        print(f"  host cum {ms:7.2f} ms  {name}")
    write_json(f"step_kernels-{args.shape}-{args.batch}-{args.scope}{args.budget:g}.json",
               {"gpu": torch.cuda.get_device_name(), "args": vars(args), "tpot_ms": tpot, "kernels": kernels,
                "host_cum_ms": host})


if __name__ == "__main__":
    main()
