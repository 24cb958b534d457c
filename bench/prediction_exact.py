"""Does prediction ahead change a bf16 decode? The engine of a :mod:`bench.e2e` row (random weights and K/V, topk
with its recall cache over pinned host memory) built twice, without a predictor and with one, both fed the first
one's greedy tokens; each step's logits compared, in three engine modes (eager; CUDA graphs; graphs and
torch.compile, the default). A prediction moves pages, never values: every row should read 0.

    python -m bench.prediction_exact [--shape smollm2-shape] [--batch 16] [--context 8192] [--steps 8]
                                     [--predictor after_attention]       (writes prediction_exact.json)
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.baselines import free_device_memory
from bench.common import MODELS, write_json
from bench.e2e import tiered_engine
from kvtier.models import random_llama

MODES = {"eager": dict(graphs=False, compile=False), "graphs": dict(compile=False), "graphs + compile": {}}


def compare(model, args, config: dict) -> dict:
    """Per step: the largest logit difference over the largest logit, and the rows whose greedy token differs."""
    plain, predicted = (tiered_engine(model, args.batch, args.context, args.steps + 8, args.budget, args.scope, 2,
                                      predictor=p, recall_share="rest", engine_settings=config)[0]
                        for p in (None, args.predictor))
    forced, rel, differ = None, [], []
    for _ in range(args.steps):
        a, b = (e.step(tokens=forced).float() for e in (plain, predicted))  # [B, V] each
        rel.append(((a - b).abs().max() / a.abs().max()).item())
        differ.append(int((a.argmax(-1) != b.argmax(-1)).sum()))
        forced = {s: int(t) for s, t in zip(plain.row_seq, a.argmax(-1).tolist()) if s is not None}
    row = {"max_rel_diff": max(rel), "rel_diff": rel, "argmax_differs": differ,
           "prefetched": int(predicted.recall.prefetched), "hit_rate": predicted.hit_rate()}
    plain.close()
    predicted.close()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smollm2-shape", choices=list(MODELS))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--scope", default="topk", choices=("topk", "quest"), help="the recall configuration, or Quest's pages")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--predictor", default="after_attention")
    args = ap.parse_args()
    model = random_llama(**MODELS[args.shape], device="cuda", dtype="bfloat16")
    rows = []
    for mode, config in MODES.items():
        t0 = time.time()
        rows.append({"mode": mode, **compare(model, args, config)})
        free_device_memory()
        r = rows[-1]
        print(f"{mode:18s} max rel logit diff {r['max_rel_diff']:.3g}, rows whose token differs a step "
              f"{r['argmax_differs']}, {r['prefetched']} pages fetched ahead ({time.time() - t0:.0f}s)", flush=True)
    write_json("prediction_exact.json", {"gpu": torch.cuda.get_device_name(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
