"""Shared benchmark plumbing: output folder, ceilings measured in the same run, table printing."""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from pathlib import Path

import torch

# Random-weight model shapes of the GPU benches (kwargs of kvtier.models.random_llama).
MODELS = {
    "smollm2-shape": dict(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536,
                          vocab_size=49152),
    "llama8b-shape": dict(num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336,
                          vocab_size=32000),
}


def out_path(name: str) -> Path:
    """``$OUT/name`` on the device machine, else ``bench/results/name`` (the folder bench/RESULTS.md cites)."""
    root = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).parent / "results"
    root.mkdir(parents=True, exist_ok=True)
    return root / name


def bench_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn`` (CUDA events through triton.testing.do_bench)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def pinned_bulk_ceiling(nbytes: int = 256 << 20) -> dict:
    """One bulk pinned host<->device copy, GB/s each way (the link's ceiling)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d = bench_ms(lambda: dev.copy_(host, non_blocking=True))
    d2h = bench_ms(lambda: host.copy_(dev, non_blocking=True))
    return {"h2d_GBps": nbytes / h2d / 1e6, "d2h_GBps": nbytes / d2h / 1e6}


def print_table(title: str, rows: list[dict], cols: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for c in cols:
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(*[f"{r[c]:.3g}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols])
    Console(width=200).print(t)


def write_json(name: str, payload) -> Path:
    path = out_path(name)
    path.write_text(json.dumps(payload, indent=1, default=str))
    return path


# kinds of a decode step's kernels, by name (the first that matches; the rest is "other")
KERNEL_KINDS = {"matmul": r"nvjet|gemm|cutlass|xmma|cublas",
                "choice": r"_page_scores|_page_select|_key_bins|_key_emit",  # Quest's pages or the sketch's keys
                "attention": r"_static_split|_merge_splits|_prefill", "copy": r"[Mm]emcpy"}


def kernel_times(step, steps: int) -> list[tuple[str, float, float]]:
    """``step()`` run ``steps`` times under the torch profiler: ``(kernel name, launches a step, us a step)`` for
    every CUDA kernel and copy, slowest first."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per_kernel = defaultdict(lambda: [0, 0.0])  # name -> [launches, us]
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[ev.name][0] += 1
            per_kernel[ev.name][1] += ev.device_time
    return sorted(((k, c / steps, t / steps) for k, (c, t) in per_kernel.items()), key=lambda x: -x[2])


def kernel_ms_by_kind(kernels: list[tuple[str, float, float]]) -> dict[str, float]:
    """:func:`kernel_times`' rows summed by :data:`KERNEL_KINDS`: ms a step of each kind, ``total`` and
    ``launches``. The kinds overlap in time where streams run side by side (copies beside compute)."""
    out = dict.fromkeys([*KERNEL_KINDS, "other"], 0.0)
    for name, _, us in kernels:
        kind = next((k for k, pattern in KERNEL_KINDS.items() if re.search(pattern, name)), "other")
        out[kind] += us / 1e3
    return {**out, "total": sum(out.values()), "launches": sum(c for _, c, _ in kernels)}
