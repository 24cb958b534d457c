"""Hit rate of the engine's ``topk`` scope against lookahead and k, on the real SmolLM2.

A hit rate does not depend on the device, so this runs on the CPU (fp32, torch reference kernel):
an Opticks prompt is prefilled through :class:`kvtier.engine.Engine`, then greedy decode steps run
with a ``--budget`` share of the pages in the device tier and LRU fed by the picks. With recall slots
(``TopK(k, recall_slots=C)``) ``C`` of the budget's device pages are the recall cache; lookahead 0 feeds
the policy nothing (the picks go to the device-managed recall cache, not to the host), so those rows
keep the newest pages on the device (SinkWindow's recency order: LRU's with no access heard). There is
no promotion margin: the scope picks exactly ``k`` pages beside the sinks and the tail. A fourth field names a
predictor (``next_layer``, ``after_attention``: :mod:`kvtier.scopes.predict`): each layer's pages also fetched
into its recall slots before it runs; its accuracy is the share of the pages fetched ahead that the layer then
picked.
Run:  python -m bench.topk_hits [--context 2048] [--steps 32] [--grid 16:2:0,16:0:13,16:0:13:next_layer]
(writes topk_hits.json; each grid entry is topk_pages:lookahead:recall_slots[:predictor])
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import print_table, write_json
from kvtier.data import token_stream
from kvtier.engine import Engine, EngineConfig
from kvtier.models import kv_layout_for, load_model
from kvtier.policies import LRU, SinkWindow
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.scopes import TopK
from kvtier.tiers import DeviceTier, HostTier


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--grid", default="16:2:0,16:1:0,8:2:0,16:0:13,8:0:13,16:0:13:next_layer,8:0:13:next_layer,"
                    "16:0:13:after_attention,8:0:13:after_attention")
    args = ap.parse_args()
    model, tok = load_model()
    layout = kv_layout_for(model.config, page_size=16, dtype=torch.float32)
    prompt = token_stream(tok, "opticks", args.context)
    pages = layout.pages_for(args.context + args.steps + 8)
    rows = []
    for entry in args.grid.split(","):
        k, lookahead, recall, *predictor = entry.split(":")
        k, lookahead, recall, predictor = int(k), int(lookahead), int(recall), (predictor or [None])[0]
        t0 = time.time()
        tiers = [DeviceTier(layout, int(pages * args.budget), device="cpu"), HostTier(layout, pages + 64)]
        policy = LRU() if lookahead else SinkWindow(sinks=0, window=layout.page_size)
        engine = Engine(model, layout, tiers, policy, TopK(k, recall_slots=recall, predictor=predictor),
                        prefill=ChunkedPrefill(512),
                        config=EngineConfig(max_context=args.context + args.steps + 8, lookahead=lookahead))
        engine.add(prompt)
        for _ in range(args.steps):
            engine.step()
        attended, on_device = engine.counts.tolist()
        recalled = engine.recall
        ahead = int(recalled.prefetched) if recalled is not None else 0
        rows.append({"topk_pages": k, "lookahead": lookahead, "recall_slots": recall, "predictor": predictor or "-",
                     "hit_rate": on_device / attended if attended else 1.0,
                     "pages_moved": sum(engine.transfer.pages_moved.values())
                     + (int(recalled.copied) + ahead if recalled is not None else 0),
                     "fetched_ahead": ahead,
                     "predictor_accuracy": int(recalled.predicted) / ahead if ahead else None,
                     "seconds": time.time() - t0})
        engine.close()
        print(rows[-1], flush=True)
    print_table(f"topk hit rate, real SmolLM2 (CPU), {args.context}-token Opticks prompt, {args.steps} steps, "
                f"{args.budget:.0%} of {pages} pages on the device", rows,
                ["topk_pages", "lookahead", "recall_slots", "predictor", "hit_rate", "pages_moved", "fetched_ahead",
                 "predictor_accuracy"])
    write_json("topk_hits.json", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
