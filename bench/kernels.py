"""Paged attention kernels on one GPU: ceilings, correctness of every backend, decode/prefill timings.

    PYTHONPATH=. python bench/kernels.py [--quick] [--tune]     # from the repository root, on a GPU
    PYTHONPATH=. python bench/kernels.py --tune-only            # sections (1)-(3), FP8 tuning only
    PYTHONPATH=. python bench/kernels.py --choice-only          # sections (1), (2) and (6)
    PYTHONPATH=. python bench/kernels.py --smoke                # CPU: tiny shapes, Triton interpreter

Sections, in order: (1) the device's copy ceiling (device-to-device copy, read+write bytes) and
read ceiling (``x.sum()`` over 4 GiB), (2) every backend (torch reference, triton with page_max,
flashinfer when importable) against the reference on fresh random inputs, bf16/fp16 and FP8 pages,
(3) ``--tune`` only: sweeps of Triton launch configurations: FP8 decode (a handful, B=64 8k 32/8
D=128 and B=16 32k 9/3 D=64), page_max on/off and FP8 / bf16 speed there with the default configs
(also capped at 128 registers), then bf16 decode and chunked prefill (not with ``--tune-only``,
which ends here), (4) the
decode grid: B in 1, 8, 16, 64, 256 x context 1k, 8k, 32k, 128k x heads 32/8 D=128 and 9/3 D=64,
page 16, bf16 and FP8 pages (cells whose bf16 KV exceeds ``KV_LIMIT_BYTES`` are skipped and listed).
Each cell times Triton, Triton with page_max and FlashInfer with both ``use_tensor_cores`` settings
(the faster is the cell's anchor); FP8 cells give Triton kvtier's FP8 pages (per-page scales in a
scale row) and FlashInfer its own FP8 path (plain E4M3 pages, one k/v scale per call). (5) chunked
prefill chunk x prefix (32/8, D=128, causal), (6) Quest's fused page choice (``triton_page_choice``: one
launch per layer, checked against its torch oracle on each shape's random bounds, ties included) beside the
decode it feeds (k=64 picked pages of 16 tokens per row) and the torch choice, at B=1 x 512 and 8192
pages scored and B=16 x 512, both head shapes; its anchor is the fused choice / that decode at B=1 x 8192,
32/8 D=128. Times are ``triton.testing.do_bench`` medians (L2
flushed between runs). The decode table gives each cell's KV GB/s as a fraction of the measured
read ceiling, Triton / FlashInfer-best speed, page_max overhead and FP8 / bf16 speed. JSON goes to
``$OUT/kernels.json`` if ``OUT`` is set, else ``bench/results/kernels.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time

import torch

KV_LIMIT_BYTES = 40e9  # skip grid cells whose bf16 KV exceeds this (bf16 and FP8 pools share the GPU)
CHECK_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
DECODE_HEADS = [(32, 8, 128), (9, 3, 64)]  # (query heads, kv heads, head dim)
GRID_BATCHES = [1, 8, 16, 64, 256]
GRID_CONTEXTS = [1024, 8192, 32768, 131072]
PREFILL_HEADS = (32, 8, 128)
CHOICE_SHAPES = [(1, 512), (1, 8192), (16, 512)]  # (B, pages scored per row) of the page choice timings
CHOICE_K = 64  # pages picked per row


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sweep")
    ap.add_argument("--tune", action="store_true", help="also sweep Triton launch configurations")
    ap.add_argument("--tune-only", action="store_true",
                    help="ceilings, checks (torch and triton) and the FP8 decode / page_max tuning only: no "
                         "FlashInfer, bf16 and prefill sweeps, decode grid or prefill timings (a short GPU call)")
    ap.add_argument("--choice-only", action="store_true",
                    help="ceilings, checks (torch and triton) and section (6), the fused page choice, only")
    ap.add_argument("--smoke", action="store_true", help="CPU run of the whole script on tiny shapes (interpreter)")
    args = ap.parse_args()
    args.tune = args.tune or args.tune_only
    return args


ARGS = parse_args()
if ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # before any triton kernel is imported

import triton  # noqa: E402

from bench.common import write_json  # noqa: E402
from kvtier.kernels.base import PagedBatch  # noqa: E402
from kvtier.kernels.flashinfer import FlashInferBackend  # noqa: E402
from kvtier.kernels.reference import TorchBackend, page_choice_reference, paged_attention_reference  # noqa: E402
from kvtier.kernels.triton_decode import DecodeConfig, TritonBackend, default_decode_config  # noqa: E402
from kvtier.kernels.triton_page_choice import ChoiceWork, page_choice  # noqa: E402
from kvtier.kernels.triton_prefill import PrefillConfig  # noqa: E402
from kvtier.quant import FP8, INT8, channel_steps, dequantize, page_scales, quantize_pages  # noqa: E402

DEVICE = "cpu" if ARGS.smoke else "cuda"


def time_ms(fn) -> float:
    """Median milliseconds of ``fn()``: do_bench on the GPU (L2 flushed per run), a host clock on the CPU."""
    if DEVICE == "cuda":
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def graph_ms(fn) -> float:
    """Median milliseconds of one CUDA-graph replay of ``fn()``: device time without host launch gaps."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay)


def flashinfer_or_none():
    """A FlashInfer backend, or None (with the reason printed) when it cannot be built here."""
    if DEVICE != "cuda":
        return None
    try:
        return FlashInferBackend()
    except ImportError as err:
        print(f"flashinfer unavailable: {err}", flush=True)
        return None


