"""``kvtier-run experiment=serve_trace`` on a two-request slice of the conversation trace (SmolLM2, CPU):
the metrics carry TTFT / ITL / E2E, goodput, prefix hits, occupancy over time and preemptions."""

import json

import pytest

from hydra import compose, initialize_config_dir

from kvtier.report import metrics_table
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
    it = r["iteration"]  # what the iterations held: some carried chunks, every prompt token went through one
    assert 0 < it["with_chunks"] <= 1 and it["chunk_tokens_mean"] > 0 and 0 < it["time_p50_s"] <= it["time_p99_s"]
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["goodput_rps"] == m["goodput_rps"]
    rows = metrics_table(m).columns[0]._cells
    assert "ITL p50 / p99" in rows and "tier-1 hit rate" not in rows  # the console shows the serving figures


def test_goodput_counts_requests_meeting_both_slos():
    from types import SimpleNamespace

    import numpy as np

    from kvtier.serve.replay import SLO, summarize
    from kvtier.serve.scheduler import Request, RequestState, ServeStats

    def done(arrival, tokens):
        s = RequestState(Request(0, np.zeros(4, dtype=np.int64), len(tokens), arrival))
        s.token_s, s.first_token_s, s.finish_s = tokens, tokens[0], tokens[-1]
        return s

    states = [done(0.0, [0.1, 0.105, 0.110]),  # meets both
              done(0.0, [0.3, 0.305]),  # TTFT 300 ms
              done(1.0, [1.1, 1.2]),  # ITL 100 ms
              done(1.0, [1.2])]  # TTFT 200 ms, no ITL: meets both
    out = summarize(SimpleNamespace(done=states, stats=ServeStats(prompt_tokens=16, cached_tokens=4)), SLO(), 0.0)
    assert out["slo_met_fraction"] == 0.5 and out["goodput_rps"] == pytest.approx(2 / 1.2)
    assert out["ttft_p50_s"] == pytest.approx(0.15) and out["prefix_hit_tokens"] == 0.25
    assert SLO(ttft_s=0.35, itl_s=0.2).goodput(states) == (pytest.approx(4 / 1.2), 1.0)  # a looser SLO, same span
