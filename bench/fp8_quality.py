"""Quality of 8-bit KV pages on the real SmolLM2-135M, beside their bytes (issue 24): only what the pages store
changes, every page attended (scope all), half the pages in host memory so that scales cross a tier too.

Rows (``--rows``): ``bfloat16`` pages (the reference), ``fp8_e4m3`` (E4M3 values, one power-of-two scale per
page, K/V and kv head), ``int8`` (int8 steps per page, K/V, kv head and channel about the page's mean:
:mod:`kvtier.quant`), ``kbf16_ve4m3`` (K kept in bf16 pages, V rounded to E4M3 as it is written, a power-of-two
scale per token and head: emulated, not a layout; its bytes are what K in bf16 plus V's E4M3 and scale row
would take).

Measurements, each against the ``bfloat16`` row:
- ``ctx2k`` (bench/policy_study.py's protocol): a 2,048-token Opticks slice prefilled, then
  ``--continuation`` tokens teacher-forced, one decode step each; perplexity of the NLL pooled over
  ``--slices`` slices (offsets 0, 30k, 60k, ...). Pages written by decode steps grow token by token.
- ``prefill`` (``--prefill``): perplexity of every position of the first 2,048-token slice fed in
  128-token chunks (each chunk attends the stored pages, its own keys included).

CPU (the torch reference kernel; 2 shared cores, ~8 min a row with --slices 1):
    nice -n 10 .venv/bin/python -m bench.fp8_quality --slices 1 --prefill
GPU (Triton kernels, decode steps replayed as CUDA graphs):
    python -m bench.fp8_quality --device cuda --kernel triton --slices 3 --prefill --smollm2 /tmp/smollm2/hf
Writes bench/results/fp8_quality.json (``--json``) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time

import torch

from bench.common import write_json
from kvtier.data import token_stream
from kvtier.engine import Engine, EngineConfig
from kvtier.eval import Perplexity
from kvtier.hook import install
from kvtier.kernels.registry import make_backend
from kvtier.models import kv_layout_for, load_model
from kvtier.policies import LRU
from kvtier.quant import FP8, pow2_scale
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.scopes import All
from kvtier.tiers import DeviceTier, HostTier

PAGE = 16
PREFIX = 2048
ROWS = {  # name -> (kv_dtype, V rounded to E4M3 on the way in)
    "bfloat16": ("bfloat16", False),
    "fp8_e4m3": ("fp8_e4m3", False),
    "int8": ("int8", False),
    "kbf16_ve4m3": ("bfloat16", True),
}


def token_bytes(layout, v_e4m3: bool) -> float:
    """Bytes one token takes in one layer's pages (scale rows included); ``v_e4m3``: K as stored, V in E4M3 pages
    with a scale row."""
    if not v_e4m3:
        return layout.page_bytes / layout.page_size
    n = layout.num_kv_heads * layout.head_dim
    return n * layout.dtype_bytes + n * (layout.page_size + 1) / layout.page_size


def e4m3_rounded(x: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` rounded to E4M3 with a power-of-two scale per vector (its dtype kept)."""
    s = pow2_scale(x.float().abs().amax(-1, keepdim=True))
    return ((x.float() / s).to(FP8).float() * s).to(x.dtype)


@contextlib.contextmanager
def values_rounded():
    """The engine's K/V writes with V rounded to E4M3 first (the emulated ``kbf16_ve4m3`` row)."""
    import kvtier.engine.engine as engine_module

    tokens, decode = engine_module.write_tokens, engine_module.write_decode

    def write_tokens(table, layer, seq, kv, start):  # kv [2, n, N_kv, D]
        tokens(table, layer, seq, torch.stack([kv[0], e4m3_rounded(kv[1])]), start)

    def write_decode(pool, table, positions, key, value, page_size, scaled):  # value [B, N_kv, 1, D]
        decode(pool, table, positions, key, e4m3_rounded(value), page_size, scaled)

    engine_module.write_tokens, engine_module.write_decode = write_tokens, write_decode
    try:
        yield
    finally:
        engine_module.write_tokens, engine_module.write_decode = tokens, decode