def measure_ceilings(gib: float) -> dict:
    """Device-to-device copy (read+write bytes) and read-only ``x.sum()`` GB/s over ``gib`` GiB of bf16."""
    n = int(gib * 2**30) // 2
    src = torch.randn(n, dtype=torch.bfloat16, device=DEVICE)  # [n]
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src))
    read_ms = time_ms(lambda: src.sum())
    nbytes = src.numel() * src.element_size()
    del src, dst
    return {"bytes": nbytes, "copy_ms": copy_ms, "copy_gbps": 2 * nbytes / copy_ms / 1e6,
            "read_ms": read_ms, "read_gbps": nbytes / read_ms / 1e6}


def paged_problem(kv_lens, q_lens, heads, page, dtype, causal, buffer=None):
    """Fresh random q ``[Nq, H, D]``, a pool ``[nnz, 2, page, N_kv, D]`` (a view of ``buffer`` if given)
    whose slots the sequences list in random order, and the batch."""
    n_qo, n_kv, dim = heads
    npages = [-(-n // page) for n in kv_lens]
    nnz = sum(npages)
    numel = nnz * 2 * page * n_kv * dim
    if buffer is None:
        pool = torch.randn(nnz, 2, page, n_kv, dim, dtype=dtype, device=DEVICE)
    else:
        pool = buffer[:numel].view(nnz, 2, page, n_kv, dim)
    indices = torch.randperm(nnz, device=DEVICE).int()  # [nnz]
    last = [n - (p - 1) * page if p else 0 for n, p in zip(kv_lens, npages)]
    batch = PagedBatch(
        torch.tensor([0] + list(q_lens), device=DEVICE).cumsum(0).int(),
        torch.tensor([0] + npages, device=DEVICE).cumsum(0).int(),
        indices, torch.tensor(last, device=DEVICE).int(), page, causal)
    q = torch.randn(sum(q_lens), n_qo, dim, dtype=dtype, device=DEVICE)
    return q, pool, batch


def rel_err(x, ref) -> float:
    x, ref = x.double(), ref.double()
    if torch.isnan(x).any():
        return math.inf
    return ((x - ref).norm() / ref.norm()).item()


def lse_err(lse, ref) -> float:
    fin = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(lse), fin):
        return math.inf
    return (lse[fin] - ref[fin]).abs().max().item() if fin.any() else 0.0


def poison_allocator():
    """Leave NaN in the caching allocator's free blocks, so an unwritten output element shows."""
    junk = torch.full((64 << 20,), math.nan, dtype=torch.float32, device=DEVICE)
    del junk


def check_backends(backends: dict, small: bool) -> list:
    """Every backend vs the fp32 reference on fresh random varlen decode and causal prefill batches."""
    gen_lens = torch.Generator().manual_seed(int(time.time()))
    cases = []
    for dtype, heads in itertools.product([torch.bfloat16, torch.float16], DECODE_HEADS):
        top = 200 if small else 3000
        lens = torch.randint(1, top, (5,), generator=gen_lens).tolist()
        cases.append(("decode", dtype, heads, lens, [1] * 5, False))
    cases.append(("decode_head_mask", torch.bfloat16, DECODE_HEADS[0], lens, [1] * 5, False))  # per-head pages
    if not small:  # many short sequences: one split each, the split kernel writes the output directly
        lens = torch.randint(1, 1200, (160,), generator=gen_lens).tolist()
        cases.append(("decode", torch.bfloat16, DECODE_HEADS[0], lens, [1] * 160, False))
    for dtype in [torch.bfloat16, torch.float16]:
        q_lens = [40, 17] if small else [300, 77]
        prefix = [70, 0] if small else [1000, 0]
        cases.append(("prefill", dtype, PREFILL_HEADS, [p + n for p, n in zip(prefix, q_lens)], q_lens, True))
    for heads in DECODE_HEADS:  # FP8 pages (kvtier's per-page scales): triton and torch only
        lens = torch.randint(1, 200 if small else 3000, (5,), generator=gen_lens).tolist()
        cases.append(("decode", FP8, heads, lens, [1] * 5, False))
    cases.append(("prefill", FP8, PREFILL_HEADS, [110, 57] if small else [1300, 77],
                  [40, 17] if small else [300, 77], True))
    for heads in DECODE_HEADS:  # int8 pages (steps and means per channel): triton and torch only
        lens = torch.randint(1, 200 if small else 3000, (5,), generator=gen_lens).tolist()
        cases.append(("decode", INT8, heads, lens, [1] * 5, False))
    cases.append(("prefill", INT8, PREFILL_HEADS, [110, 57] if small else [1300, 77],
                  [40, 17] if small else [300, 77], True))
    if small:
        cases = [(k, d, (4, 2, 32), lens, ql, c) for k, d, _, lens, ql, c in cases]
    rows = []
    for kind, dtype, heads, kv_lens, q_lens, causal in cases:
        eight_bit = dtype in (FP8, INT8)
        q, pool, batch = paged_problem(kv_lens, q_lens, heads, 16, torch.bfloat16 if eight_bit else dtype, causal)
        if eight_bit:  # random pages with scales from 2^-4 to 2^4 (int8: channel offsets too), then quantized
            spread = torch.exp2(torch.randint(-4, 5, (pool.shape[0], 2, 1, heads[1], 1), device=DEVICE).float())
            offsets = torch.randn(heads[1:], device=DEVICE) * 10 * (dtype == INT8)  # [N_kv, D]
            pool = quantize_pages((torch.randn(pool.shape, device=DEVICE) + offsets) * spread, dtype)
        if kind == "decode_head_mask":  # each kv head sees about half of the pages, every last page
            batch.head_mask = torch.rand(batch.kv_indices.numel(), heads[1], device=DEVICE) < 0.5
            batch.head_mask[batch.kv_indptr[1:].long() - 1] = True
        scale = heads[2] ** -0.5
        # int8 pages: the kernel's tl.dot meets 16-bit queries with the dequantized pages rounded to the query's dtype
        # (as tests/test_int8_pages.py's oracle); FP8 values times their scale are exact in the oracle's fp32
        operands = dequantize(pool, 16).to(q.dtype).float() if dtype == INT8 and DEVICE == "cuda" else pool
        ref = paged_attention_reference(q, operands, batch, scale, return_page_max=True)
        for name, backend in backends.items():
            if eight_bit and name == "flashinfer":
                continue  # FlashInfer's FP8 path takes one scale per call: timed on its own pages below
            if batch.head_mask is not None and not backend.can.head_lists:
                continue
            salience = backend.can.page_stats
            try:
                backend.plan(batch, heads[0], heads[1], heads[2])
                poison_allocator()
                res = backend.run(q, pool, return_page_max=salience)
            except Exception as err:  # report, and check the other backends
                print(f"check {kind} {dtype} {heads} {name}: {type(err).__name__}: {str(err)[:300]}", flush=True)
                rows.append({"kind": kind, "dtype": str(dtype), "backend": name, "ok": False, "out_rel_err": math.inf,
                             "error": f"{type(err).__name__}: {err}"})
                continue
            err = rel_err(res.out, ref.out)
            row = {"kind": kind, "dtype": str(dtype).removeprefix("torch."), "heads": heads, "kv_lens": kv_lens,
                   "q_lens": q_lens, "backend": name, "out_rel_err": err, "lse_max_abs_err": lse_err(res.lse, ref.lse),
                   "page_max_max_abs_err": lse_err(res.page_max, ref.page_max) if salience else None}
            tol = CHECK_TOL[q.dtype]
            row["ok"] = err <= tol and row["lse_max_abs_err"] <= 20 * tol and (
                not salience or row["page_max_max_abs_err"] <= 20 * tol)
            rows.append(row)
            print(f"check {kind:7s} {row['dtype']:8s} {heads} {name:10s} out {err:.2e} "
                  f"lse {row['lse_max_abs_err']:.2e} page_max {row['page_max_max_abs_err']} "
                  f"{'ok' if row['ok'] else 'FAIL'}", flush=True)
    return rows


def page_rows(heads, batch_size, ctx) -> int:
    """Page rows x N_kv x D of a decode cell's pool (16-token pages)."""
    return batch_size * -(-ctx // 16) * heads[1] * heads[2] * 2


def kv_bytes(batch_size, ctx, heads, dtype) -> float:
    return batch_size * ctx * heads[1] * heads[2] * 2 * torch.finfo(dtype).bits / 8


def prefill_flops(chunk, prefix, heads) -> float:
    pairs = chunk * prefix + chunk * (chunk + 1) / 2  # causal (query, key) pairs
    return 4 * pairs * heads[0] * heads[2]


def decode_cells(quick: bool, smoke: bool) -> tuple[list, list]:
    """The decode grid's ``(heads, B, context)`` cells, and the cells skipped for size."""
    if smoke:
        return [(h, b, s) for h in [(4, 2, 32), (3, 1, 16)] for b, s in [(1, 64), (3, 200)]], []
    batches, ctxs = ([1, 8, 64], [1024, 8192]) if quick else (GRID_BATCHES, GRID_CONTEXTS)
    cells = list(itertools.product(DECODE_HEADS, batches, ctxs))
    fits = [c for c in cells if kv_bytes(c[1], c[2], c[0], torch.bfloat16) <= KV_LIMIT_BYTES]
    return fits, [c for c in cells if c not in fits]


def prefill_shapes(quick: bool, smoke: bool):
    if smoke:
        return [((4, 2, 32), 32, p) for p in [0, 48]]
    chunks, prefixes = ([2048], [0, 32768]) if quick else ([512, 2048], [0, 8192, 32768])
    return [(PREFILL_HEADS, c, p) for c in chunks for p in prefixes]


def timed_runs(kind, heads, shape_desc, q, pool, batch, backends, flops, nbytes, timings, graphs=False):
    """Time each backend on one problem (and its CUDA-graph replay if ``graphs``); append to ``timings``."""
    records = {}
    for name, (backend, page_max) in backends.items():
        try:
            backend.plan(batch, heads[0], heads[1], heads[2])
            ms = time_ms(lambda: backend.run(q, pool, return_page_max=page_max))
        except Exception as err:  # one failing backend must not end the sweep
            print(f"{kind} {shape_desc} {name}: {type(err).__name__}: {err}", flush=True)
            continue
        records[name] = {"kind": kind, "shape": shape_desc, "backend": name, "ms": ms,
                         "kv_gbps": nbytes / ms / 1e6, "tflops": flops / ms / 1e9 if flops else None, "graph_ms": None}
        if graphs and DEVICE == "cuda" and name != "torch":
            try:
                records[name]["graph_ms"] = graph_ms(lambda: backend.run(q, pool, return_page_max=page_max))
            except Exception as err:
                print(f"{kind} {shape_desc} {name} graph: {type(err).__name__}: {str(err)[:200]}", flush=True)
        print(f"{kind} {shape_desc} {name}: {ms:.4f} ms (graph {records[name]['graph_ms']})", flush=True)
    fi = records.get("flashinfer")
    for rec in records.values():
        rec["speedup_vs_flashinfer"] = fi["ms"] / rec["ms"] if fi else None
        timings.append(rec)


class FlashInferDecode:
    """FlashInfer's paged decode with one ``use_tensor_cores`` setting, bf16 queries; FP8 through FlashInfer's
    own FP8 path (plain E4M3 pages ``[slots, 2, P, N_kv, D]``, one k/v scale per call)."""

    def __init__(self, workspace: torch.Tensor, tensor_cores: bool):
        import flashinfer

        self.tensor_cores = tensor_cores
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tensor_cores)

    def plan(self, batch: PagedBatch, heads, kv_dtype: torch.dtype) -> None:
        self.kv_dtype = kv_dtype
        self.wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, *heads, batch.page_size,
                          q_data_type=torch.bfloat16, kv_data_type=kv_dtype)

    def run(self, q, pool):
        if self.kv_dtype == FP8:
            return self.wrapper.run(q, pool, k_scale=1.0 / 64, v_scale=1.0 / 64)
        return self.wrapper.run(q, pool)


