"""``kvtier-run experiment=serve_trace`` on a two-request slice of the conversation trace (SmolLM2, CPU):
the metrics carry TTFT / ITL / E2E, goodput, prefix hits, occupancy over time and preemptions."""

import json

from hydra import compose, initialize_config_dir

from kvtier.run import RECIPES, execute

SMALL = ["experiment=serve_trace", "task.requests=3", "task.block_tokens=16", "task.max_context=96",
         "task.time_scale=100", "budget.tokens=96", "task.max_batch=2", "progress=false", "logger=none"]


def test_serve_trace_recipe(tmp_path):
    with initialize_config_dir(str(RECIPES), version_base="1.3"):
        cfg = compose("config", overrides=SMALL)
    m = execute(cfg, tmp_path / "run")
    r = m["task_result"]
    assert m["task"] == "serve_trace" and m["score_name"] == "goodput_rps" and r["requests"] == 3
    for key in ("ttft_p50_s", "ttft_p99_s", "itl_p99_s", "e2e_p99_s"):
        assert r[key] > 0
    assert r["ttft_p99_s"] <= r["e2e_p99_s"]
    # every conversation request starts with the trace's shared block 0: later ones reuse its pages
    assert r["prefix_hit_tokens"] > 0
    assert set(r["occupancy"]["pages"]) == {"device", "host"} and len(r["occupancy"]["time_s"]) == r["iterations"]
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["goodput_rps"] == m["goodput_rps"]
