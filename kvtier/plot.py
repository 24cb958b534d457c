"""kvtier-plot DIR: PNG figures and a summary table from the runs (``metrics.json`` files) under a
folder, e.g. a multirun.

- ``quality_vs_budget-<task>.png``: the task's score against the device budget, one line per
  policy (and scope, when runs differ in scope); x is the budget fraction, or tokens when the runs
  set ``budget.tokens`` (the keys each decode step attends when they set ``cache.attend_budget``).
  Variants of a task get figures of their own (``perplexity-opticks``, ``passkey-question_after``);
  exact runs (scope ``all``) are a dashed line.
- ``recall_vs_budget-<task>.png``: the same axes for the attention-mass recall of runs that measured
  fidelity (``cache.fidelity``, scopes ``resident`` and ``topk``).
- ``occupancy-<run>.png``: pages in use per tier (mean over layers) at every engine step of a run,
  with each tier's capacity dashed (none for a ``method=kvpress:<press>`` run).
- ``depth_heatmap-<task>-<policy>-<scope>-<budget>.png``: for the depth tasks (needle, passkey), the
  needle-in-a-haystack heatmap (Kamradt's NIAH plot): accuracy per needle depth (y, 0% at the top) and
  context length (x, ``task.context_tokens`` of each run), pooled over the runs of each cell; one figure
  per policy, scope and budget setting (``budget.fraction`` is a fraction of each length). The grid is
  also ``depth_grid.csv`` (a row per figure, length and depth, with n and accuracy).
  ``kvtier-run experiment=needle_sweep`` runs such a sweep.
- ``leaderboard.md`` and ``leaderboard-<model>.png``: for the benchmark runs (RULER, LongBench,
  InfiniteBench: a 0-100 score), kvpress's leaderboard: per model, each method's score (``exact`` for
  scope ``all``, else ``<scope>:<policy>``) at each budget fraction, per task and length, and averaged
  over them (the table ``python -m bench.policy_study --plot`` prints from its own rows); a
  ``method=kvpress:<press>`` run is the method ``kvpress:<press>`` (dotted).
- ``summary.md`` and ``summary.csv``: per task, metric, policy, scope and budget, the mean and the
  sample standard deviation over the runs of that point (seeds, text slices: the ``over`` column
  names the task keys that differ among them), with n, min and max. Runs of several models in one
  folder get tasks (figures, rows) of their own: ``<task>-<model>``. The curves show that mean, with
  the standard deviation as error bars where a point has more than one run.

Usage: ``kvtier-plot multirun/2026-11-30_10-00-00 [--out DIR] [--x auto|fraction|tokens]``
(also ``python -m kvtier.plot DIR``). Figures and tables go to ``DIR/plots`` unless ``--out`` says otherwise.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kvtier.report import method_of  # noqa: E402

X_AXES = {"fraction": ("budget_fraction", "device budget (fraction of the context)"),
          "tokens": ("budget_tokens", "device budget (tokens)")}


def load_runs(root: Path) -> list[dict]:
    """Every run's metrics under ``root`` that has a task score, each with ``_dir`` (its folder relative to
    ``root``); the others are named on stderr and left out."""
    runs = []
    for path in sorted(Path(root).rglob("metrics.json")):
        try:
            m = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            print(f"skipping {path}: {e}", file=sys.stderr)
            continue
        if "score_name" not in m:  # a simulator run (experiment=sim_*): its own figure is in its folder
            print(f"skipping {path}: no task score (a simulator run's figure is in its folder)", file=sys.stderr)
            continue
        m["_dir"] = str(path.parent.relative_to(root)) if path.parent != Path(root) else path.parent.name
        runs.append(m)
    return runs


def pick_x(runs: list[dict], x: str) -> str:
    """``auto`` is tokens when any run set ``budget.tokens``, else fraction."""
    if x != "auto":
        return x
    return "tokens" if any(r["config"]["budget"]["tokens"] is not None for r in runs) else "fraction"


def task_label(run: dict) -> str:
    """The task's name and what tells its variants apart: the text, a question asked after the context."""
    task = run.get("config", {}).get("task", {})
    parts = [run["task"]] + ([str(task["text"])] if "text" in task else [])
    return "-".join(parts + (["question_after"] if task.get("question_at") == "after" else []))


