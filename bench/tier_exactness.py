"""Exact attention across tiers, on the device that runs it: the engine's logits against the model's own HF forward
(fp32, the whole sequence at once) with pages in HBM only or half of them in pinned host memory, per page format
and kernel. It found a GPU race (session 9): a move's source slot was released before a prefill chunk queued on the
GPU had read it, so host pages of bf16/FP8/int8 layouts read another page's data (maxdiff 0.1 against 0.006).

Rows: ``--rows kv_dtype:tiers:kernel`` (tiers ``dev`` or ``dev+host``, kernel ``triton`` or ``torch``). Per row: the
largest |logit| difference against HF over the prefill (``--prefill`` tokens in 512-token chunks) and over
``--decode`` teacher-forced decode steps, and both perplexities. Random weights by default (no download);
``--smollm2`` a converted SmolLM2 folder.

    python -m bench.tier_exactness --device cuda
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from bench.common import write_json
from kvtier.data import token_stream
from kvtier.engine import Engine, EngineConfig
from kvtier.kernels.registry import make_backend
from kvtier.models import kv_layout_for, load_model, random_llama
from kvtier.policies import LRU
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.scopes import All
from kvtier.tiers import DeviceTier, HostTier

ROWS = ",".join(f"{kv}:{tiers}:{kernel}" for kv in ("float32", "bfloat16", "fp8_e4m3", "int8")
                for tiers in ("dev", "dev+host") for kernel in ("triton", "torch"))


def ppl(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return math.exp(torch.nn.functional.cross_entropy(logits.double().cpu(), targets, reduction="mean").item())


@torch.no_grad()
def row(model, ids: torch.Tensor, ref: torch.Tensor, kv: str, tiers: str, kernel: str, S: int, T: int, device) -> dict:
    """One engine: prefill ``ids[:S]`` (all logits), then ``T - 1`` decode steps; differences against ``ref [S+T, V]``."""
    layout = kv_layout_for(model.config, page_size=16, dtype=torch.float32, kv_dtype=kv)
    pages = layout.pages_for(S + T + 64) + 4
    stack = [DeviceTier(layout, pages, device=device)] if tiers == "dev" else \
        [DeviceTier(layout, pages // 2, device=device), HostTier(layout, pages)]
    t0 = time.perf_counter()
    engine = Engine(model, layout, stack, LRU(), All(), kernel=make_backend(kernel, device), prefill=ChunkedPrefill(512),
                    config=EngineConfig(compile=False))
    seq = engine.open(S + T)
    prefill = engine.prefill_sequence(seq, ids[:S], all_logits=True).float()  # [S, V]
    engine.start_decode(seq, ids[S])
    r = engine.row_seq.index(seq)
    decode = torch.stack([engine.step({seq: int(ids[i])})[r].float().clone() for i in range(S, S + T - 1)])  # [T-1, V]
    engine.close()
    return {"kv_dtype": kv, "tiers": tiers, "kernel": kernel,
            "prefill_maxdiff": (prefill - ref[:S]).abs().max().item(),
            "decode_maxdiff": (decode.to(ref.device) - ref[S:S + T - 1]).abs().max().item(),
            "prefill_ppl": ppl(prefill[:-1], ids[1:S]), "decode_ppl": ppl(torch.cat([prefill[-1:], decode]), ids[S:S + T]),
            "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", default=ROWS)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--smollm2", default=None, help="a converted SmolLM2 folder (default: random Llama weights)")
    ap.add_argument("--json", default="tier_exactness.json")
    args = ap.parse_args()
    S, T = args.prefill, args.decode
    if args.smollm2:
        model, tok = load_model(args.smollm2, dtype="float32", device=args.device)
        ids = token_stream(tok, "opticks", S + T + 1)
    else:
        model = random_llama(num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64, vocab_size=512, dtype="float32",
                             device=args.device)
        ids = torch.randint(0, 512, (S + T + 1,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids[None, :S + T].to(args.device)).logits[0].float()  # [S + T, V]
    hf = {"prefill_ppl": ppl(ref[:S - 1], ids[1:S]), "decode_ppl": ppl(ref[S - 1:S + T - 1], ids[S:S + T])}
    print(f"HF: prefill ppl {hf['prefill_ppl']:.4f}, decode ppl {hf['decode_ppl']:.4f}")
    rows = []
    for spec in args.rows.split(","):
        rows.append(row(model, ids, ref, *spec.split(":"), S, T, args.device))
        x = rows[-1]
        print(f"| {x['kv_dtype']} | {x['tiers']} | {x['kernel']} | {x['prefill_maxdiff']:.2e} | {x['prefill_ppl']:.4f} | "
              f"{x['decode_maxdiff']:.2e} | {x['decode_ppl']:.4f} |", flush=True)
    write_json(args.json, {"args": vars(args), "hf": hf, "rows": rows})


if __name__ == "__main__":
    main()
