"""kvtier-plot on synthetic run folders: curves per policy, occupancy per run, valid PNGs."""

import json
import math
import subprocess
import sys

import pytest

import csv
import statistics

import matplotlib.pyplot as plt
from matplotlib.container import ErrorbarContainer

from kvtier import plot
from kvtier.plot import load_runs, main, pick_x

PNG = b"\x89PNG\r\n\x1a\n"


def fake_run(root, name, policy, fraction, score, tokens=None, task="perplexity", scope="resident", recall=None):
    """A run folder holding the metrics.json fields kvtier-plot reads."""
    steps = list(range(10))
    score_name = "perplexity" if task == "perplexity" else "accuracy"
    m = {"task": task, "policy": policy, "scope": scope, "score_name": score_name, score_name: score,
         "budget_fraction": fraction, "budget_tokens": int(fraction * 1024),
         "capacity_pages": {"device": 16, "host": 64},
         "occupancy": {"step": steps, "pages": {"device": [min(s + 1, 16) for s in steps], "host": [s for s in steps]}},
         "config": {"budget": {"tokens": tokens, "fraction": None if tokens else fraction}}}
    if recall is not None:
        m["attention_mass_recall"] = recall
    (root / name).mkdir(parents=True)
    (root / name / "metrics.json").write_text(json.dumps(m))


@pytest.fixture
def sweep(tmp_path):
    for i, (policy, base) in enumerate([("lru", 30.0), ("sink_window", 25.0), ("aspe", 20.0)]):
        for j, fraction in enumerate([0.1, 0.25, 0.5]):
            name = f"{3 * i + j}-perplexity-{policy}-frac{fraction}"
            fake_run(tmp_path, name, policy, fraction, base / (1 + fraction))
    return tmp_path


def test_curves_and_occupancy_pngs_from_a_multirun_folder(sweep, capsys):
    assert main([str(sweep)]) == 0
    pngs = sorted((sweep / "plots").glob("*.png"))
    assert len(pngs) == 1 + 9 and (sweep / "plots" / "quality_vs_budget-perplexity.png") in pngs
    assert all(p.read_bytes().startswith(PNG) and p.stat().st_size > 5000 for p in pngs)
    assert capsys.readouterr().out.split() == [str(p) for p in [sweep / "plots" / "summary.md", sweep / "plots" / "summary.csv",
                                                               sweep / "plots" / "quality_vs_budget-perplexity.png",
                                                               *sorted((sweep / "plots").glob("occupancy-*.png"))]]


def test_one_curve_figure_per_task_and_the_token_axis_when_runs_set_tokens(tmp_path):
    fake_run(tmp_path, "a", "lru", 0.25, 0.6, tokens=256, task="passkey", recall=0.7)
    fake_run(tmp_path, "b", "lru", 0.5, 0.9, tokens=512, task="passkey", recall=0.9)
    fake_run(tmp_path, "c", "aspe", 0.25, 12.0)
    runs = load_runs(tmp_path)
    assert pick_x(runs, "auto") == "tokens" and pick_x(runs[2:], "auto") == "fraction"
    assert main([str(tmp_path), "--out", str(tmp_path / "figs")]) == 0
    assert {p.name for p in (tmp_path / "figs").glob("quality*.png")} == \
        {"quality_vs_budget-passkey.png", "quality_vs_budget-perplexity.png"}
    assert [p.name for p in (tmp_path / "figs").glob("recall*.png")] == ["recall_vs_budget-passkey.png"]


def test_a_folder_without_runs_is_an_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path)])
    assert exc.value.code == 2 and "no metrics.json" in capsys.readouterr().err


def test_a_simulator_run_beside_task_runs_is_left_out_by_name(sweep, capsys):
    """An ``experiment=sim_*`` run's metrics.json has no task score: named on stderr and left out (a
    KeyError before), and alone it is the no-runs error."""
    sim = sweep / "sim" / "metrics.json"
    sim.parent.mkdir()
    sim.write_text(json.dumps({"task": "sim_seed", "run_name": "sim", "wall_s": 1.0, "task_result": {}, "config": {}}))
    assert main([str(sweep)]) == 0
    assert f"skipping {sim}: no task score" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main([str(sim.parent)])
    assert exc.value.code == 2 and "no metrics.json with a task score" in capsys.readouterr().err


