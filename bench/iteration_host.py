"""Host time of a serving iteration's bookkeeping (no model, no GPU): the engine's plan of an iteration with 16 decode
rows and a 256-token prompt chunk at the Llama-8B layer count, the plan of a cold 8k-token prompt in one chunk, and
the free of a finished 8k-token sequence.

Each runs before the GPU work of an iteration can start (the serve scheduler waits for each iteration's tokens), so
they add to the iteration time in full.

    PYTHONPATH=. python3 -m bench.iteration_host        # table + bench/results/iteration_host.json, ~10 s on a CPU
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from bench.common import print_table, write_json
from kvtier.engine import Engine, EngineConfig
from kvtier.layout import KVLayout
from kvtier.policies import LRU
from kvtier.tiers import DeviceTier

LAYERS, PAGE, ROWS, CONTEXT, PROMPT, CHUNK = 32, 16, 16, 2048, 8192, 256


def engine() -> Engine:
    """An engine of Llama-8B's layer count over tiny pages (the bookkeeping does not depend on the page bytes)."""
    layout = KVLayout(num_layers=LAYERS, num_kv_heads=1, head_dim=8, page_size=PAGE, dtype=torch.float32)
    pages = ROWS * (CONTEXT + 2 * PAGE) // PAGE + 2 * PROMPT // PAGE
    return Engine(None, layout, [DeviceTier(layout, pages, device="cpu")], LRU(), "all",
                  config=EngineConfig(max_batch=ROWS + 2, max_context=PROMPT + 64))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json", default="iteration_host.json")
    args = ap.parse_args()
    eng = engine()
    kv = lambda layer, a, b: torch.zeros(2, b - a, 1, 8)  # noqa: E731
    for _ in range(ROWS):
        eng.add_written(CONTEXT, kv)
    seq = eng.open(PROMPT)

    def plan(chunk_seq: int, tokens: int, decode: bool) -> float:
        """The host part of one iteration (the decode rows, if any, and one chunk), in ms."""
        t = time.perf_counter()
        eng.planner.begin([(chunk_seq, tokens)], decode=decode)
        took = (time.perf_counter() - t) * 1e3
        eng.callbacks.drop_step()
        eng.plan.mode = "idle"
        return took

    for _ in range(3):
        plan(seq, CHUNK, True)
    t = time.perf_counter()
    for _ in range(args.repeat):
        plan(seq, CHUNK, True)
    plan_ms = (time.perf_counter() - t) / args.repeat * 1e3
    colds = []
    for _ in range(3 + max(1, args.repeat // 4)):  # 3 warm-ups; a cold prompt: its pages allocated, its one chunk planned, then freed
        cold = eng.open(PROMPT + 1)
        colds.append(plan(cold, PROMPT + 1, False))
        eng.finish(cold)
        eng.reclaim()
    frees = []
    for _ in range(3):
        done = eng.add_written(PROMPT, kv)
        t = time.perf_counter()
        eng.finish(done)
        eng.reclaim()
        frees.append((time.perf_counter() - t) * 1e3)
    rows = [{"work": f"plan: {ROWS} decode rows + a {CHUNK}-token chunk, {LAYERS} layers", "ms": plan_ms},
            {"work": f"plan: a cold {PROMPT + 1}-token prompt in one chunk (its pages allocated)",
             "ms": float(np.median(colds[3:]))},
            {"work": f"free a finished {PROMPT}-token sequence ({PROMPT // PAGE} pages x {LAYERS} layers)",
             "ms": min(frees)}]
    print_table("serving iteration bookkeeping on the host (CPU)", rows, ["work", "ms"])
    write_json(args.json, {"rows": rows, "repeat": args.repeat})


if __name__ == "__main__":
    main()
