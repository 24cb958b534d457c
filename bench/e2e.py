"""End-to-end decode on a GPU: kvtier's fast path (graph-captured, batched) beside its anchors, one table.

Per model shape and (batch B, context S), rows side by side:
- ``limit``: every weight once plus all KV at the HBM read rate measured in this run;
- ``hf-eager`` (DynamicCache, sdpa) and ``hf-compiled`` (StaticCache + ``torch.compile`` reduce-overhead);
- ``kvtier all-HBM``: :class:`kvtier.engine.Engine`, scope ``all``, every page in HBM;
- ``kvtier tiered``: 50% and 20% of the pages in HBM, the rest in pinned host DRAM, scopes ``topk``
  (Quest top-k pages; half the device budget is a recall cache of pages picked from the host, the other
  half holds the sinks and the newest pages (SinkWindow), and each row has a quarter of its picks' count in
  landing slots per layer, where the decode writes the pages it reads from the host (``--recall-slots rest``: the
  recall cache takes every device page the sinks, window and landing slots leave); ``--no-recall``: LRU over the
  picks, lookahead
  ``--lookahead``) and ``resident`` (sink+window); ``0.2:topk:next_layer`` adds prediction ahead (each layer's
  pages fetched into its recall slots before it runs, :mod:`kvtier.scopes.predict`), with the predictor's accuracy
  (the share of the pages fetched ahead that the layer picked);
- ``--kernels triton,flashinfer,triton-eager``: the ``all`` and ``resident`` rows again with each further kernel
  backend (``flashinfer``: FlashInfer's paged decode and prefill through the engine, planned on the host each step,
  so never graph-captured; ``triton-eager``: Triton without CUDA graphs, FlashInfer's like for like), marked by
  ``kernel`` and ``graphs``.

Weights are random (Llama-8B and SmolLM2 shapes); the context's K/V is written straight into the
pages (random, as the weights), then ``--steps`` greedy decode steps run. With ``--smollm2 PATH``
(its GGUF file or a converted folder) the real SmolLM2-135M runs too, prefilled through the engine
with Newton's Opticks (B sequences from different places in the text), because hit rates and
hidden transfers only mean something with real attention; its rows are marked ``smollm2``. ``--capacity BxS``
adds the capacity rows (:func:`capacity_rows`): dense at batch B against recall at 5 B in the same HBM KV pool
(the pool is sized from B, not from the GPU's whole HBM: a GPU with too little HBM for the batch). TPOT is the time between
the ends of consecutive steps on the GPU's timeline (CUDA events; the host runs ahead, so host work
shows only where it is slower than the GPU); p50/p99 after ``WARMUP`` steps. Hidden fraction =
1 - (TPOT - TPOT all-HBM) / (bytes moved per step at the measured pinned copy rate), clipped to [0, 1].
Each tiered row says whether its greedy tokens equal the all-HBM row's (``same_tokens_as_dense``, the share of
sequences) and, with a predictor, the same row's without one (``same_tokens_as_unpredicted``: a prediction must
change no output). ``--profile N`` profiles N more steps of each row: its kernel time a step by kind (``kernel_ms``:
matmul, choice (of pages or keys), attention, copy, other), which says where a row's time goes.
Run on a GPU:  python -m bench.e2e [--models ...] [--shapes BxS,...] [--no-hf] [--kernels triton,flashinfer]
(writes $OUT/e2e.json)
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import numpy as np
import torch
from torch._dynamo.utils import counters as dynamo_counters

from bench.baselines import free_device_memory, hf_decode_tpot, measure_hbm_read_GBps, physical_limit_ms
from bench.common import KERNEL_KINDS, MODELS, kernel_ms_by_kind, kernel_times, pinned_bulk_ceiling, print_table, \
    write_json
from kvtier.budget import TokenBudget
from kvtier.checks import pay_for_key_stats
from kvtier.data import token_stream
from kvtier.engine import Engine, EngineConfig
from kvtier.models import convert_gguf, kv_layout_for, load_model, random_llama
from kvtier.policies import LRU, SinkWindow
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.scopes import TopK, make_scope
from kvtier.tiers import DeviceTier, HostTier

WARMUP = 3
TIERED = "0.5:quest,0.5:resident,0.2:quest,0.2:resident,1:topk,0.2:topk"
ATTEND = 0.2  # topk rows: the keys a step attends, a share of the context (the policy study's "20%")
SINKS, WINDOW = 4, 64  # topk rows: the token budget's sinks and window
KERNELS = {"triton": ("triton", {}), "triton-eager": ("triton", {"graphs": False}), "flashinfer": ("flashinfer", {})}


def tiered_engine(model, batch: int, context: int, steps: int, budget: float, scope: str, lookahead: int,
                  prompts: list[torch.Tensor] | None = None, recall: bool = True, predictor: str | None = None,
                  recall_share: str = "half", engine_settings: dict | None = None,
                  attend: float = ATTEND, kernel: str = "triton") -> tuple[Engine, str]:
    """The engine of a row and its scope's recipe: ``batch`` sequences of ``context`` tokens each (``prompts``
    prefilled, or random K/V written straight into the pages), room for ``steps`` more; ``budget`` of the pages in
    HBM (less what the scope's key statistics take there), the rest in pinned host memory. Scopes: ``topk``, the one
    recall configuration (each kv head's keys by the sketch, a token budget of ``attend`` of the context: the policy
    study's configuration), ``quest`` (Quest's pages, half the budget's pages a step), ``resident``. A recall cache
    (``recall``) takes half the device budget (``recall_share`` "half") or what the sinks, window and landing slots
    leave ("rest") and fetches ahead with ``predictor`` (:mod:`kvtier.scopes.predict`); ``engine_settings``: more
    :class:`EngineConfig` fields (graphs, compile); ``kernel`` the backend's name."""
    layout = kv_layout_for(model.config, page_size=16, dtype=torch.bfloat16)
    per_seq = layout.pages_for(context + steps + 1)
    total = per_seq * batch
    tokens = TokenBudget(int(attend * context), SINKS, WINDOW, layout.page_size) if scope == "topk" else None
    chooser = TopK() if scope == "topk" else None
    dev_pages = total + 1 if budget >= 1 else max(int(total * budget), batch * 24)
    if budget < 1 and chooser is not None:  # the device budget pays for the sketch
        dev_pages = pay_for_key_stats(dev_pages, chooser, layout, total * layout.page_size, "budget")
    tiers = [DeviceTier(layout, dev_pages)]
    if budget < 1:
        tiers.append(HostTier(layout, total + 64))
    picks = max(int(per_seq * budget) // 2, 16) if scope == "quest" else None
    recalls = recall and scope in ("topk", "quest") and budget < 1
    landing = picks // 4 if recalls and scope == "quest" else 0  # per row and layer, within the device budget too
    recall_slots = (picks * batch if scope == "quest" else dev_pages // 2) if recalls else 0
    # the placement: sinks + the newest pages (resident; recall beside a recall cache, which holds the picks: a
    # policy that heard the picks too would move them twice), or LRU over the picks (recall without the recall cache)
    policy = SinkWindow(sinks=4, window=256) if scope == "resident" or recall_slots else LRU()
    if recall_slots and recall_share == "rest":  # what each row pins, the page being written, its landing; scratch
        recall_slots = dev_pages - batch * (policy.pinned_pages(layout.page_size) + 1 + landing) - 1
    if scope == "topk":
        chooser = TopK(recall_slots=recall_slots, predictor=predictor)
    elif scope == "quest":
        chooser = TopK(picks, recall_slots=recall_slots, predictor=predictor, landing_slots=landing, unit="page",
                       rank="quest")
    else:
        chooser = make_scope(scope)
    engine = Engine(model, layout, tiers, policy, chooser, kernel=kernel, prefill=ChunkedPrefill(4096), budget=tokens,
                    exact_prefill=tokens is not None,
                    config=EngineConfig(max_batch=batch, max_context=context + steps + 1, lookahead=lookahead,
                                        buckets=[batch], sync_timing=False, **(engine_settings or {})))
    device = engine.device
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (layout.num_kv_heads, layout.head_dim)
    for b in range(batch):
        if prompts is not None:
            engine.add(prompts[b])
        else:
            engine.add_written(context, lambda layer, a, b: torch.randn(2, b - a, *shape, generator=gen,
                                                                         device=device, dtype=torch.bfloat16))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return engine, recipe_of(scope, tokens, chooser, layout.page_size)


def recipe_of(scope: str, tokens: TokenBudget | None, chooser, page_size: int) -> str:
    """A row's scope recipe (``kvtier-run`` overrides), matched against the policy study's ``scope_recipe``."""
    parts = [f"scope={'topk' if scope == 'quest' else scope}"]
    if scope == "quest":
        parts += ["scope.unit=page", "scope.rank=quest", f"scope.pages={chooser.pages}"]
    if tokens is not None:
        parts += ["policy=sink_window", "cache.attend_budget=true", "cache.exact_prefill=true",
                  f"cache.sinks={tokens.sinks}", f"cache.window={tokens.window}", f"budget.tokens={tokens.tokens}"]
    return " ".join(parts + [f"page_size={page_size}"])


def kvtier_row(model, batch: int, context: int, steps: int, budget: float, scope: str, lookahead: int,
               prompts: list[torch.Tensor] | None = None, recall: bool = True, predictor: str | None = None,
               recall_share: str = "half", profile: int = 0, kernel: str = "triton") -> dict:
    """Decode ``WARMUP + steps`` greedy tokens of :func:`tiered_engine`'s sequences and time the last ``steps``
    (``kernel``: a name of :data:`KERNELS`);
    ``profile`` more steps under the torch profiler give the kernel time a step by kind (``kernel_ms``). The row's
    ``tokens`` are the timed steps' greedy tokens ``[steps][batch]``; ``setup_s`` the seconds to build and fill its
    engine."""
    built = time.perf_counter()
    backend, settings = KERNELS[kernel]
    engine, recipe = tiered_engine(model, batch, context, WARMUP + steps + profile, budget, scope, lookahead, prompts,
                                   recall, predictor, recall_share, settings, kernel=backend)
    built = time.perf_counter() - built
    layout = engine.layout
    tokens = torch.empty(steps, batch, dtype=torch.int64, device="cuda")
    events, t0 = [], 0.0
    for i in range(WARMUP + steps):
        if i == WARMUP:
            torch.cuda.synchronize()
            t0, moved0, wait0 = time.perf_counter(), sum(engine.transfer.bytes_moved.values()), engine.stats.host_wait_s
            engine.buffers.counts.zero_()
            counters = (engine.recall.copied, engine.recall.prefetched, engine.recall.predicted, engine.recall.landed) \
                if engine.recall is not None else ()
            start = [int(c) for c in counters] or [0, 0, 0, 0]
            stalls0 = timed_stalls(engine)
        engine.step()
        events.append(engine.feedback.last_event)
        if i >= WARMUP:
            tokens[i - WARMUP].copy_(engine.buffers.tokens[:batch], non_blocking=True)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    attended, on_device = engine.buffers.counts.tolist()
    copied, ahead, predicted, landed = [int(c) - c0 for c, c0 in zip(counters, start)] or [0, 0, 0, 0]
    # bytes that crossed the link: migrations, copies into recall slots (after a read, and ahead of one), misses
    # read in place from the host (a page admitted from its landing slot crossed once, when it was read)
    keys = getattr(engine.scope, "unit", "page") == "token"  # the counts are keys (one kv head's), else pages
    entry_bytes = 2 * layout.head_dim * layout.kv_dtype.itemsize if keys else layout.page_bytes
    moved = sum(engine.transfer.bytes_moved.values()) - moved0 + (copied + ahead) * layout.page_bytes \
        + (attended - on_device) * entry_bytes
    tpot = np.array([events[i - 1].elapsed_time(events[i]) for i in range(WARMUP + 1, len(events))])  # ms
    row = {"budget": budget, "scope": scope, "kernel": kernel, "graphs": engine.graphs, "scope_recipe": recipe,
           "lookahead": lookahead,
           "recall": engine.recall is not None, "hit_unit": "key" if keys else "page",
           "sketch_bytes_per_token": engine.stats_bytes_per_token, "kv_bytes_per_token": engine.kv_bytes_per_token,
           "predictor": predictor or "-", "fetched_ahead_per_step": ahead / steps,
           "predictor_accuracy": predicted / ahead if ahead else None,
           "tpot_p50_ms": float(np.percentile(tpot, 50)),
           "tpot_p99_ms": float(np.percentile(tpot, 99)), "wall_ms": wall / steps * 1e3,
           "hit_rate": on_device / attended if attended else 1.0,
           "MB_moved_per_step": moved / steps / 1e6,
           "recall_slots": getattr(engine.scope, "recall_slots", 0),
           "landing_slots": getattr(engine.scope, "landing_slots", 0),
           "copied_per_step": copied / steps, "landed_per_step": landed / steps,
           "host_wait_ms": (engine.stats.host_wait_s - wait0) / steps * 1e3,
           "offloaded": 1 - min(engine.table.occupancy()["device"]) / (layout.pages_for(context + WARMUP + steps)
                                                                       * batch),
           "setup_s": built, "tokens": tokens.T.tolist(),
           # what may stall a timed step for 100s of ms (the p99): graph captures, dynamo compiles, full GC passes
           **{f"{k}_in_timed": v - v0 for (k, v), v0 in zip(timed_stalls(engine).items(), stalls0.values())}}
    if profile:
        row["kernel_ms"] = kernel_ms_by_kind(kernel_times(engine.step, profile))
    engine.close()
    del engine
    free_device_memory()
    return row


def timed_stalls(engine) -> dict:
    """Counts of what stalls a step: the engine's CUDA graphs captured, dynamo's graphs compiled, Python's full
    (generation 2) garbage collections."""
    return {"captures": engine.captured, "compiles": dynamo_counters["stats"]["unique_graphs"],
            "gc_full": gc.get_stats()[2]["collections"]}


def show(row: dict, t0: float) -> None:
    """A row on the console as it is measured (without its tokens), with the seconds it took."""
    print({k: v for k, v in row.items() if k != "tokens"}, f"({time.time() - t0:.0f}s)", flush=True)


def same_tokens(row: dict, reference: dict) -> float:
    """The share of sequences whose greedy tokens in ``row`` equal those in ``reference`` at every step."""
    return float(np.mean([a == b for a, b in zip(row["tokens"], reference["tokens"])]))


def text_windows(tokenizer, batch: int, context: int) -> list[torch.Tensor]:
    """``batch`` prompts of ``context`` tokens from Newton's Opticks: disjoint where the text is long enough,
    else windows at evenly spread offsets (overlapping, each a different place in the text)."""
    ids = token_stream(tokenizer, "opticks")  # [N] every token of the text
    if context > len(ids):
        raise ValueError(f"Opticks has {len(ids)} tokens with this tokenizer: no prompt of {context}")
    stride = context if batch * context <= len(ids) else (len(ids) - context) // max(batch - 1, 1)
    return [ids[b * stride:b * stride + context] for b in range(batch)]


def capacity_rows(model, tokenizer, spec: str, steps: int, lookahead: int, recall_share: str = "half",
                  profile: int = 0) -> list[dict]:
    """Capacity at a fixed HBM KV pool (``BxS[:predictor]``): the pool holds B sequences' whole KV, so dense
    decodes B of them; recall decodes 5 B sequences with 20% of each one's KV in that same pool (the rest in
    pinned host memory), topk over the recall cache. Rows ``capacity-dense`` and ``capacity-recall`` with
    tokens/s; the recall row's ``x_dense_tok_s`` is the ratio."""
    shape, *predictor = spec.split(":")
    batch, context = (int(x) for x in shape.split("x"))
    prompts = text_windows(tokenizer, 5 * batch, context) if tokenizer is not None else None
    layout = kv_layout_for(model.config, page_size=16, dtype=torch.bfloat16)
    pool_gib = batch * layout.pages_for(context + WARMUP + steps + profile + 1) * layout.page_bytes \
        * layout.num_layers / 2 ** 30  # tiered_engine's dense pool
    rows = []
    for system, b, budget, scope in (("capacity-dense", batch, 1.0, "all"), ("capacity-recall", 5 * batch, 0.2,
                                                                           "quest")):
        t0 = time.time()
        r = kvtier_row(model, b, context, steps, budget, scope, lookahead, prompts and prompts[:b], True,
                       (predictor or [None])[0] if scope == "topk" else None, recall_share, profile)
        rows.append({"B": b, "S": context, "system": system, "hbm_kv_GiB": pool_gib, **r,
                     "tok_s": b / r["tpot_p50_ms"] * 1e3})
        show(rows[-1], t0)
    rows[1]["x_dense_tok_s"] = rows[1]["tok_s"] / rows[0]["tok_s"]
    return rows


def real_smollm2(path: str):
    """The real SmolLM2-135M (bf16, CUDA) and its tokenizer from a GGUF file (converted once beside it)
    or a converted folder."""
    folder = Path(path)
    if folder.suffix == ".gguf":
        out = folder.parent / "hf"
        if not (out / "config.json").is_file():
            convert_gguf(folder, out)
        folder = out
    return load_model(str(folder), dtype="bfloat16", device="cuda")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama8b-shape")
    ap.add_argument("--shapes", default="1x32768,16x8192,16x32768")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--lookahead", type=int, default=2)
    ap.add_argument("--lookaheads", default="", help="extra topk-20%% rows (B=1 shapes) without the recall cache "
                    "(LRU over the picks, where k is the promotion distance) at these lookaheads, e.g. 0,1,2")
    ap.add_argument("--json", default="e2e.json")
    ap.add_argument("--tiered", default=TIERED, help="tiered rows, HBM fraction:scope[:predictor], comma-separated "
                    "(e.g. 0.2:topk:next_layer: the recall cache fetches ahead)")
    ap.add_argument("--no-recall", action="store_true", help="topk rows without the recall cache (LRU over picks)")
    ap.add_argument("--recall-slots", choices=("half", "rest"), default="half", help="the recall cache's share of "
                    "the device budget: half, or the rest after the sinks, window and landing slots")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF rows (compiling takes minutes)")
    ap.add_argument("--tiered-max-tokens", type=int, default=131072, help="tiered rows only up to B*S tokens")
    ap.add_argument("--smollm2", default="", help="the real SmolLM2: its GGUF file or converted HF folder")
    ap.add_argument("--smollm2-shapes", default="1x8192,16x8192")
    ap.add_argument("--smollm2-tiered", default="", help="the real SmolLM2's tiered rows (default: --tiered)")
    ap.add_argument("--profile", type=int, default=0, help="profile this many more steps of each kvtier row: its "
                    "kernel time a step by kind (matmul, choice, attention, copy, other) in kernel_ms")
    ap.add_argument("--capacity", default="", help="capacity rows of --models, BxS[:predictor] comma-separated: dense "
                    "at batch B against recall (topk, 20%% HBM) at 5 B in the same HBM KV pool")
    ap.add_argument("--smollm2-capacity", default="", help="the real SmolLM2's capacity rows, as --capacity")
    ap.add_argument("--kernels", default="triton", help=f"kernel backends of the all and resident rows, of "
                    f"{', '.join(KERNELS)} (every other row: triton), e.g. triton,flashinfer,triton-eager")
    args = ap.parse_args()
    kernels = [k for k in args.kernels.split(",") if k]
    if not set(kernels) <= set(KERNELS) or "triton" not in kernels:
        raise SystemExit(f"--kernels: {args.kernels!r} must name triton and any of {', '.join(KERNELS)}")
    hbm = measure_hbm_read_GBps("cuda")
    link = pinned_bulk_ceiling()
    rows = []

    def save():
        write_json(args.json, {"gpu": torch.cuda.get_device_name(), "hbm_read_GBps": hbm, "link": link,
                               "args": vars(args), "rows": rows})

    runs = [("smollm2", args.smollm2_shapes, args.smollm2_tiered or args.tiered, args.smollm2_capacity)] \
        if args.smollm2 else []  # the real model first: its rows carry the hit rates
    runs += [(name, args.shapes, args.tiered, args.capacity) for name in args.models.split(",") if name]
    for name, shapes, tiered, capacity in runs:
        tokenizer = None
        if name == "smollm2":
            model, tokenizer = real_smollm2(args.smollm2)
        else:
            model = random_llama(**MODELS[name], device="cuda", dtype="bfloat16")
        for shape in shapes.split(","):
            batch, context = (int(x) for x in shape.split("x"))
            prompts = text_windows(tokenizer, batch, context) if tokenizer is not None else None
            base = {"model": name, "B": batch, "S": context}
            limit = physical_limit_ms(model, batch, context, hbm)
            rows.append({**base, "system": "limit", "tpot_p50_ms": limit})
            if not args.no_hf:
                model.set_attn_implementation("sdpa")  # FastEngine switched it to the kvtier hook
                for mode in ("eager", "compiled"):
                    t0 = time.time()
                    r = hf_decode_tpot(model, batch, context, args.steps, mode)
                    rows.append({**base, "system": f"hf-{mode}", **{k: r[k] for k in ("tpot_p50_ms", "tpot_p99_ms")},
                                 "compile_s": r.get("compile_s")})
                    show(rows[-1], t0)
                    free_device_memory()
            grid = [(1.0, "all", args.lookahead, False, None)]
            if batch * context <= args.tiered_max_tokens:
                grid += [(float(b), s, args.lookahead, not args.no_recall, (p or [None])[0])
                         for b, s, *p in (x.split(":") for x in tiered.split(",") if x)]
                if batch == 1:  # with the recall cache k only bounds the host's run-ahead: these rows go without it
                    grid += [(0.2, "quest", int(k), False, None) for k in args.lookaheads.split(",") if k]
            shape_rows = []
            for budget, scope, k, recall, predictor in grid:
                for kernel in kernels if scope in ("all", "resident") else ["triton"]:
                    t0 = time.time()
                    r = kvtier_row(model, batch, context, args.steps, budget, scope, k, prompts, recall, predictor,
                                   args.recall_slots, args.profile, kernel)
                    shape_rows.append({**base, "system": "kvtier", **r})
                    rows.append(shape_rows[-1])
                    show(rows[-1], t0)
                    save()  # after each row: a cut-off run keeps its rows
            all_hbm = shape_rows[0]
            for r in rows:
                if r["model"] == name and r["B"] == batch and r["S"] == context:
                    r["x_limit"] = r["tpot_p50_ms"] / limit
                    r["tok_s"] = batch / r["tpot_p50_ms"] * 1e3
            for r in shape_rows[1:]:
                r["x_allhbm"] = r["tpot_p50_ms"] / all_hbm["tpot_p50_ms"]
                xfer_ms = r["MB_moved_per_step"] * 1e6 / (link["h2d_GBps"] * 1e9) * 1e3
                slow = r["tpot_p50_ms"] - all_hbm["tpot_p50_ms"]
                r["hidden"] = float(np.clip(1 - slow / xfer_ms, 0, 1)) if xfer_ms > 0 else None
                r["same_tokens_as_dense"] = same_tokens(r, all_hbm)
                unpredicted = next((u for u in shape_rows if u["predictor"] == "-" and u["recall"] == r["recall"]
                                    and (u["budget"], u["scope"], u["lookahead"]) == (r["budget"], r["scope"],
                                                                                      r["lookahead"])), None)
                if r["predictor"] != "-" and unpredicted is not None:
                    r["same_tokens_as_unpredicted"] = same_tokens(r, unpredicted)
            save()
        for spec in (x for x in capacity.split(",") if x):
            rows += [{"model": name, **r} for r in capacity_rows(model, tokenizer, spec, args.steps, args.lookahead,
                                                                 args.recall_slots, args.profile)]
            save()
        del model
        free_device_memory()
    print_table(f"decode TPOT, bf16, page 16, steps={args.steps}; HBM read {hbm:.0f} GB/s, pinned h2d "
                f"{link['h2d_GBps']:.1f} GB/s", rows,
                ["model", "B", "S", "system", "kernel", "graphs", "budget", "scope", "lookahead", "recall", "predictor",
                 "tpot_p50_ms", "tpot_p99_ms", "x_limit", "x_allhbm", "tok_s", "hit_rate", "predictor_accuracy", "MB_moved_per_step",
                 "copied_per_step", "landed_per_step", "host_wait_ms", "hidden", "offloaded", "hbm_kv_GiB",
                 "x_dense_tok_s", "same_tokens_as_dense", "same_tokens_as_unpredicted"])
    profiled = [{**r, **r["kernel_ms"]} for r in rows if "kernel_ms" in r]
    if profiled:
        print_table(f"kernel ms a step by kind ({args.profile} profiled steps a row)", profiled,
                    ["model", "B", "S", "system", "budget", "scope", "predictor", "tpot_p50_ms", *KERNEL_KINDS,
                     "other", "total", "launches"])


if __name__ == "__main__":
    main()