def test_python_dash_m_entry(sweep):
    proc = subprocess.run([sys.executable, "-m", "kvtier.plot", str(sweep), "--x", "fraction"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (sweep / "plots" / "quality_vs_budget-perplexity.png").read_bytes().startswith(PNG)


def test_task_variants_get_their_own_figures(tmp_path):
    for i, (question_at, scope, fraction) in enumerate([("inside", "topk", 0.2), ("after", "topk", 0.2),
                                                         ("after", "topk", 0.5), ("after", "all", 1.0)]):
        fake_run(tmp_path, f"r{i}", "sink_window", fraction, 0.5 + fraction / 2, task="passkey", scope=scope)
        path = tmp_path / f"r{i}" / "metrics.json"
        m = json.loads(path.read_text())
        m["config"].update(task={"question_at": question_at}, cache={"attend_budget": scope != "all"})
        path.write_text(json.dumps(m))
    assert main([str(tmp_path)]) == 0
    names = {p.name for p in (tmp_path / "plots").glob("quality_vs_budget-*.png")}
    assert names == {"quality_vs_budget-passkey.png", "quality_vs_budget-passkey-question_after.png"}


@pytest.fixture
def seeds(tmp_path):
    """passkey accuracy of 2 policies x 2 budgets x 3 seeds, and one perplexity slice per offset."""
    for policy, base in [("lru", 0.2), ("aspe", 0.5)]:
        for fraction in [0.1, 0.5]:
            for seed in range(3):
                name = f"passkey-{policy}-{fraction}-s{seed}"
                fake_run(tmp_path, name, policy, fraction, base + fraction + 0.1 * seed, task="passkey")
                _set_task(tmp_path / name, {"seed": seed, "depths": [0.5]})
    for offset, ppl in [(0, 10.0), (2304, 14.0)]:
        fake_run(tmp_path, f"ppl-{offset}", "aspe", 0.1, ppl)
        _set_task(tmp_path / f"ppl-{offset}", {"offset": offset})
    return tmp_path


def _set_task(folder, task):
    m = json.loads((folder / "metrics.json").read_text())
    m["config"]["task"] = task
    (folder / "metrics.json").write_text(json.dumps(m))


def test_summary_table_has_mean_and_spread_over_seeds_and_slices(seeds):
    assert main([str(seeds)]) == 0
    rows = list(csv.DictReader(open(seeds / "plots" / "summary.csv")))
    assert [(r["task"], r["policy"], r["budget"], r["n"], r["over"]) for r in rows] == [
        ("passkey", "aspe", "0.1", "3", "seed"), ("passkey", "aspe", "0.5", "3", "seed"),
        ("passkey", "lru", "0.1", "3", "seed"), ("passkey", "lru", "0.5", "3", "seed"),
        ("perplexity", "aspe", "0.1", "2", "offset")]
    aspe = [0.5 + 0.1 + 0.1 * s for s in range(3)]
    assert float(rows[0]["mean"]) == pytest.approx(statistics.fmean(aspe))
    assert float(rows[0]["std"]) == pytest.approx(0.1)
    assert (float(rows[0]["min"]), float(rows[0]["max"])) == pytest.approx((0.6, 0.8))
    assert float(rows[4]["mean"]) == pytest.approx(12.0) and float(rows[4]["std"]) == pytest.approx(2 ** 1.5)
    md = (seeds / "plots" / "summary.md").read_text().splitlines()
    assert len(md) == 2 + len(rows)
    assert md[-1] == "| perplexity | perplexity | aspe | resident | 0.1 (fraction) | 2 | 12 ± 2.8 | 10 | 14 | offset |"


def test_curves_show_the_spread_as_error_bars(seeds, monkeypatch):
    figures = []
    monkeypatch.setattr(plot, "_save", lambda fig, path: figures.append(fig) or path)
    plot.quality_vs_budget(load_runs(seeds), seeds / "plots")
    passkey, perplexity = figures
    bars = [c for c in passkey.axes[0].containers if isinstance(c, ErrorbarContainer)]
    assert len(bars) == 2 and all(c.has_yerr for c in bars)
    _, caps, (segments,) = bars[0]
    assert [s[1, 1] - s[0, 1] for s in segments.get_segments()] == pytest.approx([0.2, 0.2])  # 2 std = 0.2 each
    for fig in figures:
        plt.close(fig)


def test_the_study_plot_bars_are_the_slices_spread_of_the_ratio_to_exact(tmp_path):
    """``bench.policy_study``'s plot: a pooled perplexity's bar is the standard error over slices of its log ratio to
    the exact row's slices, so a row that loses the same share on every slice has none, however the slices differ."""
    from bench.policy_study import plot, slice_error

    exact = {"config": "exact", "protocol": "ctx2k", "fraction": 0.1, "perplexity": 20.0, "per_slice": [10, 20, 40]}
    even = {**exact, "config": "topk:sink_window", "perplexity": 22.0, "per_slice": [11, 22, 44]}
    uneven = {**exact, "config": "resident:h2o", "perplexity": 21.0, "per_slice": [11, 20, 40]}
    assert slice_error(even, exact) == pytest.approx((0.0, 0.0), abs=1e-12)
    se = statistics.stdev([math.log(1.1), 0.0, 0.0]) / math.sqrt(3)
    assert slice_error(uneven, exact) == pytest.approx((21 * (1 - math.exp(-se)), 21 * (math.exp(se) - 1)))
    assert slice_error({**uneven, "per_slice": [11]}, {**exact, "per_slice": [10]}) == (0.0, 0.0)
    assert slice_error(uneven, None) == (0.0, 0.0)
    assert [p.name for p in plot([exact, even, uneven], tmp_path)] == ["quality_vs_budget-ctx2k.png"]


def depth_run(root, name, policy, length, correct, fraction=0.2, task="needle"):
    """A needle (or passkey) run at ``length`` tokens whose samples are ``correct``: ``{depth: [bool, ...]}``."""
    records = [{"depth": d, "correct": c} for d, cs in correct.items() for c in cs]
    score = sum(r["correct"] for r in records) / len(records)
    m = {"task": task, "policy": policy, "scope": "topk", "score_name": "accuracy", "accuracy": score,
         "budget_fraction": int(fraction * length) / length, "budget_tokens": int(fraction * length),
         "capacity_pages": {"device": 16}, "occupancy": {"step": [0], "pages": {"device": [1]}},
         "task_result": {"task": task, "records": records},
         "config": {"budget": {"tokens": None, "size": None, "fraction": fraction},
                    "task": {"context_tokens": length, **({"text": "lady_susan"} if task == "needle" else {})}}}
    (root / name).mkdir(parents=True)
    (root / name / "metrics.json").write_text(json.dumps(m))


def test_depth_heatmap_is_depth_by_length_per_policy_and_budget(tmp_path, monkeypatch):
    """``depth_heatmap-*.png``: a figure per policy and budget setting (the fraction of every length alike), rows
    the depths (0 at the top), columns the lengths, each cell the accuracy pooled over its runs (two seeds at
    1024 here); ``depth_grid.csv`` the same cells; a perplexity run beside them draws none."""
    depth_run(tmp_path, "0", "snapkv", 1024, {0.0: [True], 0.5: [False], 1.0: [True]})
    depth_run(tmp_path, "1", "snapkv", 1024, {0.0: [True], 0.5: [True], 1.0: [True]})  # another seed
    depth_run(tmp_path, "2", "snapkv", 2048, {0.0: [False, False], 0.5: [True, False], 1.0: [True, True]})
    depth_run(tmp_path, "3", "snapkv", 512, {0.0: [True], 1.0: [False]})  # no sample at depth 0.5
    depth_run(tmp_path, "4", "tova", 1024, {0.0: [True], 0.5: [True], 1.0: [True]}, fraction=0.5)
    fake_run(tmp_path, "5", "aspe", 0.25, 12.0)
    figures = []
    monkeypatch.setattr(plot, "_save", lambda fig, path: figures.append((path.name, fig)) or path)
    written = plot.depth_heatmaps(load_runs(tmp_path), tmp_path / "plots")
    assert [p.name for p in written] == ["depth_grid.csv",
                                         "depth_heatmap-needle-lady_susan-snapkv-topk-fraction0.2.png",
                                         "depth_heatmap-needle-lady_susan-tova-topk-fraction0.5.png"]
    (_, snapkv), (_, tova) = figures
    ax = snapkv.axes[0]
    grid = ax.images[0].get_array()  # [depth, length]
    assert grid.shape == (3, 3)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["512", "1024", "2048"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0%", "50%", "100%"]
    assert grid.mask.tolist() == [[False] * 3, [True, False, False], [False] * 3]  # 512 x 50%: never run
    assert grid.filled(-1).tolist() == [[1.0, 1.0, 0.0], [-1, 0.5, 0.5], [0.0, 1.0, 1.0]]
    assert tova.axes[0].images[0].get_array().tolist() == [[1.0], [1.0], [1.0]]
    assert sorted(t.get_text() for t in ax.texts) == sorted(["100%"] * 4 + ["0%"] * 2 + ["50%"] * 2)
    with open(tmp_path / "plots" / "depth_grid.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 8 + 3
    assert rows[3] == {"task": "needle-lady_susan", "policy": "snapkv", "scope": "topk", "budget": "fraction=0.2",
                       "length": "1024", "depth": "0.5", "n": "2", "accuracy": "0.5"}
    for _, fig in figures:
        plt.close(fig)


def test_kvtier_plot_writes_the_heatmap_png(tmp_path, capsys):
    for i, length in enumerate((256, 512)):
        depth_run(tmp_path, str(i), "lru", length, {0.0: [True], 1.0: [i == 0]}, task="passkey")
    assert main([str(tmp_path)]) == 0
    heatmap = tmp_path / "plots" / "depth_heatmap-passkey-lru-topk-fraction0.2.png"
    assert heatmap.read_bytes().startswith(PNG) and str(heatmap) in capsys.readouterr().out.split()


def bench_run(root, name, model, scope, policy, fraction, score, length=4096, mode="continuous"):
    """A RULER run's metrics.json fields kvtier-plot reads; scope ``kvpress``: a ``method=kvpress:<policy>`` run's
    (no tiers: no occupancy)."""
    m = {"task": "ruler", "model": model, "policy": policy, "scope": scope, "score_name": "score", "score": score,
         "budget_fraction": int(fraction * (length - 128)) / (length - 128), "budget_tokens": int(fraction * length),
         "context_tokens": length - 128, "capacity_pages": {"device": 16},
         "occupancy": {"step": [0], "pages": {"device": [1]}},
         "config": {"budget": {"tokens": None, "size": None, "fraction": fraction}, "task": {"length": length},
                    "cache": {"attend_budget": scope != "all", "mode": mode}}}
    if scope == "kvpress":
        del m["capacity_pages"], m["occupancy"]
        m.update(method=f"kvpress:{policy}", kept_tokens=m["budget_tokens"])
    (root / name).mkdir(parents=True)
    (root / name / "metrics.json").write_text(json.dumps(m))


def test_benchmark_runs_fill_the_leaderboard_per_model(tmp_path, monkeypatch):
    """A RULER sweep over two models, two lengths, two budgets, the exact runs beside: ``leaderboard.md`` has a table
    per model (never pooled), a column per task and length at each budget and their average, the full cache at
    every budget, two seeds of a cell averaged; the summary keeps the models apart too."""
    for model, base in (("smollm2", 40.0), ("gemma3_270m", 60.0)):
        bench_run(tmp_path, f"{model}-exact", model, "all", "lru", 0.25, base + 30)
        bench_run(tmp_path, f"{model}-exact-8k", model, "all", "lru", 0.25, base + 20, length=8192)
        for f in (0.1, 0.2):
            bench_run(tmp_path, f"{model}-topk-{f}", model, "topk", "snapkv", f, base + 100 * f)
            bench_run(tmp_path, f"{model}-once-{f}", model, "resident", "snapkv", f, base, mode="once")
            bench_run(tmp_path, f"{model}-once-{f}-8k", model, "resident", "snapkv", f, base - 10, length=8192,
                      mode="once")
    bench_run(tmp_path, "seed2", "smollm2", "topk", "snapkv", 0.1, 40.0 + 10 + 4)  # another seed: 52 on average
    for f in (0.1, 0.2):
        bench_run(tmp_path, f"press-{f}", "smollm2", "kvpress", "snapkv", f, 45.0)
    assert main([str(tmp_path)]) == 0
    text = (tmp_path / "plots" / "leaderboard.md").read_text()
    lines = text.splitlines()
    assert lines[0] == "gemma3_270m:" and "smollm2:" in lines  # in the runs' order (their folders')
    head = ("| method | ruler-4096 @10% | ruler-4096 @20% | ruler-8192 @10% | ruler-8192 @20% | average @10% | "
            "average @20% |")
    assert lines.count(head) == 2
    smol = lines[lines.index("smollm2:"):]
    assert "| exact | 70.0 | 70.0 | 60.0 | 60.0 | 65.0 | 65.0 |" in smol
    assert "| topk:snapkv | 52.0 | 60.0 | - | - | 52.0 | 60.0 |" in smol  # two seeds at 10%: (50 + 54) / 2
    assert "| once:snapkv | 40.0 | 40.0 | 30.0 | 30.0 | 35.0 | 35.0 |" in smol
    assert "| kvpress:snapkv | 45.0 | 45.0 | - | - | 45.0 | 45.0 |" in smol  # a press's runs, named by their method
    assert not list((tmp_path / "plots").glob("occupancy-press-*"))  # a press has no tiers
    gemma = lines[:lines.index("smollm2:")]
    assert "| exact | 90.0 | 90.0 | 80.0 | 80.0 | 85.0 | 85.0 |" in gemma
    assert (tmp_path / "plots" / "leaderboard-smollm2.png").read_bytes().startswith(PNG)
    assert (tmp_path / "plots" / "leaderboard-gemma3_270m.png").read_bytes().startswith(PNG)
    tasks = {row["task"] for row in csv.DictReader(open(tmp_path / "plots" / "summary.csv"))}
    assert tasks == {"ruler-smollm2", "ruler-gemma3_270m"}