def fp8_pools(buffer: torch.Tensor, nnz: int, heads) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the E4M3 ``buffer``: kvtier's pool ``[nnz, 2, 17, N_kv, D]`` (scale row set to 2^-6) and
    FlashInfer's plain pool ``[nnz, 2, 16, N_kv, D]``."""
    _, n_kv, dim = heads
    ours = buffer[:nnz * 2 * 17 * n_kv * dim].view(nnz, 2, 17, n_kv, dim)
    page_scales(ours, 16).fill_(1.0 / 64)
    return ours, buffer[:nnz * 2 * 16 * n_kv * dim].view(nnz, 2, 16, n_kv, dim)


def int8_pool(buffer: torch.Tensor, nnz: int, heads) -> torch.Tensor:
    """A view of the int8 ``buffer`` as kvtier's int8 pool ``[nnz, 2, 19, N_kv, D]``: steps 2^-6, means 0."""
    _, n_kv, dim = heads
    pool = buffer[:nnz * 2 * 19 * n_kv * dim].view(nnz, 2, 19, n_kv, dim)
    channel_steps(pool, 16).fill_(-24)
    pool[:, :, 17:].zero_()
    return pool


def timed(fn, graphs: bool, into: dict, name: str) -> float:
    """``time_ms(fn)``; with ``graphs`` also one CUDA-graph replay's time into ``into[name]`` (no host launch gaps)."""
    ms = time_ms(fn)
    if graphs:
        try:
            into[name] = graph_ms(fn)
        except Exception as err:
            print(f"graph {name}: {type(err).__name__}: {str(err)[:200]}", flush=True)
    return ms


