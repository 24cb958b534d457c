"""bench/policy_grid.py: the grid's split into worker blocks (every combination in exactly one), and a tiny CPU run
of two workers whose table holds the same perplexities as kvtier-run's own runs of the same configs."""

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from bench.policy_grid import blocks, combos, key, missing_blocks, pick, recipe_axes
from kvtier.run import RECIPES, execute

ROOT = Path(__file__).resolve().parents[1]
TINY = ["task.length=144", "task.prefix=128", "cache.window=16", "scheduler.prefill.chunk_size=64"]


def every(axes):
    return [key(dict(zip(axes, c))) for c in itertools.product(*axes.values())]


@pytest.mark.parametrize("split", [[], ["task"], ["task", "scope"], ["task", "scope", "policy"],
                                   ["policy", "fraction"], ["task", "scope", "policy", "fraction"]])
def test_every_combination_is_in_exactly_one_block(split):
    axes = recipe_axes()
    assert [len(v) for v in axes.values()] == [5, 2, 4, 4]
    parts = blocks(axes, split)
    assert len(parts) == math.prod(len(axes[a]) for a in split)
    assigned = [key(dict(zip(b, c))) for b in parts for c in combos(b)]
    assert sorted(assigned) == sorted(every(axes)) and len(set(assigned)) == 160
    assert parts[0]["task"][0] == "study/opticks"  # the heaviest task first


def test_resume_runs_exactly_what_is_missing():
    axes = recipe_axes()
    done = set(every(axes)[::3])
    for split in ([], ["task", "scope"], ["task", "scope", "policy"]):
        todo = [key(dict(zip(b, c))) for b in missing_blocks(axes, split, done) for c in combos(b)]
        assert sorted(todo) == sorted(set(every(axes)) - done) and len(set(todo)) == len(todo)


def test_subset_names():
    axes = recipe_axes()
    assert pick("task", axes["task"], "opticks,study/needle") == ["study/opticks", "study/needle"]
    assert pick("fraction", axes["fraction"], ".2") == ["0.2"]
    with pytest.raises(SystemExit):
        pick("policy", axes["policy"], "nope")


def test_two_workers_on_the_cpu_match_kvtier_run(tmp_path):
    out = tmp_path / "table.json"
    proc = subprocess.run([sys.executable, "-m", "bench.policy_grid", "--workers", "2", "--tasks", "opticks",
                           "--scopes", "resident", "--policies", "sink_window,snapkv", "--fractions", "0.2",
                           "--threads", "1",
                           "--out", str(tmp_path / "grid"), "--json", str(out), "model.device=cpu", *TINY],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = json.loads(out.read_text())
    assert [p["rc"] for p in table["processes"]] == [0, 0] and table["runs_complete"] == 2
    assert "| opticks | resident | snapkv | 0.2 |" in proc.stdout
    for row in table["rows"]:
        assert row["score_name"] == "perplexity" and 1 < row["score"] < 1e4 and row["seconds"] > 0
        assert row["kernel"] == "torch" and row["decode_steps"] > 0 and not row["partial"]
        with initialize_config_dir(str(RECIPES), version_base="1.3"):
            cfg = compose("config", overrides=["experiment=policy_study", "logger=none", "task=study/opticks",
                                               f"scope={row['scope']}", f"policy={row['policy']}",
                                               "budget.fraction=0.2", *TINY])
        assert execute(cfg, tmp_path / row["policy"])["perplexity"] == row["score"]
