"""End-to-end tiered decode on a GPU: TPOT, tier-1 hit rate, bytes moved, stall, hidden transfer time.

Models: a SmolLM2-shaped model (30 layers, 9/3 heads, D=64; random weights: the 98 MB GGUF does not
fit the device machine's 64 MiB carry) and a Llama-8B-shaped one (32 layers, 32/8 heads, D=128,
random weights) for realistic KV volume. The context's KV is written straight into the tiers
(random, as the weights are), then ``--steps`` decode steps run through the real cache, hook,
scheduler and kernels. Hidden fraction = 1 - (TPOT - TPOT at 100% HBM) / (bytes moved per step at
the measured copy rate), clipped to [0, 1].
Run on a GPU:  python -m bench.e2e [--quick]   (writes $OUT/e2e.json)
"""

from __future__ import annotations

import argparse
import itertools
import time

import numpy as np
import torch

from bench.common import MODELS, pinned_bulk_ceiling, print_table, write_json
from kvtier.cache import TieredKVCache
from kvtier.engine import Engine
from kvtier.hook import install
from kvtier.kernels.registry import make_backend
from kvtier.models import kv_layout_for, random_llama
from kvtier.paged_io import write_tokens
from kvtier.policies import ASPE, LRU, SinkWindow
from kvtier.scheduler import LookaheadScheduler
from kvtier.tiers import DeviceTier, HostTier

POLICIES = {"lru": lambda: LRU(), "sink_window": lambda: SinkWindow(sinks=4, window=256),
            "aspe": lambda: ASPE(sinks=4, window=256)}


def fill(cache: TieredKVCache, context: int) -> None:
    """Write ``context`` random tokens of K/V into the cache's pages, as a prefill would leave them, as step 0."""
    layout = cache.layout
    cache.table.append(0, context)
    for layer in range(layout.num_layers):
        kv = torch.randn(2, context, layout.num_kv_heads, layout.head_dim, device="cuda", dtype=layout.dtype)
        write_tokens(cache.table, layer, 0, kv, 0)
    pids = cache.table.pages(0)
    cache.policy.on_append(pids, 0)
    if cache.scope == "topk":
        cache._reset_key_bounds(pids)
        for layer in range(layout.num_layers):  # Quest bounds from the written keys
            tiers, slots = cache.table.locate(layer, pids)
            for t in np.unique(tiers):
                sel = np.flatnonzero(tiers == t)
                pages = cache.table.tiers[t].read(layer, torch.from_numpy(slots[sel])).cuda()[:, 0].float()
                idx = torch.from_numpy(pids[sel]).cuda()
                cache.key_min[layer, idx] = pages.amin(1)
                cache.key_max[layer, idx] = pages.amax(1)
    cache._start = context  # the filled context counts as step 0: the policy and scheduler act on it
    cache._open = True
    cache.finish_step()


def run_one(model, layout, context, budget, scope, policy, kernel, steps, lookahead):
    total_pages = layout.pages_for(context + steps + 16)
    dev_pages = max(int(total_pages * budget), 40)
    tiers = [DeviceTier(layout, dev_pages), HostTier(layout, total_pages + 64)]
    cache = TieredKVCache(layout, tiers, POLICIES[policy](), LookaheadScheduler(lookahead=lookahead),
                          backend=make_backend(kernel), scope=scope,
                          topk_pages=max(dev_pages // 2, 8) if scope == "topk" else None)
    fill(cache, context)
    engine = Engine(model)
    token = torch.randint(0, model.config.vocab_size, (1, 1), device="cuda")
    moved0 = sum(cache.transfer.bytes_moved.values()) + sum(cache.stats.fetched_bytes.values())
    for _ in range(steps):
        token = engine.decode_step(cache, token).argmax(-1, keepdim=True)
    cache.finish_step()
    torch.cuda.synchronize()
    moved = sum(cache.transfer.bytes_moved.values()) + sum(cache.stats.fetched_bytes.values()) - moved0
    tp = np.asarray(engine.tpot_s[2:])  # the first steps warm the kernels
    row = {"context": context, "budget": budget, "scope": scope, "policy": policy, "kernel": kernel,
           "tpot_p50_ms": float(np.percentile(tp, 50) * 1e3), "tpot_p99_ms": float(np.percentile(tp, 99) * 1e3),
           "hit_rate": cache.stats.tier1_hit_rate, "MB_moved_per_step": moved / steps / 1e6,
           "stall_ms_per_step": cache.stats.fetch_s / steps * 1e3,
           "offloaded": 1 - min(cache.table.occupancy()["device"]) / total_pages}
    cache.close()
    del cache, tiers
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--kernel", default="triton")
    ap.add_argument("--lookahead", type=int, default=2)
    ap.add_argument("--models", default="smollm2-shape,llama8b-shape")
    ap.add_argument("--contexts", default="8192,32768")
    args = ap.parse_args()
    install()
    ceiling = pinned_bulk_ceiling()
    rows = []
    for name in args.models.split(","):
        cfg = MODELS[name]
        model = random_llama(**cfg, device="cuda", dtype="bfloat16")
        model.set_attn_implementation("kvtier")
        layout = kv_layout_for(model.config, page_size=16, dtype=torch.bfloat16)
        contexts = [int(c) for c in args.contexts.split(",")]
        grid = [(c, 1.0, "all", "lru") for c in contexts]
        grid += [(c, b, s, p) for c, b, s, p in itertools.product(
            contexts, [0.5, 0.2], ["all", "topk"], ["sink_window", "aspe"] if args.quick else list(POLICIES))]
        base = {}
        for context, budget, scope, policy in grid:
            t0 = time.time()
            row = run_one(model, layout, context, budget, scope, policy, args.kernel, args.steps, args.lookahead)
            row["model"] = name
            if budget == 1.0:
                base[context] = row["tpot_p50_ms"]
            xfer_ms = row["MB_moved_per_step"] * 1e6 / (ceiling["h2d_GBps"] * 1e9) * 1e3
            slow = row["tpot_p50_ms"] - base.get(context, row["tpot_p50_ms"])
            row["tpot_vs_allhbm"] = row["tpot_p50_ms"] / base.get(context, row["tpot_p50_ms"])
            row["hidden"] = float(np.clip(1 - slow / xfer_ms, 0, 1)) if xfer_ms > 0 else 1.0
            print(f"{name} {row} ({time.time() - t0:.0f}s)", flush=True)
            rows.append(row)
        del model
        torch.cuda.empty_cache()
    print_table(f"tiered decode, B=1, bf16, kernel={args.kernel}, lookahead={args.lookahead}; "
                f"pinned h2d ceiling {ceiling['h2d_GBps']:.1f} GB/s", rows,
                ["model", "context", "budget", "scope", "policy", "tpot_p50_ms", "tpot_p99_ms", "tpot_vs_allhbm",
                 "hit_rate", "MB_moved_per_step", "stall_ms_per_step", "hidden", "offloaded"])
    write_json("e2e.json", {"gpu": torch.cuda.get_device_name(), "ceiling": ceiling, "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