def decode_grid(buffers: dict, fi_decoders: list, cells: list, rows: list, save) -> None:
    """Every cell, bf16 and FP8 pages: Triton, Triton with page_max, each FlashInfer setting (saved per cell).

    Cells under 1 GB of KV are also timed as CUDA-graph replays: at small shapes the event timing is the
    host's launch time, the replay the device's."""
    for heads, b, s in cells:
        q, pool_bf16, batch = paged_problem([s] * b, [1] * b, heads, 16, torch.bfloat16, False, buffers["bf16"])
        ours_fp8, fi_fp8 = fp8_pools(buffers["fp8"], pool_bf16.shape[0], heads)
        for kv, ours, theirs, dtype in (("bf16", pool_bf16, pool_bf16, torch.bfloat16), ("fp8", ours_fp8, fi_fp8, FP8)):
            row = {"heads": heads, "B": b, "context": s, "kv": kv, "kv_bytes": kv_bytes(b, s, heads, dtype),
                   "graph_ms": {}}
            graphs = DEVICE == "cuda" and row["kv_bytes"] < 1e9
            triton_backend = TritonBackend()
            triton_backend.plan(batch, *heads)
            row["triton_ms"] = timed(lambda: triton_backend.run(q, ours), graphs, row["graph_ms"], "triton")
            row["triton_page_max_ms"] = timed(lambda: triton_backend.run(q, ours, return_page_max=True), graphs,
                                              row["graph_ms"], "triton_page_max")
            row["flashinfer_ms"] = {}
            for dec in fi_decoders:
                name = "tc" if dec.tensor_cores else "plain"
                try:
                    dec.plan(batch, heads, dtype)
                    row["flashinfer_ms"][name] = timed(lambda: dec.run(q, theirs), graphs, row["graph_ms"], name)
                except Exception as err:  # a setting FlashInfer lacks for this dtype: reported, not fatal
                    row["flashinfer_ms"][name] = None
                    row.setdefault("flashinfer_errors", {})[name] = f"{type(err).__name__}: {str(err)[:200]}"
            done = {k: v for k, v in row["flashinfer_ms"].items() if v is not None}
            row["flashinfer_best"] = min(done, key=done.get) if done else None
            row["flashinfer_best_ms"] = done[row["flashinfer_best"]] if done else None
            row["kv_gbps"] = row["kv_bytes"] / row["triton_ms"] / 1e6
            row["vs_flashinfer_best"] = row["flashinfer_best_ms"] / row["triton_ms"] if done else None
            row["page_max_overhead"] = row["triton_page_max_ms"] / row["triton_ms"] - 1
            g = row["graph_ms"]
            fi_graph = [g[k] for k in ("plain", "tc") if k in g]
            row["vs_flashinfer_best_graph"] = min(fi_graph) / g["triton"] if fi_graph and "triton" in g else None
            rows.append(row)
            print(f"decode {heads} B={b} S={s} {kv}: triton {row['triton_ms']:.4f} ms (+page_max "
                  f"{row['page_max_overhead']:+.1%}), flashinfer {row['flashinfer_ms']}", flush=True)
        save()