def engine_factory(model, layout, args, context: int, chunk: int = 512):
    """A fresh exact engine: every page attended, half of them in host memory."""
    pages = layout.pages_for(context + 64) + 4
    return lambda: Engine(model, layout, [DeviceTier(layout, pages // 2, device=args.device), HostTier(layout, pages)],
                          LRU(), All(), kernel=make_backend(args.kernel, args.device), prefill=ChunkedPrefill(chunk),
                          config=EngineConfig(compile=False))  # graphs on a GPU; compiling would take minutes


@torch.no_grad()
def ctx2k(model, tok, layout, args) -> tuple[float, list[float]]:
    """Pooled perplexity of the continuation over the slices, and each slice's."""
    nll, per_slice = [], []
    for s in range(args.slices):
        task = Perplexity(text="opticks", length=PREFIX + args.continuation, prefix=PREFIX, offset=30000 * s)
        res = task.run(engine_factory(model, layout, args, task.length), tok)
        nll.append(res["nll_mean"] * res["scored_tokens"])
        per_slice.append(res["perplexity"])
    return math.exp(sum(nll) / (args.slices * args.continuation)), per_slice


@torch.no_grad()
def prefill_ppl(model, tok, layout, args) -> float:
    ids = token_stream(tok, "opticks", PREFIX)  # [S]
    engine = engine_factory(model, layout, args, PREFIX, chunk=128)()
    logits = engine.prefill_sequence(engine.open(PREFIX), ids, all_logits=True)  # [S, V]
    engine.close()
    nll = torch.nn.functional.cross_entropy(logits[:-1].double().cpu(), ids[1:], reduction="mean")
    return math.exp(float(nll))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    p.add_argument("--dtype", default="float32", help="the model's dtype (bf16 matmuls are slow on the CPU)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--kernel", default="torch", help="torch (any device) or triton (cuda)")
    p.add_argument("--smollm2", default=None, help="the converted SmolLM2 folder (default: the package's)")
    p.add_argument("--slices", type=int, default=3)
    p.add_argument("--continuation", type=int, default=256)
    p.add_argument("--prefill", action="store_true", help="also the 2,048-token chunked-prefill perplexity")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default="fp8_quality.json")
    args = p.parse_args(argv)
    names = args.rows.split(",")
    if "bfloat16" not in names or any(n not in ROWS for n in names):
        raise SystemExit(f"--rows: names of {', '.join(ROWS)}, bfloat16 among them (the reference)")
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.smollm2, dtype=args.dtype, device=args.device, attn_implementation=install())
    rows, t0 = [], time.time()
    for name in names:
        kv_dtype, v_e4m3 = ROWS[name]
        layout = kv_layout_for(model.config, page_size=PAGE, dtype=model.dtype, kv_dtype=kv_dtype)
        row = {"row": name, "kv_dtype": kv_dtype, "bytes_per_token_layer": token_bytes(layout, v_e4m3)}
        with values_rounded() if v_e4m3 else contextlib.nullcontext():
            row["ctx2k_ppl"], row["ctx2k_slices"] = ctx2k(model, tok, layout, args)
            if args.prefill:
                row["prefill_ppl"] = prefill_ppl(model, tok, layout, args)
        rows.append(row)
        print(row, f"{time.time() - t0:.0f}s", flush=True)
    base = rows[names.index("bfloat16")]
    keys = ["ctx2k_ppl"] + (["prefill_ppl"] if args.prefill else [])
    for r in rows:
        for key in keys:
            r[f"{key}_vs_bf16"] = r[key] / base[key] - 1
        r["bytes_vs_bf16"] = r["bytes_per_token_layer"] / base["bytes_per_token_layer"]
    print(f"\nSmolLM2-135M, model {args.dtype}, {args.device} ({args.kernel} kernel), exact scope, page {PAGE}; "
          f"ctx2k: {args.slices} slice(s) x {args.continuation} decode steps after {PREFIX}")
    prefill = args.prefill
    print("| pages | bytes / token / layer | ctx2k ppl (vs bf16) |" + (" prefill ppl (vs bf16) |" if prefill else ""))
    print("| --- | ---: | ---: |" + (" ---: |" if prefill else ""))
    for r in rows:
        cells = [f"{r[k]:.4f} ({r[k + '_vs_bf16']:+.3%})" for k in keys]
        size = f"{r['bytes_per_token_layer']:.0f} ({r['bytes_vs_bf16']:.3f}x)"
        print(f"| {r['row']} | {size} | " + " | ".join(cells) + " |")
    print(f"target: within 0.15% of bf16 | {time.time() - t0:.0f}s")
    write_json(args.json, {"model": args.smollm2 or "SmolLM2-135M-Instruct", "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
