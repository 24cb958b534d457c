"""FP8 E4M3 KV pages on the real SmolLM2-135M (CPU, the engine with the torch reference kernel, exact scope):
quality against bf16 pages (and the model's own fp32).

The model runs in fp32 (bf16 matmuls are slow on this CPU); only what the pages store changes:
``kv_dtype`` float32 (the model's), bfloat16, fp8_e4m3. Three measurements each, same tokens:
- ``prefill_ppl``: perplexity of every position of an Opticks slice fed in 128-token chunks (each
  chunk attends every earlier page from the cache, its own keys included: all keys are stored pages);
- ``stream_ppl`` (bf16 and FP8 pages): the ``ctx2k`` protocol of bench/policy_study.py: 2,048 tokens
  prefilled, then ``--stream`` tokens fed one per decode step and scored;
- ``passkey`` (bf16 and FP8 pages): accuracy over ``--passkeys`` prompts (depths spread over the
  context, question inside).
``--halves``: which half costs the perplexity (K only or V only rounded to E4M3).

    nice -n 10 .venv/bin/python -m bench.fp8_quality      # table + bench/fp8_quality.json
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

from bench.common import write_json
from kvtier.data import token_stream
from kvtier.engine import Engine
from kvtier.eval import Passkey, Perplexity
from kvtier.hook import install
from kvtier.models import kv_layout_for, load_model
from kvtier.policies import LRU
from kvtier.quant import FP8, pow2_scale
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.tiers import DeviceTier, HostTier


def exact_engine(model, layout, context: int, chunk: int = 512):
    """Every page attended (scope all); half the pages in host DRAM, so scales cross a tier too."""
    pages = layout.pages_for(context + 64) + 4
    return lambda: Engine(model, layout, [DeviceTier(layout, pages // 2, device="cpu"), HostTier(layout, pages)],
                          LRU(), "all", prefill=ChunkedPrefill(chunk))


@torch.no_grad()
def prefill_ppl(model, tok, layout, length: int, chunk: int) -> float:
    ids = token_stream(tok, "opticks", length)  # [S]
    engine = exact_engine(model, layout, length, chunk)()
    logits = engine.prefill_sequence(engine.open(length), ids, all_logits=True)  # [S, V]
    engine.close()
    nll = torch.nn.functional.cross_entropy(logits[:-1].double(), ids[1:], reduction="mean")
    return math.exp(float(nll))


@torch.no_grad()
def half_ppl(model, tok, layout, half: int, length: int) -> float:
    """Diagnostic: ``prefill_ppl`` with only K (``half=0``) or only V (1) rounded to E4M3 (per token and head,
    power-of-two scale: E4M3's relative rounding does not depend on the scale, so this matches per-page
    scales bar subnormals), the pages kept in the model's dtype."""
    import kvtier.engine.engine as engine_module

    def rounded(x):  # [.., D] -> E4M3-rounded, same dtype
        s = pow2_scale(x.float().abs().amax(-1, keepdim=True))
        return ((x.float() / s).to(FP8).float() * s).to(x.dtype)

    plain = engine_module.write_tokens

    def write(table, layer, seq, kv, start):
        kv = kv.clone()
        kv[half] = rounded(kv[half])
        plain(table, layer, seq, kv, start)

    engine_module.write_tokens = write
    try:
        return prefill_ppl(model, tok, layout, length, 128)
    finally:
        engine_module.write_tokens = plain


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32", help="the model's dtype")
    p.add_argument("--length", type=int, default=2048, help="tokens of the prefill perplexity slice")
    p.add_argument("--stream", type=int, default=64, help="decode steps scored after the 2k prefill")
    p.add_argument("--context", type=int, default=2048, help="passkey prompt tokens")
    p.add_argument("--passkeys", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--halves", action="store_true", help="only the K-only / V-only E4M3 diagnostic (half_ppl)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_model(None, dtype=args.dtype, device="cpu", attn_implementation=install())
    model.eval()
    layouts = {kv: kv_layout_for(model.config, page_size=16, dtype=model.dtype, kv_dtype=kv)
               for kv in ("float32", "bfloat16", "fp8_e4m3")}
    rows = {kv: {"kv_dtype": kv, "page_bytes": layout.page_bytes} for kv, layout in layouts.items()}
    t0 = time.time()
    if args.halves:
        halves = {name: half_ppl(model, tok, layouts["float32"], h, args.length) for h, name in enumerate("KV")}
        print(f"prefill ppl, only K / only V rounded to E4M3: {halves}")
        write_json("fp8_quality_halves.json", {"args": vars(args), "ppl": halves})
        return
    for kv, layout in layouts.items():  # cheapest first, every kv dtype; progress as it goes
        rows[kv]["prefill_ppl"] = prefill_ppl(model, tok, layout, args.length, 128)
        print(kv, "prefill_ppl", rows[kv]["prefill_ppl"], f"{time.time() - t0:.0f}s", flush=True)
    stream = Perplexity(text="opticks", length=2048 + args.stream, prefix=2048)
    pk = Passkey(context_tokens=args.context, depths=tuple(np.linspace(0.1, 0.9, args.passkeys).round(3).tolist()),
                 samples=1, max_new_tokens=8)
    for kv in ("bfloat16", "fp8_e4m3"):  # the target's pair
        res = stream.run(exact_engine(model, layouts[kv], stream.length), tok)
        rows[kv]["stream_ppl"] = res["perplexity"]
        print(kv, "stream_ppl", rows[kv]["stream_ppl"], f"{time.time() - t0:.0f}s", flush=True)
    for kv in ("bfloat16", "fp8_e4m3"):
        res = pk.run(exact_engine(model, layouts[kv], args.context), tok)
        rows[kv].update(passkey=res["accuracy"], passkey_outputs=[r["output"] for r in res["records"]])
        print(kv, "passkey", rows[kv]["passkey"], rows[kv]["passkey_outputs"], f"{time.time() - t0:.0f}s", flush=True)
    base, fp8 = rows["bfloat16"], rows["fp8_e4m3"]
    for r in rows.values():
        for key in ("prefill_ppl", "stream_ppl"):
            if key in r:
                r[f"{key}_vs_bf16"] = r[key] / base[key] - 1
    print(f"\nSmolLM2-135M, model {args.dtype}, CPU, exact scope (every page), page 16; (x%): vs bf16 pages")
    print(f"| kv pages | page bytes | prefill ppl ({args.length} Opticks) | stream ppl (2k + {args.stream} decode) "
          f"| passkey ({args.passkeys} x {args.context}) |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows.values():
        cells = [f"{r[k]:.3f} ({r[k + '_vs_bf16']:+.2%})" if k in r else "-" for k in ("prefill_ppl", "stream_ppl")]
        pk_cell = f"{r['passkey']:.0%}" if "passkey" in r else "-"
        print(f"| {r['kv_dtype']} | {r['page_bytes']} | {cells[0]} | {cells[1]} | {pk_cell} |")
    print("targets: FP8 perplexity within 1% of bf16 pages:",
          all(abs(fp8[f"{k}_vs_bf16"]) <= 0.01 for k in ("prefill_ppl", "stream_ppl")),
          "| passkey unchanged:", fp8["passkey"] >= base["passkey"], f"| {time.time() - t0:.0f}s")
    write_json("fp8_quality.json", {"model": "SmolLM2-135M-Instruct", "model_dtype": args.dtype, "args": vars(args),
                                    "rows": list(rows.values())})


if __name__ == "__main__":
    main()