def sweep(buffer, fi, quick, smoke, timings: list, save) -> None:
    """Chunked prefill timings of every backend on bf16 problems cut from ``buffer`` (saved per shape), and
    Triton on FP8 pages."""
    for heads, chunk, prefix in prefill_shapes(quick, smoke):
        q, pool, batch = paged_problem([prefix + chunk], [chunk], heads, 16, torch.bfloat16, True, buffer)
        backends = {"triton": (TritonBackend(), False), "triton+page_max": (TritonBackend(), True)}
        if fi is not None:
            backends["flashinfer"] = (fi, False)
        desc = f"chunk={chunk} prefix={prefix} {heads[0]}/{heads[1]} D={heads[2]}"
        timed_runs("prefill", heads, desc, q, pool, batch, backends, prefill_flops(chunk, prefix, heads),
                   kv_bytes(1, prefix + chunk, heads, torch.bfloat16), timings)
        fp8 = quantize_pages(pool.float() / 8)  # [nnz, 2, 17, N_kv, D]
        timed_runs("prefill", heads, desc + " fp8", q, fp8, batch, {"triton": (TritonBackend(), False)},
                   prefill_flops(chunk, prefix, heads), kv_bytes(1, prefix + chunk, heads, FP8), timings)
        save()


def tune_cases(smoke: bool) -> dict:
    """The tuned shapes: bf16 decode and chunked prefill (``--tune``), FP8 decode (also ``--tune-only``)."""
    if smoke:
        return {"decode": [((4, 2, 32), 2, 128)], "fp8": [((4, 2, 32), 2, 128), ((3, 1, 16), 1, 200)],
                "prefill": [((4, 2, 32), 32, 32)]}
    return {"decode": [((32, 8, 128), 64, 8192), ((32, 8, 128), 1, 32768), ((32, 8, 128), 256, 8192),
                       ((9, 3, 64), 64, 32768)],
            "fp8": [((32, 8, 128), 64, 8192), ((9, 3, 64), 16, 32768)],
            "prefill": [(PREFILL_HEADS, 8192, 0), (PREFILL_HEADS, 2048, 0), (PREFILL_HEADS, 2048, 32768),
                        (PREFILL_HEADS, 1024, 8192), (PREFILL_HEADS, 512, 8192), (PREFILL_HEADS, 256, 8192),
                        (PREFILL_HEADS, 256, 2048)]}


def tune_grids(smoke: bool) -> dict:
    """Launch configurations per sweep: bf16 decode, FP8 decode (a handful), chunked prefill."""
    if smoke:
        return {"decode": [DecodeConfig(block_n=n, num_warps=2, num_stages=1) for n in (16, 32)],
                "fp8": [DecodeConfig(block_n=n, num_warps=2, num_stages=1) for n in (16, 32)],
                "prefill": [PrefillConfig(block_m=m, block_n=16, num_warps=2, num_stages=1) for m in (16, 32)]}
    return {
        "decode": [DecodeConfig(block_n=n, num_warps=w, num_stages=st, ctas_per_sm=c)
                   for n, w, st in [(64, 4, 3), (64, 4, 5), (64, 4, 7), (32, 4, 6), (32, 4, 7), (32, 2, 6),
                                    (64, 8, 5), (128, 8, 5), (128, 4, 5)]
                   for c in (2, 4, 8)],
        "fp8": [DecodeConfig(block_n=64), DecodeConfig(block_n=128), DecodeConfig(block_n=128, maxnreg=168),
                DecodeConfig(block_n=128, num_warps=8), DecodeConfig(block_n=128, num_stages=5, ctas_per_sm=2),
                DecodeConfig(block_n=256, num_stages=5, ctas_per_sm=2)],
        "prefill": [PrefillConfig(block_m=m, block_n=n, num_warps=w, num_stages=st)
                    for m, n, w, st in [(256, 64, 8, 3), (256, 64, 8, 4), (256, 128, 8, 2), (128, 64, 8, 3),
                                        (128, 64, 8, 5), (128, 64, 4, 5), (128, 128, 8, 3), (128, 32, 8, 5),
                                        (64, 64, 4, 5), (64, 128, 4, 4)]]
        + [PrefillConfig(block_m=m, block_n=64, num_warps=w, num_stages=5, kv_splits=k)
           for m, w in [(128, 8), (64, 4)] for k in (2, 4, 8)],  # a short chunk's keys split over programs
    }


def decode_problem(buffers: dict, heads, b, s, kv: str):
    """q ``[B, H, D]``, the pool (a view of ``buffers[kv]``; FP8, int8: kvtier's pages) and the batch of one
    decode cell."""
    q, pool, batch = paged_problem([s] * b, [1] * b, heads, 16, torch.bfloat16, False, buffers["bf16"])
    if kv == "fp8":
        pool = fp8_pools(buffers["fp8"], pool.shape[0], heads)[0]
    elif kv == "int8":
        pool = int8_pool(buffers["int8"], pool.shape[0], heads)
    return q, pool, batch