RECALL = "attention_mass_recall"


def labeller(runs: list[dict]):
    """:func:`task_label`, with the run's model when ``runs`` hold several (each model gets figures and rows of its
    own, never pooled with another's as if they were seeds)."""
    several = len({r.get("model") for r in runs}) > 1
    return lambda r: task_label(r) + (f"-{r['model']}" if several else "")


def by_task(runs: list[dict]):
    """``(task, metric, runs)`` for each task variant's score and, where runs measured it, its attention-mass recall."""
    label = labeller(runs)
    for task in sorted({label(r) for r in runs}):
        group = [r for r in runs if label(r) == task]
        for score in sorted({r["score_name"] for r in group}):
            yield task, score, [r for r in group if r["score_name"] == score]
        if measured := [r for r in group if RECALL in r]:
            yield task, RECALL, measured


def quality_vs_budget(runs: list[dict], out: Path, x: str = "auto") -> list[Path]:
    """Per task: its score against budget (``quality_vs_budget-<task>.png``), and the attention-mass
    recall where runs measured it (``recall_vs_budget-<task>.png``); a line per policy (and scope)."""
    return [_curves(group, metric, x, out / f"recall_vs_budget-{task}.png",
                    f"{task} task: attention mass on the attended pages") if metric == RECALL else
            _curves(group, metric, x, out / f"quality_vs_budget-{task}.png", f"{task} task: {metric} vs device budget")
            for task, metric, group in by_task(runs)]


def _curves(group: list[dict], metric: str, x: str, path: Path, title: str) -> Path:
    """``metric`` against budget, a line per policy (and scope, when the runs differ in scope)."""
    key, label = X_AXES[pick_x(group, x)]
    if any(r.get("config", {}).get("cache", {}).get("attend_budget") for r in group):
        label = label.replace("device budget", "budget: keys attended per decode step")
        title = title.replace("device budget", "attended budget")
    several_scopes = len({r["scope"] for r in group}) > 1
    lines = defaultdict(list)
    for (policy, scope, budget), point in points(group, key).items():
        name = f"{policy} ({scope})" if several_scopes else policy
        lines[name].append((budget, *spread([r[metric] for r in point])))
    exact = [r[metric] for r in group if r["scope"] == "all"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, line in sorted(lines.items()):
        if several_scopes and name.endswith("(all)"):
            continue  # exact attention does not depend on the budget: the dashed line below
        xs, means, stds = zip(*sorted(line))
        ax.errorbar(xs, means, yerr=stds if any(stds) else None, marker="o", capsize=3, label=name)
    if several_scopes and exact:
        ax.axhline(sum(exact) / len(exact), color="k", linestyle="--", linewidth=1, label="exact (scope all)")
    better = "lower is better" if metric == "perplexity" else "higher is better"
    ax.set(xlabel=label, ylabel=f"{metric} ({better})", title=title)
    ax.grid(alpha=0.3)
    ax.legend(title="policy")
    return _save(fig, path)


def points(group: list[dict], key: str) -> dict[tuple, list[dict]]:
    """The runs of each point ``(policy, scope, budget)``, budget read from ``key``: its seeds or slices."""
    found = defaultdict(list)
    for r in group:
        found[(r["policy"], r["scope"], r[key])].append(r)
    return found


def spread(values: list[float]) -> tuple[float, float]:
    """``(mean, sample standard deviation)``; the deviation of a single value is 0."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def varied(group: list[dict]) -> list[str]:
    """The task keys whose values differ among ``group``'s runs (``seed``, ``offset``: what was averaged over)."""
    tasks = [r.get("config", {}).get("task", {}) for r in group]
    return sorted(k for k in set().union(*tasks) if len({json.dumps(t.get(k), sort_keys=True) for t in tasks}) > 1)


SUMMARY_COLUMNS = ["task", "metric", "policy", "scope", "budget_axis", "budget", "n", "mean", "std", "min", "max",
                   "over"]


def summary(runs: list[dict], out: Path, x: str = "auto") -> list[Path]:
    """``summary.csv`` and ``summary.md``: a row per task, metric (the score, and the attention-mass recall
    where measured), policy, scope and budget, with the mean and spread over that point's runs."""
    rows = []
    for task, metric, group in by_task(runs):
        axis = pick_x(group, x)
        for (policy, scope, budget), point in sorted(points(group, X_AXES[axis][0]).items()):
            values = [r[metric] for r in point]
            mean, std = spread(values)
            rows.append({"task": task, "metric": metric, "policy": policy, "scope": scope, "budget_axis": axis,
                         "budget": budget, "n": len(values), "mean": mean, "std": std, "min": min(values),
                         "max": max(values), "over": " ".join(varied(point))})
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, SUMMARY_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| task | metric | policy | scope | budget | n | mean ± std | min | max | over |",
             "|---|---|---|---|---|---:|---:|---:|---:|---|"]
    lines += [f"| {r['task']} | {r['metric']} | {r['policy']} | {r['scope']} | {r['budget']} ({r['budget_axis']}) | "
              f"{r['n']} | {r['mean']:.4g} ± {r['std']:.2g} | {r['min']:.4g} | {r['max']:.4g} | {r['over']} |"
              for r in rows]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return [out / "summary.md", out / "summary.csv"]


