"""Shared benchmark plumbing: output folder, ceilings measured in the same run, table printing."""

from __future__ import annotations

import json
import os
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
    """``$OUT/name`` on the device machine, else ``bench/name``."""
    root = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).parent
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