def time_decode(config, heads, q, pool, batch, page_max=False) -> float | None:
    """Milliseconds of Triton decode with ``config`` (None: the default), or None (printed) if it fails."""
    backend = TritonBackend(decode_config=config)
    try:
        backend.plan(batch, *heads)
        return time_ms(lambda: backend.run(q, pool, return_page_max=page_max))
    except Exception as err:
        print(f"tune decode {config}: {type(err).__name__}: {str(err)[:200]}", flush=True)
        return None


def tune_decode(buffers: dict, cases: list, grid: list, kv: str, top: int = 5) -> list:
    """Time every config of ``grid`` on each decode case with ``kv`` pages; print the ``top`` fastest of each."""
    results = []
    for heads, b, s in cases:
        q, pool, batch = decode_problem(buffers, heads, b, s, kv)
        rows = []
        for cfg in grid:
            ms = time_decode(cfg, heads, q, pool, batch)
            if ms is not None:
                rows.append({"kind": "decode", "kv": kv, "shape": f"B={b} S={s} {heads} {kv}", "config": vars(cfg),
                             "ms": ms, "kv_gbps": kv_bytes(b, s, heads, FP8 if kv == "fp8" else torch.bfloat16)
                             / ms / 1e6})
        report_tuning(rows, top)
        results += rows
    return results


def tune_page_max(buffers: dict, cases: list) -> list:
    """Triton decode with and without page_max, and FP8 and int8 over bf16 pages, on each case: the default config
    and the same with registers capped at 128 per thread (four programs of four warps per multiprocessor)."""
    results = []
    for heads, b, s in cases:
        ms = {}
        for kv in ("bf16", "fp8", "int8"):
            q, pool, batch = decode_problem(buffers, heads, b, s, kv)
            default = default_decode_config(heads[2], 2 if kv == "bf16" else 1)
            for cap in (None, 128):
                cfg = dataclasses.replace(default, maxnreg=cap)
                off, on = (time_decode(cfg, heads, q, pool, batch, page_max) for page_max in (False, True))
                ms[kv, cap] = off
                row = {"kind": "decode_page_max", "kv": kv, "shape": f"B={b} S={s} {heads} {kv}",
                       "config": vars(cfg), "ms": off, "page_max_ms": on,
                       "page_max_overhead": on / off - 1 if off and on else None}
                results.append(row)
                overhead = f"{row['page_max_overhead']:+.1%}" if row["page_max_overhead"] is not None else "-"
                print(f"tune page_max B={b} S={s} {heads} {kv} maxnreg={cap}: {off and round(off, 4)} ms, "
                      f"with page_max {on and round(on, 4)} ms ({overhead})", flush=True)
        for cap, kv in itertools.product((None, 128), ("fp8", "int8")):
            if ms["bf16", cap] and ms[kv, cap]:
                print(f"tune {kv} / bf16 speed B={b} S={s} {heads} maxnreg={cap}: "
                      f"{ms['bf16', cap] / ms[kv, cap]:.2f}x", flush=True)
    return results


def tune(buffers: dict, smoke: bool, fp8_only: bool) -> list:
    """Time Triton launch configurations on representative shapes and print the best five of each: FP8
    decode and page_max on/off; with ``fp8_only`` False also bf16 decode and chunked prefill."""
    cases, grids = tune_cases(smoke), tune_grids(smoke)
    results = tune_decode(buffers, cases["fp8"], grids["fp8"], "fp8", top=len(grids["fp8"]))
    results += tune_page_max(buffers, cases["fp8"])
    if fp8_only:
        return results
    results += tune_decode(buffers, cases["decode"], grids["decode"], "bf16")
    for heads, chunk, prefix in cases["prefill"]:
        q, pool, batch = paged_problem([prefix + chunk], [chunk], heads, 16, torch.bfloat16, True, buffers["bf16"])
        rows = []
        for cfg in grids["prefill"] + [None]:  # None: the default's pick
            backend = TritonBackend(prefill_config=cfg)
            try:
                backend.plan(batch, *heads)
                ms = time_ms(lambda: backend.run(q, pool))
            except Exception as err:
                print(f"tune prefill {cfg}: {type(err).__name__}: {str(err)[:200]}", flush=True)
                continue
            rows.append({"kind": "prefill", "shape": f"chunk={chunk} prefix={prefix} {heads}",
                         "config": vars(cfg or backend.prefill_plan.config) | {"default": cfg is None},
                         "ms": ms, "tflops": prefill_flops(chunk, prefix, heads) / ms / 1e9})
        report_tuning(rows)
        results += rows
    return results


