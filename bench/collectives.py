"""NCCL all-reduce within one host: time per call against message size, and the alpha-beta line the simulator uses.

One process per GPU (``torch.multiprocessing.spawn``, NCCL, NVLink multicast off). For each message size (bf16,
2 KiB to 256 MiB) rank 0 times ``--iters`` back-to-back ``all_reduce`` calls between two synchronisations (after
``--warmup`` untimed ones), ``--repeats`` times; a size's time is the median of its repeats. The line fitted over
the sizes (least squares on relative error), per GPU count:

    t = latency + 2 (p - 1) / p x bytes / bus rate      (a ring all-reduce over p GPUs, NCCL's bus bandwidth)

gives ``latency_us`` and ``bus_GBps``, what :mod:`kvtier.sim.calibrate` reads (``kvtier.sim.hardware.allreduce_s``
is this formula). Rows: every size's time and its bus rate.
Run on a host of >= 2 GPUs:  python -m bench.collectives   (writes $OUT/collectives.json; --gpus 2,8 to choose
the group sizes); ``--smoke`` checks the script on a CPU (gloo, two processes).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import print_table, write_json
from kvtier.loopback import free_port

SIZES = [2**k for k in range(11, 29, 1)]  # bytes: 2 KiB .. 256 MiB


def fit_line(rows: list[dict], gpus: int) -> dict:
    """latency (us) and bus rate (GB/s) of ``t = a + 2 (p - 1) / p x bytes / B`` over ``rows``, relative error."""
    y = np.array([r["us"] for r in rows])
    X = np.array([[1.0, 2 * (gpus - 1) / gpus * r["bytes"] / 1e3] for r in rows])  # us = a + kB x (us per kB)
    a, per_kB = np.linalg.lstsq(X / y[:, None], np.ones_like(y), rcond=None)[0]
    return {"latency_us": float(a), "bus_GBps": float(1 / per_kB) if per_kB > 0 else float("inf")}  # 1 kB/us = 1 GB/s


def worker(rank: int, world: int, port: int, args, queue) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (shared host)
    if args.smoke:
        dev, backend = torch.device("cpu"), "gloo"
    else:
        torch.cuda.set_device(rank)
        dev, backend = torch.device("cuda", rank), "nccl"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=None if args.smoke else dev)

    def sync():
        if not args.smoke:
            torch.cuda.synchronize()
        dist.barrier()
    rows = []
    for nbytes in SIZES[: 6 if args.smoke else None]:
        x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=dev)  # [bytes / 2]
        for _ in range(args.warmup):
            dist.all_reduce(x)
        runs = []
        for _ in range(args.repeats):
            sync()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                dist.all_reduce(x)
            sync()
            runs.append((time.perf_counter() - t0) / args.iters * 1e6)
        us = float(np.median(runs))
        rows.append({"gpus": world, "bytes": nbytes, "us": us, "spread": max(runs) / min(runs),
                     "bus_GBps": 2 * (world - 1) / world * nbytes / us / 1e3})
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", default="", help="group sizes, comma-separated (default: 2 and every GPU of the host)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="CPU check of this script: gloo, 2 processes, small sizes")
    args = ap.parse_args()
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    have = 2 if args.smoke else torch.cuda.device_count()
    groups = sorted({int(g) for g in args.gpus.split(",") if g} or {2, have})
    if args.smoke:
        groups, args.iters, args.warmup, args.repeats = [2], 3, 1, 2
    if have < max(groups) or min(groups) < 2:
        raise SystemExit(f"bench.collectives needs groups of 2..{have} GPUs on this host, got {groups}")
    ctx = mp.get_context("spawn")
    out = {"device": "cpu (gloo smoke)" if args.smoke else torch.cuda.get_device_name(0), "args": vars(args),
           "rows": [], "fits": []}
    for world in groups:
        queue = ctx.SimpleQueue()
        mp.start_processes(worker, args=(world, free_port(), args, queue), nprocs=world, start_method="spawn")
        rows = queue.get()
        out["rows"] += rows
        out["fits"].append({"gpus": world, **fit_line(rows, world)})
    print_table("NCCL all-reduce (bf16)", out["rows"], ["gpus", "bytes", "us", "bus_GBps", "spread"])
    print_table("alpha-beta fit", out["fits"], ["gpus", "latency_us", "bus_GBps"])
    print(f"wrote {write_json('collectives.json', out)}")


if __name__ == "__main__":
    main()
