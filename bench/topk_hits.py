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

What limits a recall cache's hits: the rows with recall slots and no predictor also record every step's picks
(:class:`PickTrace`) and replay them through three caches of those picks that are not at home on the device:
the shipped rule (least recently picked, ``lru``: it gives the engine's hit rate), Belady's rule with the same
slots (``opt``: each step keeps the pages picked again soonest, knowing the future; no rule that caches only the
pages read does better), and a cache that never evicts (``unbounded``: only a page's first pick misses).
``--windows N`` splits the steps into N equal spans and reports the shipped rule's hit rate in each (the cache
starts empty after the prefill).
Run:  python -m bench.topk_hits [--context 2048] [--steps 32] [--grid 16:2:0,16:0:13,16:0:13:next_layer]
(writes topk_hits.json; each grid entry is topk_pages:lookahead:recall_slots[:predictor])
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np
import torch

from bench.common import print_table, write_json
from kvtier.data import token_stream
from kvtier.engine import Engine, EngineConfig
from kvtier.models import kv_layout_for, load_model
from kvtier.policies import LRU, SinkWindow
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.scopes import TopK
from kvtier.tiers import DeviceTier, HostTier


class PickTrace:
    """Every layer's picks per step, as the recall cache sees them: wraps ``engine.recall.admit``. Per layer a list
    over steps of (keys ``row * M + page`` of the picks not at home on the device, picks at home on the device)."""

    def __init__(self, engine: Engine):
        self.engine, self.admit = engine, engine.recall.admit
        self.steps: dict[int, list] = defaultdict(list)
        engine.recall.admit = self.record

    def record(self, layers: range, picks: torch.Tensor, table: torch.Tensor) -> None:
        L, B, M = table.shape
        lens = self.engine.buffers.seq_lens[:B].long()  # [B]
        n_pages = (lens + self.engine.layout.page_size - 1) // self.engine.layout.page_size
        slot_index = self.engine.recall.slot_index[layers.start:layers.stop]  # [L', cap]
        for i, layer in enumerate(layers):
            pick = picks[i].reshape(B, -1).long()  # [B, K]
            listed = (pick >= 0) & (pick < n_pages[:, None])
            loc = table[i].gather(1, pick.clamp(min=0)).long()  # [B, K] device slot, or -(host slot) - 1
            home = listed & (loc >= 0) & (slot_index[i].gather(0, loc.clamp(min=0).reshape(-1)).reshape(B, -1) < 0)
            keys = (torch.arange(B)[:, None] * M + pick)[listed & ~home]
            self.steps[layer].append((np.unique(keys.numpy()), int(home.sum())))
        self.admit(layers, picks, table)

    def hit_rates(self, slots: int, windows: int) -> dict:
        """The three caches' hit rates over every pick (home-device picks are hits), and ``lru`` per window."""
        hits = {"lru": 0, "opt": 0, "unbounded": 0}
        per_step_lru = np.zeros(len(self.steps[min(self.steps)]))
        attended = np.zeros_like(per_step_lru)
        for trace in self.steps.values():
            for name, step_hits in (("lru", _lru(trace, slots)), ("opt", _opt(trace, slots)),
                                    ("unbounded", _unbounded(trace))):
                home = np.array([h for _, h in trace])
                hits[name] += int((step_hits + home).sum())
                if name == "lru":
                    per_step_lru += step_hits + home
            attended += np.array([len(k) + h for k, h in trace])
        total = attended.sum()
        spans = np.array_split(np.arange(len(attended)), windows)
        return {**{f"{k}_hit_rate": float(v / total) for k, v in hits.items()},
                "lru_by_window": [float(per_step_lru[s].sum() / attended[s].sum()) for s in spans]}


def _lru(trace: list, slots: int) -> np.ndarray:
    """Hits per step of the shipped rule (:func:`kvtier.scopes.recall.plan_admission`): the step's misses, in page
    order, take the least recently picked slots (equal stamps: the lower slot), never one picked this step."""
    page = np.full(slots, -1, dtype=np.int64)  # [C] cached key, -1 empty
    stamp = np.full(slots, -1, dtype=np.int64)  # [C] step last picked
    hits = np.zeros(len(trace), dtype=np.int64)
    for t, (keys, _) in enumerate(trace):
        hit = np.isin(page, keys) & (page >= 0)
        stamp[hit] = t
        hits[t] = int(hit.sum())
        miss = keys[~np.isin(keys, page)]
        victims = np.argsort(stamp, kind="stable")[:len(miss)]
        victims = victims[stamp[victims] < t]  # the oldest come first: the rest were picked this step
        page[victims], stamp[victims] = miss[:len(victims)], t
    return hits


def _opt(trace: list, slots: int) -> np.ndarray:
    """Hits per step of Belady's rule (with bypass): after each step the cache keeps, of what it held and what the
    step picked, the ``slots`` pages picked again soonest."""
    uses: dict[int, list] = defaultdict(list)
    for t, (keys, _) in enumerate(trace):
        for k in keys:
            uses[k].append(t)
    cache: set = set()
    hits = np.zeros(len(trace), dtype=np.int64)
    for t, (keys, _) in enumerate(trace):
        hits[t] = sum(k in cache for k in keys)

        def next_use(k):
            later = [u for u in uses[k] if u > t]
            return later[0] if later else None

        ahead = [(u, k) for k in cache | set(keys.tolist()) if (u := next_use(k)) is not None]
        cache = {k for _, k in sorted(ahead)[:slots]}
    return hits


def _unbounded(trace: list) -> np.ndarray:
    """Hits per step of a cache that never evicts: only a page's first pick misses."""
    seen: set = set()
    hits = np.zeros(len(trace), dtype=np.int64)
    for t, (keys, _) in enumerate(trace):
        hits[t] = sum(k in seen for k in keys)
        seen.update(keys.tolist())
    return hits


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--windows", type=int, default=4, help="spans of steps for the shipped rule's hit rate")
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
        trace = PickTrace(engine) if recall and predictor is None else None
        engine.add(prompt)
        for _ in range(args.steps):
            engine.step()
        attended, on_device = engine.buffers.counts.tolist()
        recalled = engine.recall
        ahead = int(recalled.prefetched) if recalled is not None else 0
        rows.append({**(trace.hit_rates(recall, args.windows) if trace is not None else {}),
                     "topk_pages": k, "lookahead": lookahead, "recall_slots": recall, "predictor": predictor or "-",
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
                ["topk_pages", "lookahead", "recall_slots", "predictor", "hit_rate", "lru_hit_rate", "opt_hit_rate",
                 "unbounded_hit_rate", "pages_moved", "fetched_ahead", "predictor_accuracy"])
    write_json("topk_hits.json", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
