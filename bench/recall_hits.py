"""Where recall reads its keys: the share of the attended keys that a step finds in HBM (the hit rate) in
:mod:`bench.e2e`'s recall rows (``0.2:topk``: 20% of the pages in HBM, half of them the recall cache, the rest in
host memory; each kv head's keys by the sketch, 20% of the context a step), on any device: the choice and the
recall cache run the same logic on the CPU's torch backend as under the GPU's Triton kernels.

Real SmolLM2 bf16, ``--batch`` prompts of ``--context`` tokens of Opticks prefilled exactly, then ``--warmup`` +
``--steps`` greedy steps; the hit rate of the last ``--steps``, per step and overall (keys of one kv head each), at
each HBM share of ``--budgets`` (the step attends 20% of the context whatever the share: what HBM the attended keys
need), the recall cache taking half the device pages or (``--recall-share rest``) all but what the rows pin.

    python -m bench.recall_hits --context 8192 --batch 1 --budgets 0.2,0.35,0.5 --steps 32     # recall_hits.json
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
    ap.add_argument("--budgets", default="0.2", help="shares of the pages in HBM, comma-separated")
    ap.add_argument("--recall-share", choices=("half", "rest"), default="half")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lookahead", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default="recall_hits.json")
    args = ap.parse_args()
    model, tokenizer = load_model(None, dtype="bfloat16", device=args.device)
    prompts = text_windows(tokenizer, args.batch, args.context)
    rows = []
    for budget in (float(b) for b in args.budgets.split(",")):
        engine, recipe = tiered_engine(model, args.batch, args.context, args.warmup + args.steps, budget, "topk",
                                       args.lookahead, prompts, recall_share=args.recall_share)
        per_step = []
        for i in range(args.warmup + args.steps):
            engine.buffers.counts.zero_()
            engine.step()
            attended, on_device = engine.buffers.counts.tolist()
            if i >= args.warmup:
                per_step.append(on_device / attended)
        kv = engine.layout.token_bytes
        rows.append({"device": str(engine.device), "context": args.context, "batch": args.batch, "budget": budget,
                     "scope_recipe": recipe, "recall_share": args.recall_share,
                     "device_pages": engine.table.tiers[0].capacity, "recall_slots": engine.scope.recall_slots,
                     "sketch_bytes_per_token": engine.keys.bytes_per_token(), "kv_bytes_per_token": kv,
                     "hit_unit": "key", "hit_rate": sum(per_step) / len(per_step), "hit_rate_min": min(per_step),
                     "per_step": per_step})
        r = rows[-1]
        print(f"| {budget} | {r['device_pages']} | {r['recall_slots']} | {r['sketch_bytes_per_token'] / kv:.3f} | "
              f"{r['hit_rate']:.3f} | {r['hit_rate_min']:.3f} |")
        engine.close()
    write_json(args.json, rows)

if __name__ == "__main__":
    main()
