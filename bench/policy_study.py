"""Policy study on the real SmolLM2-135M (CPU, or ``--device cuda``): policies x scopes x budgets on the quality
protocols, through the one engine.

Protocols (``--protocol``):

- ``ctx2k``: exact prefill of a 2,048-token (``--context``) slice of Opticks (``--text``), then 256
  teacher-forced tokens under the budget; perplexity over the 256 (``--continuation``; ``--slices``
  slices at offsets 0, 30k, 60k, ..., or the token offsets ``--offsets``; the ppl of the pooled NLL).
  Budget = fraction x 2,048.
- ``stream``: a ``--length``-token stream (``--text``) fed one token per step after a 256-token
  prefix (prefilled exactly); perplexity over the rest. Budget = fraction x length, or ``--tokens``.
- ``passkey_inside`` / ``passkey_after``: passkey at ``--context`` tokens, exact prefill; the question
  is inside the compressed context, or fed token by token after it. Budget = fraction x context.
- ``needle``: the needle task (Lady Susan), question inside; budget = fraction x context.
- ``ruler``: RULER's subtasks (``--subtasks``, default every synthetic one; ``--samples`` each) at ``--context``
  tokens (RULER's length: prompt + generated), question inside; budget = fraction x context. Scores 0-100 per
  subtask and averaged (:mod:`kvtier.eval.ruler`). ``--model gemma3_270m`` runs Gemma-3-270m instead of SmolLM2.

Configurations (``--configs``, names below): ``exact`` (scope all); ``<scope>:<policy>`` with
scope ``resident`` (continuous eviction), ``once`` (compress once after the prefill, resident) or
``topk`` (recall, the policy only places pages: each kv head's single keys by their share under the low-rank key
sketch, the default ``scope=topk``), ``topk_quest`` (Quest's pages), ``topk_head`` (Quest with per-head
normalisation), ``topk_perhead`` (each kv head its own Quest pages), ``topk_gauss`` (pages by their estimated
attention mass, ``rank=gauss``), ``topk_gausshead`` (the same per kv head), ``topk_sketch`` / ``topk_sketchhead``
(pages by their mass under the sketched keys, ``rank=sketch unit=page``, ``--sketch-rank``; all heads / per kv head).
Each row carries ``scope_recipe``: the ``kvtier-run`` overrides of its configuration.
Every budgeted run attends ``--sinks`` sink tokens and a recent window of
``--window`` tokens (StreamingLLM, ``resident:sink_window``: all of the rest).

``kvpress:<press>`` (``streaming_llm``, ``tova``, ``snapkv``, ``observed_attention``, ``expected_attention``,
``knorm``) runs kvpress's press on the same model, text, slices, prompts and budget: it compresses the
prefill once to ``budget`` KV pairs per layer (the protocol of ``once``; :mod:`kvtier.eval.kvpress`). kvpress
0.5.5 needs transformers<5.3, so these run from ``.venv-compare`` (``make compare-env``), kvtier's beside them;
without kvpress a ``kvpress:`` config fails at once, naming the extra (and so does one on ``stream``, whose
budget holds at every step).

    .venv/bin/python -m bench.policy_study --protocol ctx2k --fractions 0.2 \\
        --configs exact,topk:sink_window,resident:snapkv --out bench/results/policy_study/ctx2k.json
    make compare-env
    .venv-compare/bin/python -m bench.policy_study --protocol ctx2k --fractions 0.1,0.2 \\
        --configs exact,topk:sink_window,resident:snapkv,kvpress:snapkv,kvpress:knorm --out ctx2k-kvpress.json

Writes a JSON list of rows (appending to ``--out`` if it exists; each names its ``model``, ``task`` and ``method``:
the configuration, or ``kvpress:<press>``) and prints a markdown table per task (protocol, and text where not
Opticks). ``--plot A.json B.json ... --plot-out DIR`` draws quality vs budget per task (one line per configuration,
exact dashed, kvpress dotted) from such files, and prints their tables; with benchmark rows (RULER) it also prints
the leaderboard (per model: each method's score at each budget, per task and averaged over tasks, as kvpress's
leaderboard shows them) and draws ``leaderboard-<model>.png``.

    .venv/bin/python -m bench.policy_study --protocol ruler --model gemma3_270m --context 4096 --fractions 0.1,0.2,0.5 \\
        --configs exact,topk:sink_window,resident:snapkv,once:snapkv --out ruler.json
    .venv/bin/python -m bench.policy_study --plot ruler.json --plot-out docs/policy_study
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import time
from pathlib import Path

import torch

from kvtier.budget import TokenBudget
from kvtier.checks import pay_for_key_stats
from kvtier.engine import Engine, EngineConfig
from kvtier.errors import ConfigError
from kvtier.eval import Needle, Passkey, Perplexity, Ruler
from kvtier.eval.ruler import SUBTASKS
from kvtier.hook import install
from kvtier.models import kv_layout_for, load_model
from kvtier.policies import POLICIES
from kvtier.kernels.registry import make_backend
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.scopes import All, Resident, TopK
from kvtier.plot import leaderboard, plot_leaderboard
from kvtier.tiers import DeviceTier, HostTier

from kvtier.eval.kvpress import load_kvpress, press_name, run_press


def make_task(args, protocol: str, offset: int = 0):
    if protocol == "ctx2k":
        return Perplexity(text=args.text, length=args.context + args.continuation, prefix=args.context,
                          offset=offset), args.context
    if protocol == "stream":
        return Perplexity(text=args.text, length=args.length, prefix=256), args.length
    if protocol.startswith("passkey"):
        return Passkey(context_tokens=args.context, depths=args.depths, samples=args.samples,
                       question_at=protocol.split("_")[1], max_new_tokens=8), args.context
    if protocol == "needle":
        return Needle(text="lady_susan", context_tokens=args.context, depths=args.depths, samples=args.samples,
                      max_new_tokens=16), args.context
    if protocol == "ruler":
        return Ruler(length=args.context, subtasks=args.subtasks.split(","), samples_per_task=args.samples,
                     max_new_tokens=args.max_new_tokens), args.context
    raise SystemExit(f"unknown protocol {protocol!r}")


TOPK = {  # study config -> TopK's options (the default, "topk": single keys by the sketch, each kv head its own)
    "topk": {}, "topk_quest": dict(unit="page", rank="quest"), "topk_head": dict(unit="page", rank="quest_head"),
    "topk_perhead": dict(unit="page", rank="quest", per_head=True), "topk_gauss": dict(unit="page", rank="gauss"),
    "topk_gausshead": dict(unit="page", rank="gauss", per_head=True), "topk_sketch": dict(unit="page", rank="sketch"),
    "topk_sketchhead": dict(unit="page", rank="sketch", per_head=True),
}


def topk_options(scope: str, args) -> dict:
    """TopK's options of a study scope, with the command line's."""
    options = dict(TOPK[scope], query_rows=args.query_rows, policy_share=args.policy_share, sinks=args.sinks,
                   sketch_rank=args.sketch_rank if TOPK[scope].get("rank", "sketch") == "sketch" else None)
    return {k: v for k, v in options.items() if (k, v) not in (("query_rows", 1), ("policy_share", 0.0),
                                                               ("sketch_rank", None))}


def scope_recipe(config: str, budget: int, args) -> str | None:
    """The recipe overrides (``kvtier-run ...``) that run ``config`` at ``budget`` tokens as this study does: what a
    quality row and a speed row share when they are one configuration (None: a kvpress press)."""
    if config.startswith("kvpress:"):
        return None
    common = f"page_size={args.page}" + (f" kv_dtype={args.kv_dtype}" if args.kv_dtype else "")
    if config == "exact":
        return f"scope=all policy=lru {common}"
    scope, name = config.split(":")
    streaming = name == "sink_window" and scope in ("resident", "once")
    window = "null" if streaming else args.window
    parts = [f"scope={'topk' if scope in TOPK else 'resident'}", f"policy={name}", "cache.attend_budget=true",
             "cache.exact_prefill=true", f"cache.sinks={args.sinks}", f"cache.window={window}",
             f"budget.tokens={budget}", common]
    if scope == "once":
        parts.append("cache.mode=once")
    if scope in TOPK:
        parts += [f"scope.{k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}"
                  for k, v in topk_options(scope, args).items() if k != "sinks"]
    return " ".join(parts)


def engine_factory(model, layout, config: str, budget: int, args, context: int):
    """A function building a fresh engine for ``config`` at ``budget`` tokens."""
    total = layout.pages_for(context + 512) + 8
    device, kernel = args.device, make_backend(args.kernel, args.device)
    settings = EngineConfig(graphs=args.graphs, compile=args.compile)
    prefill = ChunkedPrefill(512)
    if config == "exact":
        return lambda: Engine(model, layout, [DeviceTier(layout, total, device=device), HostTier(layout, total)],
                              POLICIES["lru"](), All(), kernel=kernel, prefill=prefill, config=settings)
    scope, name = config.split(":")
    streaming = name == "sink_window" and scope in ("resident", "once")  # StreamingLLM: sinks + window only
    window = budget - args.sinks if streaming else args.window
    mode = "once" if scope == "once" else "continuous"
    tokens = TokenBudget(budget, args.sinks, window, args.page, mode)
    # resident: the device holds what a step attends; topk and once: everything (what recall attends
    # does not depend on where pages live), less what the scope's key statistics take
    dev = total if mode == "once" or scope in TOPK else tokens.step_pages

    def make():
        policy = POLICIES[name](sinks=args.sinks, window=window)
        chooser = TopK(**topk_options(scope, args)) if scope in TOPK else Resident()
        pages = pay_for_key_stats(dev, chooser, layout, total * layout.page_size, "budget")
        return Engine(model, layout, [DeviceTier(layout, pages, device=device), HostTier(layout, total)], policy,
                      chooser, kernel=kernel, prefill=prefill, budget=tokens, exact_prefill=True, config=settings)
    return make


@functools.cache
def model_for(attn: str, device: str, name: str = "smollm2", dtype: str = "float32"):
    """``(model, tokenizer)``: SmolLM2 (or packaged model ``name``) in ``dtype`` with attention ``attn`` (kvtier's
    hook; eager for kvpress, whose ObservedAttention reads the prefill's attention weights), loaded once."""
    return load_model(name, dtype=dtype, device=device, attn_implementation=attn)


def run_one(args, protocol, config, fraction, tokens=None) -> dict:
    """One row: ``config`` at ``fraction`` of the context (or ``tokens``) on ``protocol``, over its slices."""
    t0 = time.time()
    offsets = [0]
    if protocol == "ctx2k":
        offsets = [int(o) for o in args.offsets.split(",")] if args.offsets else [30000 * i for i in range(args.slices)]
    results = []
    for off in offsets:
        task, context = make_task(args, protocol, off)
        budget = tokens or int(round(fraction * context))
        if config.startswith("kvpress:"):
            model, tok = model_for("eager", args.device, args.model, args.dtype)
            results.append(run_press(task, press_name(config), budget, model, tok, args.sinks, args.window))
        else:
            model, tok = model_for(install(), args.device, args.model, args.dtype)
            layout = kv_layout_for(model.config, page_size=args.page, dtype=model.dtype, kv_dtype=args.kv_dtype)
            results.append(task.run(engine_factory(model, layout, config, budget, args, context), tok))
    streaming = config.endswith("sink_window") and not config.startswith("topk")
    kvpress = config.startswith("kvpress:")  # no pages, no window: the press keeps budget pairs
    row = {"protocol": protocol, "config": config, "budget_tokens": budget, "page": None if kvpress else args.page,
           "kv_dtype": None if kvpress else args.kv_dtype or args.dtype,
           "window": None if config == "exact" or kvpress else budget - args.sinks if streaming else args.window,
           "fraction": round(budget / context, 4), "wall_s": round(time.time() - t0, 1)}
    row["scope_recipe"] = scope_recipe(config, budget, args)
    if config.split(":")[0] in TOPK and TOPK[config.split(":")[0]].get("rank", "sketch") == "sketch":
        row["sketch_rank"] = TopK(sketch_rank=args.sketch_rank).key_stats(layout)[1]
    if kvpress:
        row["kept_tokens"] = sum(r["kept_tokens"] for r in results) / len(results)
    if "perplexity" in results[0]:
        nll = sum(r["nll_mean"] * r["scored_tokens"] for r in results) / sum(r["scored_tokens"] for r in results)
        row.update(perplexity=round(math.exp(nll), 3), per_slice=[round(r["perplexity"], 3) for r in results],
                   attended_tokens=round(sum(r["attended_tokens"] for r in results) / len(results), 1),
                   text=results[0]["text"])
    elif "score" in results[0]:  # a benchmark (RULER): its 0-100 score per subtask and their mean
        r = results[0]
        row.update(score=round(r["score"], 2), per_group={k: round(v, 2) for k, v in r["per_group"].items()},
                   samples=r["samples"], skipped=r["skipped"], context=args.context,
                   outputs=[x["output"] for x in r["records"]])
    else:
        r = results[0]
        row.update(accuracy=r["accuracy"], samples=r["samples"], per_depth=r["per_depth"],
                   outputs=[x["output"] for x in r["records"]])
    row.update(model=args.model, task=task_of(row), method=config)
    return row


def task_of(row) -> str:
    """A row's task, one table and one plot each: its protocol, and its text where that is not Opticks (a
    benchmark's: its protocol and length, ``ruler-4096``)."""
    if "context" in row:
        return f"{row['protocol']}-{row['context']}"
    return row["protocol"] if row.get("text", "opticks") == "opticks" else f"{row['protocol']}-{row['text']}"


def table(rows) -> str:
    """A markdown table per task, rows in their order."""
    out = []
    for task in dict.fromkeys(map(task_of, rows)):
        lines = [f"{task}:", "",
                 "| protocol | config | page, window | budget (tokens, fraction) | score | attended tok/step | wall s |",
                 "| --- | --- | --- | --- | ---: | ---: | ---: |"]
        for r in (r for r in rows if task_of(r) == task):
            score = f"ppl {r['perplexity']:.2f}" if "perplexity" in r else f"score {r['score']:.1f} ({r['samples']})" \
                if "score" in r else f"acc {r['accuracy']:.2f} ({r['samples']})"
            shape = f"{r.get('page', 16) or '-'}, {r.get('window') or '-'}"
            lines.append(f"| {r['protocol']} | {r['config']} | {shape} | {r['budget_tokens']} ({r['fraction']:.0%}) | "
                         f"{score} | {r.get('attended_tokens', '-')} | {r['wall_s']} |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def label(row) -> str:
    """A configuration's name in plots: config, and its window / page size / page format when not the defaults."""
    extra = []
    if row.get("window") not in (None, 64) and not row["config"].startswith(("resident:sink", "once:sink")):
        extra.append(f"w{row['window']}")
    if row.get("page", 16) not in (16, None):
        extra.append(f"p{row['page']}")
    if row.get("kv_dtype") not in (None, "float32"):
        extra.append(row["kv_dtype"])
    return row["config"] + (f" ({', '.join(extra)})" if extra else "")


def slice_error(row, exact) -> tuple[float, float]:
    """The error bar ``(below, above)`` of a pooled perplexity over its slices, paired with the exact row's: the
    standard error of the per-slice log ratio to exact, around the pooled value (0s for one slice or no exact)."""
    mine, base = row.get("per_slice") or [], (exact or {}).get("per_slice") or []
    if len(mine) < 2 or len(mine) != len(base):
        return 0.0, 0.0
    ratios = [math.log(a / b) for a, b in zip(mine, base)]
    se = statistics.stdev(ratios) / math.sqrt(len(ratios))
    return row["perplexity"] * (1 - math.exp(-se)), row["perplexity"] * (math.exp(se) - 1)


def plot(rows, out_dir: Path) -> list[Path]:
    """``quality_vs_budget-<task>.png`` per task (:func:`task_of`): score against the budget fraction; perplexity
    over several slices with error bars (:func:`slice_error`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for task in sorted(set(map(task_of, rows))):
        mine = [r for r in rows if task_of(r) == task]
        score = next(k for k in ("perplexity", "score", "accuracy") if k in mine[0])
        exact = next((r for r in mine if r["config"] == "exact"), None)
        bars = [slice_error(r, exact) if score == "perplexity" else (0.0, 0.0) for r in mine]  # per row
        fig, ax = plt.subplots(figsize=(8, 4))
        for config in sorted({label(r) for r in mine}):
            pts = sorted((r["fraction"], r[score], *bar) for r, bar in zip(mine, bars) if label(r) == config)
            if config == "exact":
                ax.axhline(pts[0][1], ls="--", color="k", label="exact")
            else:
                x, y, below, above = zip(*pts)
                ax.errorbar(x, y, yerr=[below, above] if any(below + above) else None, marker="o", capsize=3,
                            ls=":" if config.startswith("kvpress:") else "-", label=config)
        ax.set_xlabel("budget (fraction of the context: keys a step attends; kvpress: KV pairs kept)")
        ax.set_ylabel(score + (" (bars: s.e. over slices of the ratio to exact)" if any(map(any, bars)) else ""))
        ax.set_title(f"{task} ({mine[0].get('model', 'smollm2')})")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the lines, not over them
        fig.tight_layout()
        paths.append(out_dir / f"quality_vs_budget-{task}.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plot", nargs="+", default=None, help="study JSON files to plot (nothing is run)")
    p.add_argument("--plot-out", default="docs/policy_study")
    p.add_argument("--protocol")
    p.add_argument("--configs", default="exact,topk:sink_window,resident:sink_window")
    p.add_argument("--fractions", default="0.2")
    p.add_argument("--tokens", type=int, default=None, help="budget in tokens (overrides --fractions)")
    p.add_argument("--page", type=int, default=16, help="tokens per KV page")
    p.add_argument("--kv-dtype", default=None, help="the pages' format: bfloat16, float16, fp8_e4m3, int8 (default: "
                                                     "the model's float32)")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--query-rows", type=int, default=1, help="topk: score pages by the last N decode queries")
    p.add_argument("--policy-share", type=float, default=0.0, help="topk: share of the pages the policy picks")
    p.add_argument("--sketch-rank", type=int, default=None, help="topk, topk_sketch*: the sketched keys' rank "
                                                                  "(default: the scope's, head_dim / 2)")
    p.add_argument("--slices", type=int, default=3)
    p.add_argument("--offsets", default=None, help="ctx2k: token offsets of the slices (overrides --slices)")
    p.add_argument("--continuation", type=int, default=256, help="ctx2k: tokens scored after the 2,048")
    p.add_argument("--text", default="opticks")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--context", type=int, default=2048, help="ctx2k: tokens prefilled; passkey, needle: prompt tokens")
    p.add_argument("--depths", default="0.1,0.5,0.9")
    p.add_argument("--subtasks", default=",".join(s for s, (kind, _) in SUBTASKS.items() if kind != "qa"),
                   help="ruler: the subtasks (RULER's names; qa_1/qa_2 need SQuAD v2 / HotpotQA in the HF cache)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="ruler: cap on generated tokens (default: "
                                                                   "RULER's per subtask)")
    p.add_argument("--model", default="smollm2", help="smollm2 | gemma3_270m (kvtier.models.PACKAGED_MODELS)")
    p.add_argument("--dtype", default="float32", help="the model's dtype: float32 | bfloat16 | float16")
    p.add_argument("--samples", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu or cuda (the model, the device tier and the kernel)")
    p.add_argument("--kernel", default="torch", help="torch | triton")
    p.add_argument("--graphs", action="store_true", help="replay each decode step as a CUDA graph")
    p.add_argument("--compile", action="store_true", help="torch.compile the step (on a GPU; each engine compiles)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not args.plot and not args.protocol:
        p.error("--protocol is required (or --plot)")
    args.depths = [float(d) for d in args.depths.split(",")]
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.plot:
        rows = [r for f in args.plot for r in json.loads(Path(f).read_text())]
        print(table(rows))
        if any("score" in r for r in rows):
            print(leaderboard(rows))
        for path in plot(rows, Path(args.plot_out)) + plot_leaderboard(rows, Path(args.plot_out)):
            print(path)
        return
    configs = args.configs.split(",")
    presses = [press_name(c) for c in configs if c.startswith("kvpress:")]
    if presses:  # before anything runs: a named error, never a config skipped
        if args.protocol == "stream":
            raise ConfigError("protocol", "a kvpress press compresses the prefill once, a stream's budget holds at "
                                          "every step: compare presses on ctx2k (--text for another text)")
        load_kvpress()
    torch.set_num_threads(args.threads)
    rows = []
    out = Path(args.out) if args.out else None
    for fraction in [float(f) for f in args.fractions.split(",")]:
        for config in configs:
            if config == "exact" and rows and any(r["config"] == "exact" for r in rows):
                continue  # exact does not depend on the budget
            row = run_one(args, args.protocol, config, fraction, args.tokens)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if out:
                out.parent.mkdir(parents=True, exist_ok=True)
                old = json.loads(out.read_text()) if out.exists() else []
                out.write_text(json.dumps(old + [row], indent=1))
    print(table(rows))
    if any("score" in r for r in rows):
        print(leaderboard(rows))


if __name__ == "__main__":
    main()