def occupancy(runs: list[dict], out: Path) -> list[Path]:
    """One figure per run: pages in use per tier over engine steps, capacities dashed."""
    written = []
    for r in (r for r in runs if "occupancy" in r):  # a kvpress run has no tiers
        occ = r["occupancy"]
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        for i, (tier, pages) in enumerate(occ["pages"].items()):
            color = f"C{i}"
            ax.plot(occ["step"], pages, label=tier, color=color)
            cap = r["capacity_pages"].get(tier)
            if cap is not None:
                ax.axhline(cap, color=color, linestyle="--", linewidth=0.8)
        ax.set(xlabel="engine step (prefill chunk or decode token)", ylabel="pages in use (mean over layers)",
               title=f"tier occupancy: {r['_dir']}")
        ax.grid(alpha=0.3)
        ax.legend(title="tier")
        written.append(_save(fig, out / f"occupancy-{r['_dir'].replace('/', '_')}.png"))
    return written


def budget_setting(run: dict) -> str:
    """The budget setting in force as the recipe gave it (``fraction=0.2``, ``tokens=256``, ``size=4MiB``): the same
    for every length of a sweep, where ``budget_tokens`` and ``budget_fraction`` follow each length."""
    budget = run["config"]["budget"]
    key = next(k for k in ("tokens", "size", "fraction") if budget.get(k) is not None)
    return f"{key}={budget[key]}"


DEPTH_GRID_COLUMNS = ["task", "policy", "scope", "budget", "length", "depth", "n", "accuracy"]


def depth_cells(runs: list[dict]) -> dict[tuple, dict[tuple[int, float], list[bool]]]:
    """``(task, policy, scope, budget) -> {(length, depth): [correct, ...]}`` over the samples of the runs whose
    task reports a depth per sample (needle, passkey); the length is each run's ``task.context_tokens``."""
    grids, label = defaultdict(lambda: defaultdict(list)), labeller(runs)
    for r in runs:
        records = r.get("task_result", {}).get("records", [])
        if not records or "depth" not in records[0]:
            continue
        length, cells = r["config"]["task"]["context_tokens"], grids[label(r), r["policy"], r["scope"],
                                                                     budget_setting(r)]
        for rec in records:
            cells[length, float(rec["depth"])].append(bool(rec["correct"]))
    return grids


