"""Page migration GB/s between pinned host DRAM and HBM, per method, vs the bulk pinned ceiling.

Methods: ``per_page`` (one cudaMemcpyAsync per page: the launch-bound baseline), ``staged``
(gather on the host into a pinned staging buffer, one bulk copy, scatter on the device),
``kernel`` (kvtier's one-launch Triton copy through mapped host pointers, no staging).
Run on a GPU:  python -m bench.transfers   (writes $OUT/transfers.json)
"""

from __future__ import annotations

import argparse

import torch

from bench.common import bench_ms, pinned_bulk_ceiling, print_table, write_json
from kvtier.mover.copy_kernel import copy_pages


def methods(host, dev, hs, ds, staging):
    """Callables moving pages host[hs] -> dev[ds] (h2d) and dev[ds] -> host[hs] (d2h)."""
    hs_dev, ds_dev = hs.cuda(), ds.cuda()
    n = hs.numel()

    def per_page_h2d():
        for a, b in zip(hs.tolist(), ds.tolist()):
            dev[b].copy_(host[a], non_blocking=True)

    def per_page_d2h():
        for a, b in zip(hs.tolist(), ds.tolist()):
            host[a].copy_(dev[b], non_blocking=True)

    def staged_h2d():
        torch.index_select(host, 0, hs, out=staging[:n])
        dev.index_copy_(0, ds_dev, staging[:n].to("cuda", non_blocking=True))

    def staged_d2h():
        staging[:n].copy_(dev.index_select(0, ds_dev), non_blocking=True)
        torch.cuda.current_stream().synchronize()
        host.index_copy_(0, hs, staging[:n])

    return {
        "per_page": (per_page_h2d, per_page_d2h),
        "staged": (staged_h2d, staged_d2h),
        "kernel": (lambda: copy_pages(host, hs_dev, dev, ds_dev), lambda: copy_pages(dev, ds_dev, host, hs_dev)),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    ceiling = pinned_bulk_ceiling()
    rows = []
    heads, dim = 8, 128
    for page_size in ([16] if args.quick else [16, 32, 64]):
        pool_pages = (2 << 30) // (2 * page_size * heads * dim * 2)  # 2 GiB pools
        host = torch.randn(pool_pages, 2, page_size, heads, dim, dtype=torch.bfloat16).pin_memory()
        dev = torch.empty_like(host, device="cuda")
        staging = torch.empty((4096, 2, page_size, heads, dim), dtype=torch.bfloat16).pin_memory()
        for n in [64, 256, 1024, 4096]:
            hs = torch.randperm(pool_pages)[:n]
            ds = torch.randperm(pool_pages)[:n]
            nbytes = n * host[0].numel() * 2
            for name, (h2d, d2h) in methods(host, dev, hs, ds, staging).items():
                h2d()
                ok = torch.equal(dev[ds.cuda()].cpu(), host[hs])
                t_h2d, t_d2h = bench_ms(h2d, rep=50), bench_ms(d2h, rep=50)
                rows.append({"page": page_size, "pages": n, "page_KiB": host[0].numel() * 2 / 1024, "method": name,
                             "h2d_ms": t_h2d, "h2d_GBps": nbytes / t_h2d / 1e6, "d2h_ms": t_d2h,
                             "d2h_GBps": nbytes / t_d2h / 1e6, "h2d_vs_bulk": nbytes / t_h2d / 1e6 / ceiling["h2d_GBps"],
                             "exact": ok})
        del host, dev, staging
    print_table(f"page migration, 8 kv heads D=128 bf16; bulk pinned ceiling h2d {ceiling['h2d_GBps']:.1f} GB/s "
                f"d2h {ceiling['d2h_GBps']:.1f} GB/s", rows,
                ["page", "pages", "page_KiB", "method", "h2d_ms", "h2d_GBps", "h2d_vs_bulk", "d2h_ms", "d2h_GBps", "exact"])
    write_json("transfers.json", {"gpu": torch.cuda.get_device_name(), "ceiling": ceiling, "rows": rows})


if __name__ == "__main__":
    main()
