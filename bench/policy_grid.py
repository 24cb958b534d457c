"""The ``experiment=policy_study`` grid (160 runs) as ``--workers`` parallel ``python -m kvtier.run`` multiruns on one
machine (one process per task x scope x policy, fractions swept inside), timed, every run's metrics.json in one table:

    python -m bench.policy_grid --workers 8 --device cuda model.path=/tmp/smollm2/hf --json $OUT/policy_grid.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from bench.common import write_json

EPILOG = """\
Each worker gets cores // workers CPU threads (cpu_threads=, OMP/MKL, Inductor's compile workers). On a GPU the
recipe's defaults already give the Triton kernel (kernel: auto) and a CUDA-graph replay per decode step
(engine.graphs: null with cache.fidelity: false) plus torch.compile (engine.compile: null); the table's kernel
column says what ran ("+ graphs": CUDA graphs). Runs land in <--out>/<block>/<job>-<run name>/metrics.json,
the workers' logs in <--out>/logs.

A CPU smoke run (tiny task sizes as extra overrides):
    python -m bench.policy_grid --workers 2 --tasks opticks --scopes resident --policies sink_window,snapkv \\
        --fractions 0.2 task.length=160 task.prefix=128 cache.window=16 --json /tmp/grid.json
Calls of at most 10 minutes: --stop-after 480 --out multirun/grid, then --resume --out multirun/grid (the table
sums the calls' wall times).
"""
ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "kvtier" / "recipes" / "experiment" / "policy_study.yaml"
AXES = {"task": "task", "scope": "scope", "policy": "policy", "fraction": "budget.fraction"}  # name -> override key
# Most decode steps first (perplexity: 256 teacher-forced tokens; passkey after: the question fed token by token),
# so that the longest blocks do not start last.
HEAVY_FIRST = ("study/opticks", "study/lady_susan", "study/passkey_after", "study/needle", "study/passkey_inside")


def recipe_axes() -> dict[str, list[str]]:
    """The recipe's sweep, ``{axis: [values]}`` in its order (axis names of :data:`AXES`)."""
    params = OmegaConf.load(RECIPE).hydra.sweeper.params
    keys = {v: k for k, v in AXES.items()}
    return {keys[k]: [s.strip() for s in str(v).split(",")] for k, v in params.items()}


def pick(axis: str, values: list[str], wanted: str | None) -> list[str]:
    """``values`` of ``axis`` named in the comma list ``wanted`` (None: all), in ``wanted``'s order; a task may be
    named without ``study/``, a fraction as any float spelling of the recipe's."""
    if not wanted:
        return values
    out = []
    for w in (s.strip() for s in wanted.split(",") if s.strip()):
        match = [v for v in values if v == w or (axis == "task" and v == f"study/{w}")
                 or (axis == "fraction" and _float(v) == _float(w))]
        if not match:
            raise SystemExit(f"policy_grid: {axis} {w!r} is not in the recipe's {axis} axis {values}")
        out += [m for m in match if m not in out]
    return out


def _float(s: str) -> float | None:
    try:
        return float(s)
    except ValueError:
        return None


def blocks(axes: dict[str, list[str]], split: list[str]) -> list[dict[str, list[str]]]:
    """The grid cut into products: one block per combination of the ``split`` axes' values, the other axes whole.
    Every combination of ``axes`` is in exactly one block. Heavy tasks first (:data:`HEAVY_FIRST`)."""
    fixed = [[(a, [v]) for v in axes[a]] for a in split]
    return heavy_first([{a: dict(combo).get(a, axes[a]) for a in axes} for combo in itertools.product(*fixed)])


def heavy_first(parts: list[dict]) -> list[dict]:
    rank = {t: i for i, t in enumerate(HEAVY_FIRST)}
    return sorted(parts, key=lambda b: min(rank.get(t, len(rank)) for t in b["task"]))  # stable: recipe order within


def missing_blocks(axes: dict[str, list[str]], split: list[str], done: set[tuple]) -> list[dict[str, list[str]]]:
    """Blocks covering exactly the combinations of ``axes`` not in ``done`` (keys of :func:`key`): a split block
    with nothing done is kept whole, one partly done becomes one block per remaining combination of all axes but
    the last (the last axis' missing values swept)."""
    out = []
    for b in blocks(axes, split):
        todo = [c for c in combos(b) if key(dict(zip(b, c))) not in done]
        if len(todo) == len(combos(b)):
            out.append(b)
            continue
        groups: dict[tuple, list[str]] = {}
        for c in todo:
            groups.setdefault(c[:-1], []).append(c[-1])
        out += [{**{a: [v] for a, v in zip(b, head)}, list(b)[-1]: last} for head, last in groups.items()]
    return heavy_first(out)


def key(combo: dict[str, str]) -> tuple:
    """A combination's identity: task with ``study/``, scope, policy, fraction as a float."""
    task = combo["task"] if combo["task"].startswith("study/") else f"study/{combo['task']}"
    return task, combo["scope"], combo["policy"], float(combo["fraction"])


def block_name(block: dict[str, list[str]]) -> str:
    """The block's single-valued axes' values, joined (unique among the blocks of a partition)."""
    return "-".join(v[0].removeprefix("study/") for v in block.values() if len(v) == 1) or "all"


def combos(block: dict[str, list[str]]) -> list[tuple[str, ...]]:
    return list(itertools.product(*block.values()))


def command(block: dict, sweep_dir: Path, threads: int, extra: list[str]) -> list[str]:
    """One worker: ``python -m kvtier.run experiment=policy_study`` sweeping its block (explicit params)."""
    given = {o.split("=", 1)[0].lstrip("+~") for o in extra}
    defaults = [o for o in ("logger=none", f"cpu_threads={threads}") if o.split("=")[0] not in given]
    sweep = [f"{AXES[a]}={','.join(v)}" for a, v in block.items()]
    return [sys.executable, "-m", "kvtier.run", "experiment=policy_study", *sweep, *defaults, *extra,
            f"hydra.sweep.dir={sweep_dir}"]


def worker_env(threads: int) -> dict:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS"):
        env[var] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def launch(jobs: list[tuple[str, list[str]]], workers: int, env: dict, logs: Path,
           stop_after: float | None = None) -> list[dict]:
    """Run ``jobs`` (name, argv) ``workers`` at a time, in order as slots free up; each one's output appended to
    ``logs/<name>.log``. None starts after ``stop_after`` seconds (the running ones finish). Ctrl-C or SIGTERM
    stops the running ones with SIGTERM (kvtier-run writes what finished, marked partial) and starts no more."""
    logs.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    pending, running, done = list(jobs), {}, []

    def record(name, argv, rc, t0, **extra):
        done.append({"block": name, "rc": rc, "seconds": round(time.perf_counter() - t0, 2),
                     "command": " ".join(argv[1:]), **extra})

    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        while pending or running:
            if stop_after is not None and pending and time.perf_counter() - t_start > stop_after:
                print(f"policy_grid: --stop-after {stop_after:g} s passed; {len(pending)} blocks not started",
                      flush=True)
                done += [{"block": n, "rc": None, "seconds": 0.0, "command": " ".join(v[1:]), "not_started": True}
                         for n, v in pending]
                pending = []
            while pending and len(running) < workers:
                name, argv = pending.pop(0)
                log = open(logs / f"{name}.log", "a")
                log.write(" ".join(argv) + "\n\n")
                log.flush()
                proc = subprocess.Popen(argv, cwd=os.getcwd(), env=env, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL)
                running[proc.pid] = (name, argv, proc, log, time.perf_counter())
            time.sleep(0.2)
            for pid, (name, argv, proc, log, t0) in list(running.items()):
                if proc.poll() is None:
                    continue
                log.close()
                del running[pid]
                record(name, argv, proc.returncode, t0)
                status = "ok" if proc.returncode == 0 else f"FAILED rc {proc.returncode}, see {logs / name}.log"
                finished = sum("not_started" not in d for d in done)
                print(f"[{finished}/{len(jobs)}] {name}: {done[-1]['seconds']:.0f} s, {status} "
                      f"({time.perf_counter() - t_start:.0f} s in)", flush=True)
    except KeyboardInterrupt:
        print(f"policy_grid: stopping {len(running)} running workers", file=sys.stderr)
        for name, argv, proc, log, t0 in running.values():
            proc.terminate()
        for name, argv, proc, log, t0 in running.values():
            proc.wait()
            log.close()
            record(name, argv, proc.returncode, t0, stopped=True)
        done += [{"block": n, "rc": None, "seconds": 0.0, "command": " ".join(v[1:]), "not_started": True}
                 for n, v in pending]
    finally:
        signal.signal(signal.SIGTERM, previous)
    return done


def overrides_of(run: Path) -> dict[str, str]:
    """``key -> value`` of a run's command line (Hydra's ``.hydra/overrides.yaml``)."""
    lines = OmegaConf.load(run / ".hydra" / "overrides.yaml")
    return dict(str(o).split("=", 1) for o in lines)


def graphs_on(m: dict) -> bool:
    """Did the run's decode steps replay CUDA graphs (``engine.graphs``, else the engine's default: on a GPU with
    a kernel other than the torch reference, unless fidelity is measured)?"""
    cfg = m["config"]
    if cfg["engine"]["graphs"] is not None:
        return bool(cfg["engine"]["graphs"])
    return str(cfg["model"]["device"]).startswith("cuda") and m["kernel"] != "torch" and not cfg["cache"]["fidelity"]


def collect(out: Path) -> list[dict]:
    """One row per combination with a ``metrics.json`` under ``out/<block>/<job>/``: a complete run over a partial
    one, else the latest."""
    best = {}
    for path in sorted(out.glob("*/*/metrics.json"), key=lambda p: p.stat().st_mtime):
        m, o = json.loads(path.read_text()), overrides_of(path.parent)
        row = {
            "task": o["task"].removeprefix("study/"), "scope": o["scope"], "policy": o["policy"],
            "fraction": float(o["budget.fraction"]), "score_name": m["score_name"], "score": m[m["score_name"]],
            "seconds": m["wall_s"], "budget_tokens": m["budget_tokens"],
            "attended_tokens_per_step": m["attended_tokens_per_step"], "decode_steps": m["decode_steps"],
            "ttft_s": m["ttft_s"], "tpot_p50_s": m["tpot_p50_s"], "kernel": m["kernel"],
            "device": m["config"]["model"]["device"], "graphs": graphs_on(m),
            "partial": m["partial"], "run": str(path.parent.relative_to(out)),
        }
        k = key(row)
        if k not in best or best[k]["partial"] or not row["partial"]:
            best[k] = row
    axes = recipe_axes()
    rank = {a: {v.removeprefix("study/"): i for i, v in enumerate(HEAVY_FIRST if a == "task" else axes[a])}
            for a in ("task", "scope", "policy")}  # the recipe's order, heavy tasks first
    return sorted(best.values(), key=lambda r: (*((rank[a].get(r[a], len(rank[a])), r[a]) for a in rank),
                                                r["fraction"]))


def markdown(rows: list[dict]) -> str:
    short = {"perplexity": "ppl", "accuracy": "acc"}
    head = "| task | scope | policy | fraction | budget tokens | quality | attended/step | decode steps | kernel | s |"
    lines = [head, "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for r in rows:
        score = r["score"]
        q = f"{short.get(r['score_name'], r['score_name'])} {score:.4g}" if isinstance(score, (int, float)) else "-"
        att = "-" if r["attended_tokens_per_step"] is None else f"{r['attended_tokens_per_step']:.1f}"
        lines.append(f"| {r['task']} | {r['scope']} | {r['policy']} | {r['fraction']:g} | {r['budget_tokens']} | {q}"
                     f"{' (partial)' if r['partial'] else ''} | {att} | {r['decode_steps']} | {r['kernel']}"
                     f"{' + graphs' if r['graphs'] else ''} | "
                     f"{r['seconds']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter,
                                 epilog=EPILOG)
    ap.add_argument("--workers", type=int, default=2, help="kvtier-run processes at a time (default 2)")
    ap.add_argument("--device", default="auto",
                    help="model.device for every run: auto (cuda when present) | cpu | cuda")
    ap.add_argument("--tasks", help="comma list, a subset of the recipe's (opticks,lady_susan,passkey_inside,"
                                    "passkey_after,needle; study/ optional)")
    ap.add_argument("--scopes", help="comma list: topk,resident")
    ap.add_argument("--policies", help="comma list: sink_window,snapkv,h2o,tova")
    ap.add_argument("--fractions", help="comma list: 0.05,0.1,0.2,0.5")
    ap.add_argument("--split", default="task,scope,policy",
                    help="axes whose every combination is one process (the others swept inside it); "
                         "default task,scope,policy; '' = one process for the whole subset")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads per worker (default cores // workers)")
    ap.add_argument("--out", default=None, help="folder of the runs (default multirun/policy_grid-<time>)")
    ap.add_argument("--resume", action="store_true", help="with --out of an earlier call: run only the "
                                                          "combinations without a complete metrics.json there")
    ap.add_argument("--stop-after", type=float, default=None,
                    help="start no block after this many seconds (the running ones finish); --resume goes on")
    ap.add_argument("--json", default="policy_grid.json", help="the table's file ($OUT/NAME, else bench/results/NAME; "
                                                               "an absolute path as given)")
    ap.add_argument("--dry-run", action="store_true", help="print the workers' command lines only")
    ap.add_argument("overrides", nargs="*", help="extra kvtier-run overrides for every run (model.path=..., engine.*)")
    args = ap.parse_args(argv)
    if args.workers < 1:
        ap.error("--workers must be >= 1")
    if args.resume and not args.out:
        ap.error("--resume needs the --out of the earlier call")
    recipe = recipe_axes()
    wanted = {"task": args.tasks, "scope": args.scopes, "policy": args.policies, "fraction": args.fractions}
    axes = {a: pick(a, recipe[a], wanted[a]) for a in recipe}
    split = [s.strip() for s in args.split.split(",") if s.strip()]
    if unknown := [s for s in split if s not in AXES]:
        ap.error(f"--split: {unknown} not among {list(AXES)}")
    for o in args.overrides:
        if "=" not in o or o.split("=", 1)[0].lstrip("+~") in (*AXES.values(), "experiment", "hydra.sweep.dir"):
            ap.error(f"override {o!r}: give key=value, not the grid's axes (use --tasks etc.) or the sweep folder")
    extra = list(args.overrides) + ([f"model.device={args.device}"] if args.device != "auto" else [])
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.workers)
    out = Path(args.out or f"multirun/policy_grid-{time.strftime('%Y-%m-%d_%H-%M-%S')}").absolute()
    n_runs = math.prod(len(v) for v in axes.values())
    wanted_keys = {key(dict(zip(axes, c))) for c in itertools.product(*axes.values())}
    done_before = {key(r) for r in collect(out) if not r["partial"]} & wanted_keys if args.resume and out.is_dir() \
        else set()
    parts = missing_blocks(axes, split, done_before)
    jobs = [(block_name(b), command(b, out / block_name(b), threads, extra)) for b in parts]
    print(f"policy_grid: {n_runs - len(done_before)} of {n_runs} runs in {len(jobs)} processes, {args.workers} at a "
          f"time, {threads} CPU threads each, under {out}", flush=True)
    if args.dry_run:
        print("\n".join(" ".join(argv) for _, argv in jobs))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    procs = launch(jobs, args.workers, worker_env(threads), out / "logs", args.stop_after)
    wall = time.perf_counter() - t0
    calls_file = out / "calls.json"
    calls = json.loads(calls_file.read_text()) if calls_file.is_file() else []
    calls.append({"wall_s": wall, "runs_planned": n_runs - len(done_before), "processes": len(jobs),
                  "workers": args.workers, "when": time.strftime("%Y-%m-%d %H:%M:%S")})
    calls_file.write_text(json.dumps(calls, indent=1))
    rows = [r for r in collect(out) if key(r) in wanted_keys]
    failed = [p["block"] for p in procs if p["rc"] not in (0, None)]
    missing = sorted(wanted_keys - {key(r) for r in rows if not r["partial"]})
    print(markdown(rows))
    run_s = sum(r["seconds"] for r in rows)
    total = sum(c["wall_s"] for c in calls)
    print(f"\n{n_runs - len(missing)}/{n_runs} runs complete; this call "
          f"{wall:.1f} s wall" + (f", {total:.1f} s ({total / 60:.1f} min) over {len(calls)} calls" if len(calls) > 1
                                  else f" ({wall / 60:.1f} min)") +
          f"; the runs' own seconds sum to {run_s:.0f}" + (f"; FAILED: {', '.join(failed)}" if failed else "") +
          (f"; {len(missing)} missing (rerun with --resume --out {out})" if missing else ""))
    path = write_json(args.json, {
        "wall_s": wall, "wall_s_all_calls": total, "calls": calls, "runs_expected": n_runs,
        "runs_complete": n_runs - len(missing), "workers": args.workers, "threads": threads, "device": args.device,
        "split": split, "overrides": extra, "out": str(out), "axes": axes, "processes": procs, "failed": failed,
        "missing": [list(k) for k in missing], "rows": rows,
    })
    print(f"wrote {path}")
    return 0 if not failed and not missing else 1


if __name__ == "__main__":
    sys.exit(main())
