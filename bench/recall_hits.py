"""Where recall reads its keys: the share of the attended keys that a step finds in HBM (the hit rate) in
:mod:`bench.e2e`'s recall rows (``0.2:topk``: 20% of the pages in HBM, half of them the recall cache, the rest in
host memory; each kv head's keys by the sketch, 20% of the context a step), on any device: the choice and the
recall cache run the same logic on the CPU's torch backend as under the GPU's Triton kernels.

Real SmolLM2 bf16, ``--batch`` prompts of ``--context`` tokens of Opticks prefilled exactly, then ``--warmup`` +
``--steps`` greedy steps; the hit rate of the last ``--steps``, per step and overall (keys of one kv head each).

    python -m bench.recall_hits --context 8192 --batch 1 --budget 0.2 --steps 32     # recall_hits.json
"""

from __future__ import annotations

import argparse

import torch

from bench.common import write_json
from bench.e2e import text_windows, tiered_engine
from kvtier.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--budget", type=float, default=0.2, help="share of the pages in HBM")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lookahead", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default="recall_hits.json")
    args = ap.parse_args()
    model, tokenizer = load_model(None, dtype="bfloat16", device=args.device)
    prompts = text_windows(tokenizer, args.batch, args.context)
    engine, recipe = tiered_engine(model, args.batch, args.context, args.warmup + args.steps, args.budget, "topk",
                                   args.lookahead, prompts)
    per_step = []
    for i in range(args.warmup + args.steps):
        engine.buffers.counts.zero_()
        engine.step()
        attended, on_device = engine.buffers.counts.tolist()
        if i >= args.warmup:
            per_step.append(on_device / attended)
    row = {"device": str(engine.device), "context": args.context, "batch": args.batch, "budget": args.budget,
           "scope_recipe": recipe, "recall_slots": engine.scope.recall_slots, "hit_unit": "key",
           "hit_rate": sum(per_step) / len(per_step), "hit_rate_min": min(per_step), "per_step": per_step}
    write_json(args.json, row)
    print(f"{recipe}: hit rate {row['hit_rate']:.3f} (lowest step {row['hit_rate_min']:.3f}) over {args.steps} steps")


if __name__ == "__main__":
    main()
