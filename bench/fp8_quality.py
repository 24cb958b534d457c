"""FP8 E4M3 KV pages on the real SmolLM2-135M (CPU, torch reference path, exact scope): quality against
bf16 pages (and the model's own fp32).

The model runs in fp32 (bf16 matmuls are slow on this CPU); only what the pages store changes:
``kv_dtype`` float32 (the model's), bfloat16, fp8_e4m3. Three measurements each, same tokens:
- ``prefill_ppl``: perplexity of every position of an Opticks slice fed in 128-token chunks (each
  chunk attends every earlier page from the cache, its own keys included: all keys are stored pages);
- ``stream_ppl``: the ``ctx2k`` protocol of bench/policy_study.py: 2,048 tokens prefilled, then
  ``--stream`` tokens fed one per decode step and scored;
- ``passkey``: accuracy over ``--passkeys`` prompts (depths spread over the context, question inside).

    nice -n 10 .venv/bin/python -m bench.fp8_quality            # table + bench/fp8_quality.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch

from bench.common import write_json
from kvtier.cache import TieredKVCache
from kvtier.data import token_stream
from kvtier.engine import Engine
from kvtier.eval import Passkey, Perplexity
from kvtier.hook import install
from kvtier.models import kv_layout_for, load_model
from kvtier.policies import LRU
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.tiers import DeviceTier, HostTier


def exact_cache(layout, context: int):
    """Every page attended (scope all); half the pages in host DRAM, so scales cross a tier too."""
    pages = layout.pages_for(context + 64) + 4
    return lambda: TieredKVCache(layout, [DeviceTier(layout, pages // 2, device="cpu"), HostTier(layout, pages)],
                                 LRU(), scope="all")


@torch.no_grad()
def prefill_ppl(model, tok, layout, length: int, chunk: int) -> float:
    ids = token_stream(tok, "opticks", length)  # [S]
    cache = exact_cache(layout, length)()
    logits = Engine(model, ChunkedPrefill(chunk)).run_prefill(cache, ids[None])[0]  # [S, V]
    cache.close()
    nll = torch.nn.functional.cross_entropy(logits[:-1].double(), ids[1:], reduction="mean")
    return math.exp(float(nll))


def measure(model, tok, layout, args) -> dict:
    t0 = time.time()
    row = {"kv_dtype": str(layout.kv_dtype).removeprefix("torch."), "page_bytes": layout.page_bytes}
    row["prefill_ppl"] = prefill_ppl(model, tok, layout, args.length, 128)
    stream = Perplexity(text="opticks", length=2048 + args.stream, prefix=2048)
    row["stream_ppl"] = stream.run(Engine(model, ChunkedPrefill(512)), exact_cache(layout, stream.length), tok)[
        "perplexity"]
    depths = tuple(np.linspace(0.1, 0.9, args.passkeys).round(3).tolist())
    pk = Passkey(context_tokens=args.context, depths=depths, samples=1, max_new_tokens=8)
    res = pk.run(Engine(model, ChunkedPrefill(512)), exact_cache(layout, args.context), tok)
    row.update(passkey=res["accuracy"], passkey_outputs=[r["output"] for r in res["records"]],
               wall_s=round(time.time() - t0, 1))
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32", help="the model's dtype")
    p.add_argument("--length", type=int, default=2048, help="tokens of the prefill perplexity slice")
    p.add_argument("--stream", type=int, default=128, help="decode steps scored after the 2k prefill")
    p.add_argument("--context", type=int, default=2048, help="passkey prompt tokens")
    p.add_argument("--passkeys", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_model(None, dtype=args.dtype, device="cpu", attn_implementation=install())
    model.eval()
    rows = []
    for kv_dtype in (None, "bfloat16", "fp8_e4m3"):
        layout = kv_layout_for(model.config, page_size=16, dtype=model.dtype, kv_dtype=kv_dtype)
        rows.append(measure(model, tok, layout, args))
        print(json.dumps(rows[-1]), flush=True)
    base, fp8 = rows[1], rows[2]  # bf16 pages, FP8 pages
    for r in rows:
        for key in ("prefill_ppl", "stream_ppl"):
            r[f"{key}_vs_base"] = r[key] / base[key] - 1
    print(f"\nSmolLM2-135M, model {args.dtype}, CPU, exact scope (every page), page 16; (x%): vs bf16 pages")
    print("| kv pages | page bytes | prefill ppl (2k Opticks) | stream ppl (2k + %d decode) | passkey (%d) |"
          % (args.stream, args.passkeys))
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        rel = (f" ({r['prefill_ppl_vs_base']:+.2%})", f" ({r['stream_ppl_vs_base']:+.2%})")
        print(f"| {r['kv_dtype']} | {r['page_bytes']} | {r['prefill_ppl']:.3f}{rel[0]} | {r['stream_ppl']:.3f}{rel[1]}"
              f" | {r['passkey']:.0%} |")
    print("targets: FP8 perplexity within 1% of bf16 pages:",
          all(abs(fp8[f"{k}_vs_base"]) <= 0.01 for k in ("prefill_ppl", "stream_ppl")),
          "| passkey unchanged:", fp8["passkey"] >= base["passkey"])
    write_json("fp8_quality.json", {"model": "SmolLM2-135M-Instruct", "model_dtype": args.dtype, "args": vars(args),
                                    "rows": rows})


if __name__ == "__main__":
    main()
