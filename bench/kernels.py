"""Paged attention kernels on one GPU: ceilings, correctness of every backend, decode/prefill timings.

    PYTHONPATH=. python bench/kernels.py [--quick] [--tune]     # from the repository root, on a GPU
    PYTHONPATH=. python bench/kernels.py --smoke                # CPU: tiny shapes, Triton interpreter

Sections, in order: (1) the device's copy ceiling (device-to-device copy, read+write bytes) and
read ceiling (``x.sum()`` over 4 GiB), (2) every backend (torch reference, triton with page_max,
flashinfer when importable) against the reference on fresh random inputs, (3) ``--tune`` only: a
sweep of Triton launch configurations on representative shapes, (4) decode batch x context for
GQA 32/8 (D=128) and 9/3 (D=64), page 16, bf16, and chunked prefill chunk x prefix (32/8, D=128,
causal), timed with ``triton.testing.do_bench`` medians (L2 flushed between runs); decode shapes
under 1 GB of KV also as CUDA-graph replays (device time without host launch gaps). The table comes
last: KV bytes read per second, TFLOP/s (prefill), speedup over FlashInfer (its time / this time)
and the fraction of the measured read ceiling. JSON goes to ``$OUT/kernels.json`` if ``OUT`` is
set, else ``bench/kernels.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

KV_LIMIT_BYTES = 60e9  # skip sweep combos whose KV does not fit this
CHECK_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
DECODE_HEADS = [(32, 8, 128), (9, 3, 64)]  # (query heads, kv heads, head dim)
PREFILL_HEADS = (32, 8, 128)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sweep")
    ap.add_argument("--tune", action="store_true", help="also sweep Triton launch configurations")
    ap.add_argument("--smoke", action="store_true", help="CPU run of the whole script on tiny shapes (interpreter)")
    return ap.parse_args()


ARGS = parse_args()
if ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # before any triton kernel is imported

import triton  # noqa: E402

from kvtier.kernels.base import PagedBatch  # noqa: E402
from kvtier.kernels.flashinfer import FlashInferBackend  # noqa: E402
from kvtier.kernels.reference import TorchBackend, paged_attention_reference  # noqa: E402
from kvtier.kernels.triton_decode import DecodeConfig, TritonBackend  # noqa: E402
from kvtier.kernels.triton_prefill import PrefillConfig  # noqa: E402

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
    if small:
        cases = [(k, d, (4, 2, 32), lens, ql, c) for k, d, _, lens, ql, c in cases]
    rows = []
    for kind, dtype, heads, kv_lens, q_lens, causal in cases:
        q, pool, batch = paged_problem(kv_lens, q_lens, heads, 16, dtype, causal)
        if kind == "decode_head_mask":  # each kv head sees about half of the pages, every last page
            batch.head_mask = torch.rand(batch.kv_indices.numel(), heads[1], device=DEVICE) < 0.5
            batch.head_mask[batch.kv_indptr[1:].long() - 1] = True
        scale = heads[2] ** -0.5
        ref = paged_attention_reference(q, pool, batch, scale, return_page_max=True)
        for name, backend in backends.items():
            if batch.head_mask is not None and not backend.supports_head_mask:
                continue
            salience = backend.supports_salience
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
            row["ok"] = err <= CHECK_TOL[dtype] and row["lse_max_abs_err"] <= 20 * CHECK_TOL[dtype] and (
                not salience or row["page_max_max_abs_err"] <= 20 * CHECK_TOL[dtype])
            rows.append(row)
            print(f"check {kind:7s} {row['dtype']:8s} {heads} {name:10s} out {err:.2e} "
                  f"lse {row['lse_max_abs_err']:.2e} page_max {row['page_max_max_abs_err']} "
                  f"{'ok' if row['ok'] else 'FAIL'}", flush=True)
    return rows


def kv_bytes(batch_size, ctx, heads, dtype) -> float:
    return batch_size * ctx * heads[1] * heads[2] * 2 * torch.finfo(dtype).bits / 8


def prefill_flops(chunk, prefix, heads) -> float:
    pairs = chunk * prefix + chunk * (chunk + 1) / 2  # causal (query, key) pairs
    return 4 * pairs * heads[0] * heads[2]


def decode_shapes(quick: bool, smoke: bool):
    if smoke:
        return [(h, b, s) for h in [(4, 2, 32), (3, 1, 16)] for b, s in [(2, 64), (3, 200)]]
    batches, ctxs = ([1, 64, 256], [1024, 8192]) if quick else ([1, 16, 64, 256], [1024, 8192, 32768])
    return [(h, b, s) for h in DECODE_HEADS for b in batches for s in ctxs
            if kv_bytes(b, s, h, torch.bfloat16) <= KV_LIMIT_BYTES]


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


def sweep(buffer, fi, quick, smoke, timings: list, save) -> None:
    """Decode and prefill timings of every backend on bf16 problems cut from ``buffer`` (saved per shape).

    Shapes under 1 GB of KV are also timed as CUDA-graph replays, which shows the host launch cost.
    """

    for heads, b, s in decode_shapes(quick, smoke):
        q, pool, batch = paged_problem([s] * b, [1] * b, heads, 16, torch.bfloat16, False, buffer)
        backends = {"triton": (TritonBackend(), False), "triton+page_max": (TritonBackend(), True)}
        if fi is not None:
            backends["flashinfer"] = (fi, False)
        if b <= 16:
            backends["torch"] = (TorchBackend(), False)
        desc = f"B={b} S={s} {heads[0]}/{heads[1]} D={heads[2]}"
        nbytes = kv_bytes(b, s, heads, torch.bfloat16)
        timed_runs("decode", heads, desc, q, pool, batch, backends, 0.0, nbytes, timings, graphs=nbytes < 1e9)
        save()
    for heads, chunk, prefix in prefill_shapes(quick, smoke):
        q, pool, batch = paged_problem([prefix + chunk], [chunk], heads, 16, torch.bfloat16, True, buffer)
        backends = {"triton": (TritonBackend(), False), "triton+page_max": (TritonBackend(), True)}
        if fi is not None:
            backends["flashinfer"] = (fi, False)
        desc = f"chunk={chunk} prefix={prefix} {heads[0]}/{heads[1]} D={heads[2]}"
        timed_runs("prefill", heads, desc, q, pool, batch, backends, prefill_flops(chunk, prefix, heads),
                   kv_bytes(1, prefix + chunk, heads, torch.bfloat16), timings)
        save()


def tune(buffer, smoke) -> list:
    """Time Triton launch configurations on representative shapes; print the best five of each."""
    results = []
    if smoke:
        decode_cases = [((4, 2, 32), 2, 128)]
        decode_grid = [DecodeConfig(block_n=n, num_warps=2, num_stages=1) for n in (16, 32)]
        prefill_cases = [((4, 2, 32), 32, 32)]
        prefill_grid = [PrefillConfig(block_m=m, block_n=16, num_warps=2, num_stages=1) for m in (16, 32)]
    else:
        decode_cases = [((32, 8, 128), 64, 8192), ((32, 8, 128), 1, 32768), ((32, 8, 128), 256, 8192),
                        ((9, 3, 64), 64, 32768)]
        decode_grid = [DecodeConfig(block_n=n, num_warps=w, num_stages=st, ctas_per_sm=c)
                       for n, w, st in [(64, 4, 3), (64, 4, 5), (64, 4, 7), (32, 4, 6), (32, 4, 7), (32, 2, 6),
                                        (64, 8, 5), (128, 8, 5), (128, 4, 5)]
                       for c in (2, 4, 8)]
        prefill_cases = [(PREFILL_HEADS, 2048, 32768), (PREFILL_HEADS, 512, 8192)]
        prefill_grid = [PrefillConfig(block_m=m, block_n=n, num_warps=w, num_stages=st)
                        for m, n, w, st in [(128, 64, 8, 3), (128, 64, 8, 5), (128, 64, 4, 5), (128, 128, 8, 3),
                                            (128, 128, 8, 4), (128, 32, 8, 5), (64, 64, 4, 5), (64, 128, 4, 4)]]
    for heads, b, s in decode_cases:
        q, pool, batch = paged_problem([s] * b, [1] * b, heads, 16, torch.bfloat16, False, buffer)
        rows = []
        for cfg in decode_grid:
            backend = TritonBackend(decode_config=cfg)
            try:
                backend.plan(batch, *heads)
                ms = time_ms(lambda: backend.run(q, pool))
            except Exception as err:
                print(f"tune decode {cfg}: {type(err).__name__}: {str(err)[:200]}", flush=True)
                continue
            rows.append({"kind": "decode", "shape": f"B={b} S={s} {heads}", "config": vars(cfg), "ms": ms,
                         "kv_gbps": kv_bytes(b, s, heads, torch.bfloat16) / ms / 1e6})
        report_tuning(rows)
        results += rows
    for heads, chunk, prefix in prefill_cases:
        q, pool, batch = paged_problem([prefix + chunk], [chunk], heads, 16, torch.bfloat16, True, buffer)
        rows = []
        for cfg in prefill_grid:
            backend = TritonBackend(prefill_config=cfg)
            try:
                backend.plan(batch, *heads)
                ms = time_ms(lambda: backend.run(q, pool))
            except Exception as err:
                print(f"tune prefill {cfg}: {type(err).__name__}: {str(err)[:200]}", flush=True)
                continue
            rows.append({"kind": "prefill", "shape": f"chunk={chunk} prefix={prefix} {heads}", "config": vars(cfg),
                         "ms": ms, "tflops": prefill_flops(chunk, prefix, heads) / ms / 1e9})
        report_tuning(rows)
        results += rows
    return results


def report_tuning(rows):
    for r in sorted(rows, key=lambda r: r["ms"])[:5]:
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


def main():
    env = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "argv": sys.argv[1:]}
    print(env, flush=True)
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).parent
    result = {"env": env}

    def save():
        (out_dir / "kernels.json").write_text(json.dumps(result, indent=1, default=str))

    result["ceilings"] = measure_ceilings(0.01 if ARGS.smoke else 4.0)
    print("ceilings", result["ceilings"], flush=True)
    fi = flashinfer_or_none()
    backends = {"torch": TorchBackend(), "triton": TritonBackend()}
    if fi is not None:
        backends["flashinfer"] = fi
    result["checks"] = check_backends(backends, small=ARGS.smoke)
    save()
    pooled = [b * -(-s // 16) * 16 * h[1] * h[2] * 2 for h, b, s in decode_shapes(ARGS.quick, ARGS.smoke)]
    pooled += [-(-(c + p) // 16) * 16 * h[1] * h[2] * 2 for h, c, p in prefill_shapes(ARGS.quick, ARGS.smoke)]
    numel = max(pooled)  # elements of the largest pool (whole pages of 16 tokens)
    buffer = torch.randn(numel, dtype=torch.bfloat16, device=DEVICE)  # every pool is a view of this
    if ARGS.tune:
        result["tuning"] = tune(buffer, ARGS.smoke)
        save()
    result["timings"] = []
    sweep(buffer, fi, ARGS.quick, ARGS.smoke, result["timings"], save)
    print_table(result["timings"], result["ceilings"])
    failed = [c for c in result["checks"] if not c["ok"]]
    print(f"\ncorrectness: {len(result['checks']) - len(failed)}/{len(result['checks'])} ok"
          + "".join(f"\n  FAIL {c['kind']} {c['dtype']} {c['backend']} out {c['out_rel_err']:.2e}" for c in failed))


if __name__ == "__main__":
    main()