def page_choice_timings(smoke: bool) -> list:
    """Quest's fused page choice vs its torch oracle (equal picks; every other pid shared, so ties occur) and
    timed beside the decode of the pages it picks (``CHOICE_K`` per row) and the torch choice."""
    rows = []
    shapes, heads_list, k = ([(1, 40), (3, 70)], [(4, 2, 32)], 4) if smoke else (CHOICE_SHAPES, DECODE_HEADS, CHOICE_K)
    for heads, (b, m) in itertools.product(heads_list, shapes):
        n_qo, n_kv, dim = heads
        kmin = torch.randn(b * m, n_kv, dim, device=DEVICE)  # [capacity, N_kv, D] one layer's key bounds
        kmax = kmin + torch.rand_like(kmin)
        pids = torch.randint(0, b * m // 2, (b, m), device=DEVICE, dtype=torch.int32)  # [B, M] shared pids: ties
        cand = torch.rand(b, m, device=DEVICE) < 0.9  # [B, M]
        q = torch.randn(b, n_qo, dim, dtype=torch.bfloat16, device=DEVICE)
        work = ChoiceWork.make(b, m, DEVICE)
        fused = lambda: page_choice(q, kmin, kmax, pids, cand, k, work=work)  # noqa: E731
        oracle = lambda: page_choice_reference(q, kmin, kmax, pids, cand, k)  # noqa: E731
        row = {"heads": heads, "B": b, "pages": m, "k": k, "ok": torch.equal(fused().long(), oracle().long()),
               "graph_ms": {}}
        graphs = DEVICE == "cuda"
        row["choice_ms"] = timed(fused, graphs, row["graph_ms"], "choice")
        row["choice_torch_ms"] = time_ms(oracle)
        dq, pool, batch = paged_problem([k * 16] * b, [1] * b, heads, 16, torch.bfloat16, False)
        decode = TritonBackend()
        decode.plan(batch, *heads)
        row["decode_ms"] = timed(lambda: decode.run(dq, pool), graphs, row["graph_ms"], "decode")
        row["choice_over_decode"] = row["choice_ms"] / row["decode_ms"]
        row["bounds_gbps"] = 2 * b * m * n_kv * dim * 4 / row["choice_ms"] / 1e6  # key min/max bytes read
        rows.append(row)
        print(f"page choice {heads} B={b} pages={m} k={k}: fused {row['choice_ms']:.4f} ms (graph "
              f"{row['graph_ms'].get('choice')}), torch {row['choice_torch_ms']:.4f} ms, decode of the picks "
              f"{row['decode_ms']:.4f} ms, bounds {row['bounds_gbps']:.0f} GB/s, {'ok' if row['ok'] else 'FAIL'}",
              flush=True)
    return rows


def report_tuning(rows, top: int = 5):
    for r in sorted(rows, key=lambda r: r["ms"])[:top]:
        print(f"tune {r['kind']} {r['shape']}: {r['ms']:.4f} ms {r['config']}", flush=True)


def print_table(timings, ceilings):
    read = ceilings["read_gbps"]
    print(f"\nceilings: copy {ceilings['copy_gbps']:.0f} GB/s (read+write), read {read:.0f} GB/s")
    head = f"{'kind':8s} {'shape':36s} {'backend':16s} {'ms':>9s} {'graph ms':>9s} {'KV GB/s':>8s} " \
           f"{'TFLOP/s':>8s} {'vs FI':>6s} {'of read':>7s}"
    print(head)
    print("-" * len(head))
    for r in timings:
        tf = f"{r['tflops']:.0f}" if r["tflops"] else "-"
        vs = f"{r['speedup_vs_flashinfer']:.2f}" if r["speedup_vs_flashinfer"] else "-"
        graph = f"{r['graph_ms']:.4f}" if r.get("graph_ms") else "-"
        print(f"{r['kind']:8s} {r['shape']:36s} {r['backend']:16s} {r['ms']:9.4f} {graph:>9s} {r['kv_gbps']:8.0f} "
              f"{tf:>8s} {vs:>6s} {r['kv_gbps'] / read:7.2f}")


def print_grid(rows, skipped, ceilings) -> dict:
    """The decode grid table, and the targets' figures (also returned)."""
    read = ceilings["read_gbps"]
    print(f"\ndecode grid, page 16, bf16 queries; FI best = the faster FlashInfer setting (tc: use_tensor_cores=True); "
          f"of read = KV bytes / time / the measured read ceiling ({read:.0f} GB/s)")
    print("| heads q/kv D | B | context | kv | triton ms | FI best ms | triton / FI | same, graphs | of read | page_max "
          "| fp8 / bf16 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    bf16 = {(tuple(r["heads"]), r["B"], r["context"]): r for r in rows if r["kv"] == "bf16"}
    for r in rows:
        fi = f"{r['flashinfer_best_ms']:.4f} ({r['flashinfer_best']})" if r["flashinfer_best"] else "-"
        vs = f"{r['vs_flashinfer_best']:.2f}x" if r["vs_flashinfer_best"] else "-"
        vs_graph = f"{r['vs_flashinfer_best_graph']:.2f}x" if r.get("vs_flashinfer_best_graph") else "-"
        base = bf16.get((tuple(r["heads"]), r["B"], r["context"]))
        speed = f"{base['triton_ms'] / r['triton_ms']:.2f}x" if r["kv"] == "fp8" and base else ""
        h = r["heads"]
        print(f"| {h[0]}/{h[1]} {h[2]} | {r['B']} | {r['context']} | {r['kv']} | {r['triton_ms']:.4f} | {fi} | {vs} | {vs_graph} "
              f"| {r['kv_gbps'] / read:.2f} | {r['page_max_overhead']:+.1%} | {speed} |")
    for h, b, s in skipped:
        print(f"| {h[0]}/{h[1]} {h[2]} | {b} | {s} | skipped: {kv_bytes(b, s, h, torch.bfloat16) / 1e9:.0f} GB of bf16 KV "
              f"> {KV_LIMIT_BYTES / 1e9:.0f} GB | | | | | | | |")
    vs = [r for r in rows if r["vs_flashinfer_best"]]
    anchor = [r for r in rows if tuple(r["heads"]) == (32, 8, 128) and r["B"] == 64 and r["context"] == 8192]
    targets = {
        "min_vs_flashinfer_best": {kv: min((r["vs_flashinfer_best"] for r in vs if r["kv"] == kv), default=None)
                                   for kv in ("bf16", "fp8")},
        "cells_below_0.95": [(r["heads"], r["B"], r["context"], r["kv"], round(r["vs_flashinfer_best"], 3),
                              r.get("vs_flashinfer_best_graph")) for r in vs if r["vs_flashinfer_best"] < 0.95],
        "fp8_over_bf16_B64_8k_32_8": (anchor[0]["triton_ms"] / anchor[1]["triton_ms"]) if len(anchor) == 2 else None,
        "max_page_max_overhead": max(r["page_max_overhead"] for r in rows),
        "cells_page_max_over_5pct": [(r["heads"], r["B"], r["context"], r["kv"], round(r["page_max_overhead"], 3))
                                     for r in rows if r["page_max_overhead"] > 0.05],
    }
    print("\ntargets:", json.dumps(targets, default=str))
    return targets


def main():
    env = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "argv": sys.argv[1:]}
    print(env, flush=True)
    result = {"env": env}

    def save():
        write_json("kernels.json", result)

    result["ceilings"] = measure_ceilings(0.01 if ARGS.smoke else 4.0)
    print("ceilings", result["ceilings"], flush=True)
    fi = None if ARGS.tune_only or ARGS.choice_only else flashinfer_or_none()  # (its first calls may compile)
    backends = {"torch": TorchBackend(), "triton": TritonBackend()}
    if fi is not None:
        backends["flashinfer"] = fi
    result["checks"] = check_backends(backends, small=ARGS.smoke)
    save()
    if ARGS.choice_only:
        result["page_choice"] = page_choice_timings(ARGS.smoke)
        save()
        report_checks(result["checks"] + choice_checks(result["page_choice"]))
        return
    tuned = tune_cases(ARGS.smoke) if ARGS.tune else {}
    cells, skipped = ([], []) if ARGS.tune_only else decode_cells(ARGS.quick, ARGS.smoke)
    fp8_cells = cells + tuned.get("fp8", [])
    bf16_cells = fp8_cells + ([] if ARGS.tune_only else tuned.get("decode", []))
    prefills = [] if ARGS.tune_only else prefill_shapes(ARGS.quick, ARGS.smoke) + tuned.get("prefill", [])
    pooled = [page_rows(*c) * 16 for c in bf16_cells] + [-(-(c + p) // 16) * 16 * h[1] * h[2] * 2
                                                         for h, c, p in prefills]
    buffer = torch.randn(max(pooled), dtype=torch.bfloat16, device=DEVICE)  # every bf16 pool is a view of this
    fp8 = torch.empty(max(page_rows(*c) for c in fp8_cells) * 17, dtype=torch.uint8,
                      device=DEVICE).random_(0, 0x7E).view(FP8)  # finite E4M3; every FP8 pool is a view of this
    buffers = {"bf16": buffer, "fp8": fp8}
    if ARGS.tune:  # int8 pools (for tune_page_max) are views of this
        rows = max(page_rows(*c) for c in tuned.get("fp8", [])) * 19
        buffers["int8"] = torch.empty(rows, dtype=INT8, device=DEVICE).random_(-127, 128)
    if ARGS.tune:
        result["tuning"] = tune(buffers, ARGS.smoke, fp8_only=ARGS.tune_only)
        save()
    if ARGS.tune_only:
        report_checks(result["checks"])
        return
    decoders = [FlashInferDecode(fi.workspace, tc) for tc in (False, True)] if fi is not None else []
    result["decode_grid"], result["skipped_cells"] = [], skipped
    decode_grid(buffers, decoders, cells, result["decode_grid"], save)
    del fp8, buffers
    result["timings"] = []
    sweep(buffer, fi, ARGS.quick, ARGS.smoke, result["timings"], save)
    print_table(result["timings"], result["ceilings"])
    result["page_choice"] = page_choice_timings(ARGS.smoke)
    result["checks"] += choice_checks(result["page_choice"])
    save()
    result["targets"] = print_grid(result["decode_grid"], skipped, result["ceilings"])
    anchor = [r for r in result["page_choice"] if (tuple(r["heads"]), r["B"], r["pages"]) == ((32, 8, 128), 1, 8192)]
    result["targets"]["page_choice_over_decode_B1_8192_32_8"] = anchor[0]["choice_over_decode"] if anchor else None
    prefill = {r["backend"]: r["ms"] for r in result["timings"] if r["shape"].startswith("chunk=2048 prefix=32768")
               and not r["shape"].endswith("fp8")}
    if "flashinfer" in prefill:
        result["targets"]["prefill_2048_over_32k_triton_over_flashinfer"] = prefill["triton"] / prefill["flashinfer"]
        print(f"chunked prefill 2048 over 32k: triton {prefill['triton']:.3f} ms / FlashInfer "
              f"{prefill['flashinfer']:.3f} ms = {prefill['triton'] / prefill['flashinfer']:.2f}x (target <= 1.15x)")
    save()
    report_checks(result["checks"])


def choice_checks(rows: list) -> list:
    """The page choice timings' equality with the torch oracle, as check rows."""
    return [{"kind": "page_choice", "dtype": "bf16", "heads": r["heads"], "backend": "triton", "ok": r["ok"],
             "out_rel_err": 0.0 if r["ok"] else math.inf} for r in rows]


def report_checks(checks: list) -> None:
    failed = [c for c in checks if not c["ok"]]
    print(f"\ncorrectness: {len(checks) - len(failed)}/{len(checks)} ok"
          + "".join(f"\n  FAIL {c['kind']} {c['dtype']} {c['backend']} out {c['out_rel_err']:.2e}" for c in failed))


if __name__ == "__main__":
    main()
