"""GPU correctness of the whole path: exact scope vs the model's own HF attention, pages migrating.

A SmolLM2-shaped model (30 layers, 9/3 heads, D=64, random weights: the 98 MB GGUF cannot travel to
the device machine) runs a 1k-token prompt and 16 greedy decode steps with HF sdpa, then through
:class:`kvtier.engine.Engine` with scope=all and a 25% HBM budget (pages migrate every step, host pages
are read in place), in bf16 and fp32, under each decode kernel (``torch``, ``triton``) and each driver:
``step`` (the engine's own step, the Llama family through the compact runner; CUDA-graph replayed under
``triton``, eager under ``torch``, whose reference kernel syncs with the host) and
``hf`` (:class:`kvtier.cache.TieredKVCache` driven by the model's HF forward). Prints the max relative
logit error and greedy-token agreement; writes JSON. ``--windows`` runs sliding-window models instead:
Mistral-shaped (every layer sliding) and Gemma-3-shaped (5 sliding : 1 global, MQA, head_dim 256),
window 256 over the 1k prompt.
Run on a GPU:  python -m bench.gpu_checks [--step-only] [--windows] [--smollm2 PATH]
"""

from __future__ import annotations

import argparse

import torch

from bench.common import print_table, write_json
from kvtier.cache import TieredKVCache
from kvtier.engine import Engine, EngineConfig
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


def kvtier_logits(model, ids, tokens, kernel, driver, budget_pages):
    """Logits ``[1 + steps, V]`` of the prompt's last token and each forced decode token, bytes moved, hit rate."""
    layout = kv_layout_for(model.config, page_size=16, dtype=next(model.parameters()).dtype)
    tiers = [DeviceTier(layout, budget_pages), HostTier(layout, 256)]
    if driver == "hf":
        cache = TieredKVCache(layout, tiers, LRU(), kernel=make_backend(kernel), scope="all")
        got = [cache.prefill(model, ids, 256)[0, -1]]
        for t in tokens:
            got.append(cache.forward(model, t)[0, -1])
        engine = cache.engine
    else:
        engine = Engine(model, layout, tiers, LRU(), "all", kernel=make_backend(kernel), prefill=ChunkedPrefill(256),
                        config=EngineConfig(max_context=ids.shape[1] + len(tokens) + 16, graphs=kernel != "torch"))
        seq, logits = engine.add(ids[0])
        got = [logits[-1]]
        for t in tokens:
            got.append(engine.step({seq: int(t)})[0].clone())
    moved, hit = dict(engine.transfer.bytes_moved), engine.hit_rate()
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
    ap.add_argument("--step-only", action="store_true", help="only the engine's own step (no hf driver rows)")
    ap.add_argument("--smollm2", default="", help="also the real SmolLM2 (converted folder) through the engine's step")
    ap.add_argument("--windows", action="store_true", help="sliding-window models (Mistral, Gemma 3 shapes) instead")
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
        drivers = ("step",) if args.step_only or name == "smollm2" else ("step", "hf")
        for kernel, driver in [(k, d) for k in ("torch", "triton") for d in drivers]:
            got, moved, hit = kvtier_logits(model, ids, tokens, kernel, driver, budget_pages=17)
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            norm_err = ((got - ref).norm() / ref.norm()).item()
            agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
            rows.append({"model": name, "dtype": dtype, "kernel": kernel, "driver": driver, "max_rel_err": err,
                         "rel_err": norm_err,
                         "nan": bool(torch.isnan(got).any()), "greedy_agree": agree, "hit_rate": hit,
                         "MB_moved": sum(moved.values()) / 1e6})
            print(rows[-1], flush=True)
        del model
    print_table("exact scope vs HF sdpa on the GPU (1k prompt + 16 decode steps, 25% HBM, LRU migrating)", rows,
                ["model", "dtype", "kernel", "driver", "max_rel_err", "rel_err", "nan", "greedy_agree", "hit_rate",
                 "MB_moved"])
    write_json("gpu_checks_windows.json" if args.windows else "gpu_checks.json",
               {"gpu": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
