"""GPU correctness of the whole path: exact scope vs the model's own HF attention, pages migrating.

A SmolLM2-shaped model (30 layers, 9/3 heads, D=64, random weights: the 98 MB GGUF cannot travel to
the device machine) runs a 1k-token prompt and 16 greedy decode steps with HF sdpa, then through
kvtier with scope=all, a 25% HBM budget (pages migrate every step) and each kernel backend, in
bf16 and fp32. Prints the max relative logit error and greedy-token agreement; writes JSON.
The fast path (:class:`kvtier.fast.engine.FastEngine`: CUDA graph, static Triton kernel, host pages
read in place) runs the same prompt and tokens with the same budget. ``--windows`` runs sliding-window
models instead: Mistral-shaped (every layer sliding) and Gemma-3-shaped (5 sliding : 1 global, MQA,
head_dim 256), window 256 over the 1k prompt, through every backend (``--flashinfer``: its ``window_left`` too).
Run on a GPU:  python -m bench.gpu_checks [--fast-only] [--windows] [--flashinfer]
"""

from __future__ import annotations

import argparse

import torch

from bench.common import print_table, write_json
from kvtier.cache import TieredKVCache
from kvtier.engine import Engine
from kvtier.fast.engine import FastEngine
from kvtier.hook import install
from kvtier.kernels.registry import make_backend
from kvtier.data import token_stream
from kvtier.models import kv_layout_for, load_model, random_llama
from kvtier.policies import LRU
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.tiers import DeviceTier, HostTier


@torch.no_grad()
def hf_logits(model, ids, steps):
    model.set_attn_implementation("sdpa")
    out = model(ids, use_cache=True)
    past, logits, tokens = out.past_key_values, [out.logits[0, -1].float()], []
    for _ in range(steps):
        tokens.append(logits[-1].argmax().view(1, 1))
        out = model(tokens[-1], past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits.append(out.logits[0, -1].float())
    return torch.stack(logits), tokens


def kvtier_logits(model, ids, tokens, kernel, merge, budget_pages):
    model.set_attn_implementation(install())
    layout = kv_layout_for(model.config, page_size=16, dtype=next(model.parameters()).dtype)
    cache = TieredKVCache(layout, [DeviceTier(layout, budget_pages), HostTier(layout, 256)], LRU(),
                          backend=make_backend(kernel), scope="all", merge=merge)
    engine = Engine(model, ChunkedPrefill(256))
    got = [engine.run_prefill(cache, ids)[0, -1]]
    for t in tokens:
        got.append(engine.decode_step(cache, t)[0])
    moved = dict(cache.transfer.bytes_moved)
    hit = cache.stats.tier1_hit_rate
    cache.close()
    return torch.stack(got), moved, hit


def fast_logits(model, ids, tokens, budget_pages):
    layout = kv_layout_for(model.config, page_size=16, dtype=next(model.parameters()).dtype)
    engine = FastEngine(model, layout, [DeviceTier(layout, budget_pages), HostTier(layout, 256)], LRU(),
                        max_context=ids.shape[1] + len(tokens) + 16, prefill=ChunkedPrefill(256))
    seq, logits = engine.add(ids[0])
    got = [logits[-1]]
    for t in tokens:
        got.append(engine.step({seq: int(t)})[0].clone())
    moved, hit = dict(engine.transfer.bytes_moved), engine.stats.hit_rate()
    engine.close()
    return torch.stack(got), moved, hit


def windowed_model(family: str, dtype: str):
    """A random-weight sliding-window model on the GPU: ``mistral`` (all layers) or ``gemma3`` (mixed)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM

    if family == "mistral":
        cls, config = MistralForCausalLM, MistralConfig(
            num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=128, hidden_size=2048,
            intermediate_size=5632, vocab_size=32000, sliding_window=WINDOW)
    else:
        cls, config = Gemma3ForCausalLM, Gemma3TextConfig(
            num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=1, head_dim=256, hidden_size=1152,
            intermediate_size=6912, vocab_size=32000, sliding_window=WINDOW,
            layer_types=["sliding_attention"] * 5 + ["full_attention"])
    with torch.random.fork_rng(devices=["cuda"]), torch.device("cuda"):
        torch.manual_seed(0)
        return cls._from_config(config, dtype=getattr(torch, dtype)).eval()


WINDOW = 256


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fast-only", action="store_true")
    ap.add_argument("--smollm2", default="", help="also the real SmolLM2 (converted folder) through the fast path")
    ap.add_argument("--windows", action="store_true", help="sliding-window models (Mistral, Gemma 3 shapes) instead")
    ap.add_argument("--flashinfer", action="store_true", help="FlashInfer rows too (bf16; JIT-compiles minutes)")
    args = ap.parse_args()
    rows = []
    shapes = ("mistral-shape", "gemma3-shape") if args.windows else ("smollm2-shape",)
    models = [(shape, dtype) for shape in shapes for dtype in ("bfloat16", "float32")]
    models += [("smollm2", dtype) for dtype in ("bfloat16", "float32")] if args.smollm2 else []
    for name, dtype in models:
        if name == "smollm2":
            model, tok = load_model(args.smollm2, dtype=dtype, device="cuda")
            ids = token_stream(tok, "opticks", 1024)[None].cuda()
        elif args.windows:
            model = windowed_model(name.removesuffix("-shape"), dtype)
            ids = torch.randint(0, 32000, (1, 1024), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        else:
            model = random_llama(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536,
                                 vocab_size=49152, device="cuda", dtype=dtype)
            ids = torch.randint(0, 49152, (1, 1024), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        ref, tokens = hf_logits(model, ids, 16)
        runs = [] if args.fast_only or name == "smollm2" else [("torch", False), ("triton", False), ("triton", True)]
        runs += [("flashinfer", False), ("flashinfer", True)] if args.flashinfer and dtype == "bfloat16" else []
        runs += [] if name == "gemma3-shape" else [("fast", False)]  # the fast runner is Llama-family only
        for kernel, merge in runs:
            if kernel == "fast":
                got, moved, hit = fast_logits(model, ids, tokens, budget_pages=18)  # one slot is the scratch page
            else:
                got, moved, hit = kvtier_logits(model, ids, tokens, kernel, merge, budget_pages=17)
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            norm_err = ((got - ref).norm() / ref.norm()).item()
            agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
            rows.append({"model": name, "dtype": dtype, "kernel": kernel, "merge": merge, "max_rel_err": err, "rel_err": norm_err,
                         "nan": bool(torch.isnan(got).any()), "greedy_agree": agree, "hit_rate": hit,
                         "MB_moved": sum(moved.values()) / 1e6})
            print(rows[-1], flush=True)
        del model
    print_table("exact scope vs HF sdpa on the GPU (1k prompt + 16 decode steps, 25% HBM, LRU migrating)", rows,
                ["model", "dtype", "kernel", "merge", "max_rel_err", "rel_err", "nan", "greedy_agree", "hit_rate", "MB_moved"])
    write_json("gpu_checks_windows.json" if args.windows else "gpu_checks.json", {"gpu": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
