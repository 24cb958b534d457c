"""The serving bench's CPU smoke run (tiny fp32 model, tiny sizes): every part runs and writes its rows."""

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_serve_bench_smoke(tmp_path):
    out = tmp_path / "serve.json"
    subprocess.run([sys.executable, "-m", "bench.serve", "--smoke", "--rates", "4", "--requests", "4", "--json",
                    str(out)], cwd=ROOT, check=True, capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    rows = result["rows"]
    systems = {(r["part"], r["system"]) for r in rows}
    for system in ("floor (compute)", "cold, one chunk", "cold, chunks of 512", "radix hit"):
        assert ("ttft 128", system) in systems
    hit = next(r for r in rows if r["system"] == "radix hit")
    assert hit["cached_tokens"] == 128 and 0 < hit["x_cold"]
    chunked = [r for r in rows if r["part"].startswith("itl") and "x_target" in r]
    assert len(chunked) == 2 and all(r["slowest_iterations"] for r in chunked)
    replays = [r for r in rows if r["part"] == "goodput" and "rate_rps" in r]
    assert {r["system"] for r in replays} == {"all-HBM", "tiered 20% HBM + host"}
    assert all(r["cached_share"] > 0 for r in replays)  # the trace's requests share prefixes
    assert all(r["replays"] == 1 and r["captured_in_timed"] == 0 and r["decoding_mean"] > 0 for r in replays)
    assert len([r for r in rows if r["part"] == "sustained"]) == 2
    assert set(result["sustained_ratio"]) == {"peak_running", "decoding_mean", "rate_rps"}


def test_trace_workload_keeps_the_traces_output_lengths_or_fixes_them():
    from bench.serve import trace_workload

    cut = trace_workload("conversation", 12, 64, 200, 1000)
    fixed = trace_workload("conversation", 12, 64, 200, 1000, outputs="fixed")
    assert [r.arrival_s for r in cut] == [r.arrival_s for r in fixed]
    assert all(2 <= r.max_new_tokens <= 200 for r in cut) and min(r.max_new_tokens for r in cut) < 200
    assert all(r.max_new_tokens == 200 for r in fixed)


def test_iteration_host_bench_runs(tmp_path):
    out = tmp_path / "host.json"
    subprocess.run([sys.executable, "-m", "bench.iteration_host", "--repeat", "2", "--json", str(out)], cwd=ROOT,
                   check=True, capture_output=True, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    works = [r["work"] for r in rows]
    assert [w.split(":")[0].split(" ")[0] for w in works] == ["plan", "plan", "free"], works
    assert "decode rows" in works[0] and "cold" in works[1] and all(r["ms"] > 0 for r in rows)


def test_sustained_ratios_read_a_system_that_sustains_no_rate():
    """Tiered over all-HBM at the highest rate each sustains: a tiered engine that sustains none gives 0, an
    all-HBM one that sustains none leaves the ratios undefined."""
    from bench.serve import sessions_ratio

    def sustained(rate, peak, mean):
        return {"part": "sustained", "rate_rps": rate, "peak_running": peak, "decoding_mean": mean}

    both = sessions_ratio([sustained(0.25, 3, 1.5), sustained(4.0, 16, 9.0)])
    assert both == {"peak_running": 16 / 3, "decoding_mean": 6.0, "rate_rps": 16.0}
    assert sessions_ratio([sustained(0.25, 3, 1.5), sustained(None, 0, 0.0)]) == \
        {"peak_running": 0.0, "decoding_mean": 0.0, "rate_rps": 0.0}
    undefined = sessions_ratio([sustained(None, 0, 0.0), sustained(4.0, 16, 9.0)])
    assert all(math.isnan(v) for v in undefined.values())


def test_sustained_rows_name_the_lower_rates_that_missed():
    """An H100 goodput run's shares (before ``keep_room``): the tiered engine meets the scaled SLOs at 1 and 4 req/s
    but not at 0.25, so its sustained rate 4 carries the miss below it; all-HBM's 0.25 has none below."""
    from bench.serve import SYSTEMS, sustained_rows

    shares = {SYSTEMS[0][0]: {0.25: 1.0, 1.0: 0.875, 4.0: 0.375}, SYSTEMS[1][0]: {0.25: 0.625, 1.0: 1.0, 4.0: 1.0}}
    rows = [{"system": system, "rate_rps": rate, "scaled_slo_met": met, "peak_running": int(4 * rate),
             "decoding_mean": rate} for system, by_rate in shares.items() for rate, met in by_rate.items()]
    all_hbm, tiered = sustained_rows(rows)
    assert (all_hbm["rate_rps"], all_hbm["missed_below"]) == (0.25, [])
    assert (tiered["rate_rps"], tiered["peak_running"], tiered["missed_below"]) == (4.0, 16, [0.25])
