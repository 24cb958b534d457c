"""Anchors for every kvtier decode figure: the HBM physical limit and what a user would run instead.

Per (model, batch, context): the time to read every weight once plus all the KV at the HBM read
rate measured in the same run, and the decode TPOT of plain Hugging Face transformers, both
``eager`` (DynamicCache, sdpa) and ``compiled`` (StaticCache, sdpa, ``torch.compile`` with
``mode="reduce-overhead"``, ``fullgraph=True``: CUDA graphs). The context's K/V is written straight
into the HF cache as random values (as the weights are), not prefilled.
Run on a GPU:  python -m bench.baselines [--models ...] [--shapes BxS,...]   (writes $OUT/baselines.json)
CPU check:     python -m bench.baselines --smoke   (tiny model and shapes; writes baselines_smoke.json)
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from bench.common import MODELS, print_table, write_json
from kvtier.layout import kv_footprint_bytes
from kvtier.models import attention_dims, random_llama, tiny_llama

WARMUP_STEPS = 3  # decode steps run before the timed ones (the compile and CUDA-graph capture, for "compiled")


def weight_read_bytes(model, batch: int) -> int:
    """Bytes of weights one decode step of ``batch`` sequences reads.

    Every parameter once (``model.parameters()`` yields a tied embedding/lm_head once), except an
    untied input embedding: only its ``batch`` gathered rows are read.
    """
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings().weight  # [vocab, hidden]
    head = model.get_output_embeddings()
    if head is not None and head.weight is embed:
        return total
    return total - embed.numel() * embed.element_size() + batch * embed[0].numel() * embed.element_size()


def physical_limit_ms(model_or_config, batch: int, context: int, hbm_read_GBps: float, kv_dtype_bytes: int = 2,
                      weight_bytes: int | None = None) -> float:
    """Lower bound on one decode step's time, in ms: every byte it must read, read once at the HBM rate.

    ``T = (W + 2·L·N_kv·D·b_kv·S·B) / R`` with ``W`` the weight bytes (:func:`weight_read_bytes` of the
    model unless ``weight_bytes`` is given; a bare config needs ``weight_bytes``), ``L`` layers,
    ``N_kv`` KV heads, ``D`` head size, ``b_kv`` = ``kv_dtype_bytes``, ``S`` = ``context`` tokens per
    sequence (K and V of all layers), ``B`` = ``batch`` sequences and ``R`` = ``hbm_read_GBps`` (1e9 B/s).
    """
    config = getattr(model_or_config, "config", model_or_config)
    if weight_bytes is None:
        if config is model_or_config:
            raise ValueError("physical_limit_ms: pass a model, or weight_bytes along with a config")
        weight_bytes = weight_read_bytes(model_or_config, batch)
    _, kv_heads, head_dim = attention_dims(config)
    kv = kv_footprint_bytes(config.num_hidden_layers, kv_heads, head_dim, kv_dtype_bytes, context, batch)
    return (weight_bytes + kv) / hbm_read_GBps / 1e6


def measure_hbm_read_GBps(device, nbytes: int = 4 << 30, reps: int = 10) -> float:
    """Read rate in GB/s of ``x.sum()`` over ``nbytes`` of bf16, best of ``reps`` (CUDA events).

    The same read-only reduction as the ceiling of ``bench/kernels.py``; on a CPU, a rough host-clock figure.
    """
    device = torch.device(device)
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)  # [n]
    x.sum()  # warm-up
    best_s = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            x.sum()
            end.record()
            end.synchronize()
            best_s = min(best_s, start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            x.sum()
            best_s = min(best_s, time.perf_counter() - t0)
    return x.numel() * x.element_size() / best_s / 1e9


def fill_cache(cache, model, batch: int, context: int, seed: int = 0) -> None:
    """Write ``context`` random K/V tokens (model dtype) into every layer of an HF cache: one ``update`` a layer."""
    _, kv_heads, head_dim = attention_dims(model.config)
    gen = torch.Generator(device=model.device).manual_seed(seed)
    for layer in range(model.config.num_hidden_layers):
        k, v = torch.randn(2, batch, kv_heads, context, head_dim, generator=gen, device=model.device,
                           dtype=model.dtype)  # [2, B, N_kv, S, D]
        cache.update(k, v, layer)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_decode_tpot(model, batch: int, context: int, steps: int, mode: str, seed: int = 0,
                   return_cache: bool = False) -> dict:
    """TPOT of plain HF decode of ``batch`` sequences after ``context`` tokens, ``mode`` "eager" or "compiled".

    eager: DynamicCache, the model as loaded (sdpa). compiled: StaticCache of ``context`` +
    ``WARMUP_STEPS`` + ``steps`` tokens and the model's ``__call__`` under ``torch.compile(mode=
    "reduce-overhead", fullgraph=True, dynamic=False)``, positions taken from the cache's own
    (static-address) length. Each step is timed on the host with a device sync after it; the first
    ``WARMUP_STEPS`` are left out of the percentiles (for compiled, their time is ``compile_s``, and
    ``graphs`` / ``cudagraph_skips`` count the compiled graphs and the CUDA-graph skips).
    ``return_cache`` adds the cache under "cache" (tests).
    """
    from torch._dynamo.utils import counters
    from transformers import DynamicCache, StaticCache

    if mode not in ("eager", "compiled"):
        raise ValueError(f"mode must be 'eager' or 'compiled', got {mode!r}")
    if model.config._attn_implementation != "sdpa":
        raise ValueError(f"the HF baselines use sdpa attention; the model has {model.config._attn_implementation!r}")
    device = model.device
    if mode == "eager":
        cache, forward = DynamicCache(config=model.config), model
    else:
        torch._dynamo.reset()  # a fresh compile per row: no recompiles into dynamic shapes, old CUDA graphs freed
        counters.clear()
        cache = StaticCache(config=model.config, max_cache_len=context + WARMUP_STEPS + steps)
        forward = torch.compile(model.__call__, mode="reduce-overhead", fullgraph=True, dynamic=False)
    times = []
    with torch.no_grad():
        fill_cache(cache, model, batch, context, seed)
        token = torch.randint(0, model.config.vocab_size, (batch, 1), device=device,
                              generator=torch.Generator(device=device).manual_seed(seed))  # [B, 1]
        _sync(device)
        for _ in range(WARMUP_STEPS + steps):
            t0 = time.perf_counter()
            if mode == "compiled":
                torch.compiler.cudagraph_mark_step_begin()  # the last step's graph outputs are not kept
            logits = forward(input_ids=token, past_key_values=cache, use_cache=True).logits  # [B, 1, V]
            token = logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
            del logits
            _sync(device)
            times.append(time.perf_counter() - t0)
    tpot = np.asarray(times[WARMUP_STEPS:]) * 1e3
    p50 = float(np.percentile(tpot, 50))
    row = {"mode": mode, "batch": batch, "context": context, "tpot_p50_ms": p50,
           "tpot_p99_ms": float(np.percentile(tpot, 99)), "tok_s": batch / p50 * 1e3}
    if mode == "compiled":
        # graphs > 1 means a recompile; a CUDA-graph skip (logged by inductor) leaves launch overhead in the TPOT
        row.update(compile_s=float(sum(times[:WARMUP_STEPS])), graphs=counters["stats"]["unique_graphs"],
                   cudagraph_skips=counters["inductor"]["cudagraph_skips"])
    if return_cache:
        row["cache"] = cache
    return row


def free_device_memory(keep_compiled: bool = False) -> None:
    """Drop compiled graphs (unless ``keep_compiled``: the next engine runs the same shapes) and cached allocator
    blocks between rows, pinned host blocks too (torch keeps a closed engine's pinned host tiers cached otherwise:
    the next row ran out of memory)."""
    if not keep_compiled:
        torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch._C._host_emptyCache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="llama8b-shape,smollm2-shape")
    ap.add_argument("--shapes", default="1x32768,16x8192", help="comma list of BATCHxCONTEXT")
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--smoke", action="store_true", help="CPU run on a tiny fp32 model and tiny shapes")
    args = ap.parse_args()
    if args.smoke:
        device, models, shapes, nbytes = "cpu", {"tiny": lambda: tiny_llama()}, [(2, 64)], 64 << 20
    else:
        device, nbytes = "cuda", 4 << 30
        models = {name: (lambda cfg=MODELS[name]: random_llama(**cfg, device="cuda", dtype="bfloat16"))
                  for name in args.models.split(",")}
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    hbm = measure_hbm_read_GBps(device, nbytes)
    print(f"HBM read rate (x.sum(), best of 10): {hbm:.0f} GB/s", flush=True)
    rows = []
    for name, build in models.items():
        model = build()
        for batch, context in shapes:
            limit = physical_limit_ms(model, batch, context, hbm, kv_dtype_bytes=model.dtype.itemsize)
            for mode in args.modes.split(","):
                t0 = time.time()
                row = {"model": name, **hf_decode_tpot(model, batch, context, args.steps, mode),
                       "limit_ms": limit, "hbm_GBps": hbm}
                row["limit_over_p50"] = limit / row["tpot_p50_ms"]
                print(f"{row} ({time.time() - t0:.0f}s)", flush=True)
                rows.append(row)
                free_device_memory()
        del model
        free_device_memory()
    print_table(f"HF decode baselines beside the physical limit (weights + KV read once at {hbm:.0f} GB/s), "
                f"{args.steps} timed steps after {WARMUP_STEPS} warm-up", rows,
                ["model", "batch", "context", "mode", "tpot_p50_ms", "tpot_p99_ms", "tok_s", "compile_s",
                 "graphs", "cudagraph_skips", "limit_ms", "limit_over_p50", "hbm_GBps"])
    import transformers
    write_json("baselines_smoke.json" if args.smoke else "baselines.json", {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
        "transformers": transformers.__version__, "hbm_read_GBps": hbm, "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
