"""Peak RSS vs context length: a long context streamed through device -> host -> disk tiers.

An engine without a model (default 8 layers, 4 kv heads, D=64, fp16: 8 KiB of KV per token) takes
one sequence's context in chunks, as prefill steps: each chunk's K/V is written, then its last token
(a one-token step) attends under ``resident`` scope with SinkWindow, and the scheduler demotes pages
down the tiers (device and host budgets small, disk holding the rest). RSS should track the configured
tier capacities, not the context; the engine's staging pool for disk pages is sized to the disk tier, so
``rss_after_alloc_MB`` grows with ``--tokens``.
Run (CPU):  python -m bench.memory --tokens 1048576   (writes bench/results/memory.json or $OUT/memory.json)
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time

import psutil
import torch

from bench.common import print_table, write_json
from kvtier import KVLayout
from kvtier.engine import Engine
from kvtier.policies import SinkWindow
from kvtier.tiers import DeviceTier, DiskTier, HostTier


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1 << 20)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--device-pages", type=int, default=512)
    ap.add_argument("--host-pages", type=int, default=2048)
    ap.add_argument("--dir", default=None, help="disk tier folder (default: a temporary one)")
    args = ap.parse_args()
    layout = KVLayout(num_layers=args.layers, num_kv_heads=4, head_dim=64, page_size=16, dtype="float16")
    disk_pages = layout.pages_for(args.tokens) + 64
    tmp = tempfile.TemporaryDirectory(dir=args.dir)
    rows = []
    base = rss_mb()
    t0 = time.time()
    tiers = [DeviceTier(layout, args.device_pages, device="cpu"), HostTier(layout, args.host_pages),
             DiskTier(layout, disk_pages, tmp.name)]
    engine = Engine(None, layout, tiers, SinkWindow(sinks=4, window=1024), "resident")
    seq = engine.open(args.tokens)
    after_alloc = rss_mb()
    gen = torch.Generator().manual_seed(0)
    q_heads = 8
    next_report = 1 << 16
    done = 0
    while done < args.tokens:
        n = min(args.chunk, args.tokens - done)
        k = [torch.randn(1, 4, n, 64, generator=gen).half() for _ in range(layout.num_layers)]
        for a, b in ((0, n - 1), (n - 1, n)):  # the chunk's K/V, then its last token attends
            if b > a:
                engine.begin_prefill([seq], b - a)
                for layer in range(layout.num_layers):
                    engine.store(layer, k[layer][:, :, a:b], k[layer][:, :, a:b])
                    if b == n:
                        engine.attend(layer, torch.randn(1, q_heads, 1, 64, generator=gen).half())
        done += n
        if done >= next_report or done == args.tokens:
            occ = engine.table.occupancy()
            rows.append({"tokens": done, "rss_MB": rss_mb(), "peak_rss_MB": resource.getrusage(
                resource.RUSAGE_SELF).ru_maxrss / 1024, "device_pages": max(occ["device"]),
                "host_pages": max(occ["host"]), "disk_pages": max(occ["disk"]),
                "kv_GB": done * layout.token_bytes / 1e9, "elapsed_s": time.time() - t0})
            print(rows[-1], flush=True)
            next_report *= 2
    engine.close()
    tmp.cleanup()
    capacity_mb = (args.device_pages + args.host_pages) * layout.page_bytes * layout.num_layers / 2**20
    print_table(f"peak RSS vs context (tier budgets: device {args.device_pages} + host {args.host_pages} pages/layer "
                f"= {capacity_mb:.0f} MB of pools; RSS before tiers {base:.0f} MB, after {after_alloc:.0f} MB)",
                rows, ["tokens", "kv_GB", "rss_MB", "peak_rss_MB", "device_pages", "host_pages", "disk_pages",
                       "elapsed_s"])
    write_json("memory.json", {"args": vars(args), "pool_MB": capacity_mb, "rss_before_MB": base,
                               "rss_after_alloc_MB": after_alloc, "rows": rows})


if __name__ == "__main__":
    main()