def depth_heatmaps(runs: list[dict], out: Path) -> list[Path]:
    """Per task, policy, scope and budget setting: accuracy over needle depth (rows, 0 at the top) x context length
    (columns) as a heatmap, each cell's value written in it (``depth_heatmap-*.png``), and every cell in
    ``depth_grid.csv``."""
    grids = depth_cells(runs)
    if not grids:
        return []
    rows, written = [], []
    for (task, policy, scope, budget), cells in sorted(grids.items()):
        lengths = sorted({length for length, _ in cells})
        depths = sorted({depth for _, depth in cells})
        acc = [[statistics.fmean(cells[l, d]) if (l, d) in cells else float("nan") for l in lengths]
               for d in depths]  # [depth, length]
        rows += [{"task": task, "policy": policy, "scope": scope, "budget": budget, "length": l, "depth": d,
                  "n": len(cells[l, d]), "accuracy": statistics.fmean(cells[l, d])}
                 for l in lengths for d in depths if (l, d) in cells]
        fig, ax = plt.subplots(figsize=(max(4.8, 2.0 + 0.8 * len(lengths)), max(3.2, 1.4 + 0.35 * len(depths))))
        image = ax.imshow(acc, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        for i, line in enumerate(acc):
            for j, value in enumerate(line):
                if value == value:  # not nan: a cell that ran
                    ax.text(j, i, f"{value:.0%}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(lengths)), [str(l) for l in lengths], rotation=45 if len(lengths) > 6 else 0)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set(xlabel="context length (tokens)", ylabel="needle depth (% of the context)",
               title=f"{task}: {policy} ({scope})\nbudget.{budget}")
        fig.colorbar(image, ax=ax, label="accuracy")
        written.append(_save(fig, out / f"depth_heatmap-{task}-{policy}-{scope}-{budget.replace('=', '')}.png"))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "depth_grid.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, DEPTH_GRID_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return [out / "depth_grid.csv", *written]


def method(run: dict) -> str:
    """A run's method: its ``method`` (``kvpress:<press>``, or :func:`kvtier.report.method_of`, which also names the
    runs of an older kvtier that did not write it)."""
    return run.get("method") or method_of(run["scope"], run["policy"], run["config"].get("cache", {}))


def leaderboard_rows(runs: list[dict]) -> list[dict]:
    """The benchmark runs (a 0-100 ``score``: RULER, LongBench, InfiniteBench) as :func:`leaderboard` rows: model,
    task (``ruler-4096``: its name and length), method (:func:`method`), budget fraction (the recipe's
    ``budget.fraction``, else the budget's share of the context), score (the mean over the runs of that cell)."""
    cells = defaultdict(list)
    for r in runs:
        if r["score_name"] != "score":
            continue
        budget = r["config"]["budget"]
        fraction = budget["fraction"] if budget_setting(r).startswith("fraction") else round(r["budget_fraction"], 4)
        task = "-".join(str(p) for p in (r["task"], r["config"]["task"].get("length")) if p is not None)
        cells[r.get("model", "model"), task, method(r), fraction].append(r["score"])
    return [{"model": model, "task": task, "config": config, "method": config, "fraction": fraction,
             "score": statistics.fmean(scores), "runs": len(scores)}
            for (model, task, config, fraction), scores in cells.items()]


def leaderboard(rows) -> str:
    """Per model, a markdown table of each method's benchmark score (0-100) at each budget fraction: per task and
    averaged over the tasks (the full cache, ``exact``, at every budget; a method's average only over the tasks
    that ran it at that budget)."""
    bench = [r for r in rows if "score" in r]
    out = []
    for model in dict.fromkeys(r.get("model", "smollm2") for r in bench):
        mine = [r for r in bench if r.get("model", "smollm2") == model]
        tasks = list(dict.fromkeys(r["task"] for r in mine))
        fractions = sorted({r["fraction"] for r in mine if r["config"] != "exact"})
        cells = {}
        for r in mine:
            for f in fractions if r["config"] == "exact" else [r["fraction"]]:
                cells[(r["config"], r["task"], f)] = r["score"]
        head = [f"{t} @{f:.0%}" for t in tasks for f in fractions] + [f"average @{f:.0%}" for f in fractions]
        lines = [f"{model}:", "", "| method | " + " | ".join(head) + " |", "| --- |" + " ---: |" * len(head)]
        for config in dict.fromkeys(r["config"] for r in mine):
            values = [cells.get((config, t, f)) for t in tasks for f in fractions]
            means = [statistics.fmean(v) if (v := [cells[(config, t, f)] for t in tasks if (config, t, f) in cells])
                     else None for f in fractions]
            lines.append(f"| {config} | " + " | ".join("-" if v is None else f"{v:.1f}" for v in values + means) + " |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def plot_leaderboard(rows, out_dir: Path) -> list[Path]:
    """``leaderboard-<model>.png``: score against the budget fraction, a panel per task and one averaged over the
    tasks, a line per method (exact dashed, kvpress dotted), as kvpress's leaderboard plot."""
    bench, paths = [r for r in rows if "score" in r], []
    for model in sorted({r.get("model", "smollm2") for r in bench}):
        mine = [r for r in bench if r.get("model", "smollm2") == model]
        tasks = sorted({r["task"] for r in mine})
        fig, axes = plt.subplots(1, len(tasks) + 1, figsize=(4.2 * (len(tasks) + 1), 4), squeeze=False)
        for ax, task in zip(axes[0], tasks + ["average"]):
            group = mine if task == "average" else [r for r in mine if r["task"] == task]
            for config in sorted({r["config"] for r in group}):
                points = {}
                for r in (r for r in group if r["config"] == config):
                    points.setdefault(r["fraction"], []).append(r["score"])
                if config == "exact":
                    ax.axhline(statistics.fmean(v for vs in points.values() for v in vs), ls="--", color="k",
                               label="exact (full cache)")
                    continue
                x = sorted(points)
                ax.plot(x, [statistics.fmean(points[f]) for f in x], marker="o", label=config,
                        ls=":" if config.startswith("kvpress:") else "-")
            ax.set(title=task if task != "average" else f"average over {len(tasks)} tasks", ylim=(0, 100),
                   xlabel="budget (fraction of the context)", ylabel="score (0-100)")
            ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
        fig.suptitle(f"{model}: score vs budget")
        paths.append(_save(fig, out_dir / f"leaderboard-{model}.png"))
    return paths


def benchmark_leaderboard(runs: list[dict], out: Path) -> list[Path]:
    """``leaderboard.md`` (:func:`leaderboard`) and ``leaderboard-<model>.png`` (:func:`plot_leaderboard`) of the
    benchmark runs, none without them."""
    rows = leaderboard_rows(runs)
    if not rows:
        return []
    out.mkdir(parents=True, exist_ok=True)
    (out / "leaderboard.md").write_text(leaderboard(rows) + "\n")
    return [out / "leaderboard.md", *plot_leaderboard(rows, out)]


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    """Console script ``kvtier-plot``."""
    parser = argparse.ArgumentParser(prog="kvtier-plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="a multirun folder (or any folder holding runs' metrics.json)")
    parser.add_argument("--out", type=Path, help="where the PNGs and tables go (default: DIR/plots)")
    parser.add_argument("--x", choices=["auto", *X_AXES], default="auto", help="budget axis (default: auto)")
    args = parser.parse_args(argv)
    runs = load_runs(args.dir)
    if not runs:
        parser.error(f"no metrics.json with a task score under {args.dir}; point it at a kvtier-run output or "
                     "multirun folder")
    out = args.out or args.dir / "plots"
    for path in summary(runs, out, args.x) + quality_vs_budget(runs, out, args.x) + depth_heatmaps(runs, out) + \
            benchmark_leaderboard(runs, out) + occupancy(runs, out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
