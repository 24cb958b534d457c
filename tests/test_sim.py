"""kvtier.sim: event order, conservation of requests / tokens / bytes on small clusters, calibration parsing,
the validation's formulas, kvtier policies placing pages, and a seed recipe's smoke run (no model)."""

import json
import math
import shutil

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from kvtier.errors import ConfigError
from kvtier.policies.lru import LRU
from kvtier.policies.sink_window import SinkWindow
from kvtier.run import RECIPES, execute
from kvtier.sim.calibrate import calibrate
from kvtier.sim.calibration import DEFAULT, PARAMS, load_calibration
from kvtier.sim.cluster import Cluster, ClusterSpec, InstanceSpec
from kvtier.sim.costs import StepCosts
from kvtier.sim.events import CausalityError, EventQueue
from kvtier.sim.hardware import GPUS, MODELS, Link
from kvtier.sim.measured import BENCH_FILES, measured_rows, read_bench
from kvtier.sim.placement import AttentionPattern, place
from kvtier.sim.validate import check_rows, predict
from kvtier.sim.workload import long_context_mix

BENCH = RECIPES.parents[1] / "bench"


@pytest.fixture(scope="module")
def cal():
    return load_calibration()


def costs(cal, kv_bytes=2.0):
    return StepCosts(cal, MODELS["llama8b-shape"], GPUS["H200"], kv_bytes=kv_bytes)


def test_events_pop_in_time_order_and_ties_in_push_order():
    q = EventQueue()
    for t, name in [(2.0, "c"), (1.0, "a"), (2.0, "d"), (1.0, "b"), (0.5, "first")]:
        q.push(t, name)
    order = [q.pop().kind for _ in range(len(q))]
    assert order == ["first", "a", "b", "c", "d"] and q.now == 2.0
    with pytest.raises(CausalityError):
        q.push(1.0, "late")


def _check_flights(ledger, instances):
    for f in ledger.flights:
        times = f.token_times(instances)
        assert len(times) == f.req.output  # one time per generated token
        assert np.all(np.diff(times) > 0)
        assert f.arrival_s <= f.prefill_start_s <= f.prefill_end_s <= f.first_token_s <= f.finish_s


def test_disaggregated_cluster_conserves_requests_tokens_and_bytes(cal):
    c = costs(cal)
    reqs = long_context_mix(24, 3000, 40, rate=20.0, spread=0.5, shared_prefix=1024, seed=1)
    spec = ClusterSpec([InstanceSpec("prefill", c, 200_000, token_budget=2048, prefix_tokens=8192)]
                       + [InstanceSpec("decode", c, 200_000, max_batch=8)] * 2, kv_link=Link("test", 50.0))
    ledger = Cluster(spec, reqs).run()
    assert ledger.arrived == ledger.finished == len(reqs)
    assert ledger.prompt_tokens == sum(r.prompt for r in reqs) == ledger.cached_tokens + ledger.prefilled_tokens
    assert ledger.cached_tokens > 0  # the shared 1,024-token prefix, after the first request
    assert ledger.output_tokens == sum(r.output for r in reqs)
    token_bytes = MODELS["llama8b-shape"].kv_token_bytes(2.0)
    assert ledger.kv_sent_bytes == ledger.kv_landed_bytes == pytest.approx(ledger.prompt_tokens * token_bytes)
    _check_flights(ledger, ledger.instances)
    s = ledger.summary()
    assert s["requests"] == len(reqs) and s["decode_peak_rows"] <= 8 and 0 < s["transfer_over_prefill"] < 1


def test_colocated_cluster_swaps_out_when_pages_run_out_and_still_conserves(cal):
    c = costs(cal)
    reqs = long_context_mix(12, 500, 200, spread=0.2, seed=2)  # all at once; 12 x 700 tokens > 4,096 of KV
    ledger = Cluster(ClusterSpec([InstanceSpec("both", c, 4096, max_batch=12, token_budget=1024)]), reqs).run()
    assert ledger.finished == 12 and ledger.output_tokens == sum(r.output for r in reqs)
    assert ledger.prefilled_tokens == ledger.prompt_tokens  # swapped requests keep their KV: nothing recomputed
    assert ledger.preemptions > 0 and ledger.swap_bytes > 0
    _check_flights(ledger, ledger.instances)


def test_contiguous_reservation_wastes_what_paging_keeps(cal):
    c, reqs = costs(cal), long_context_mix(16, 1000, 100, spread=0.5, seed=3)
    eff = {}
    for page, name in [(16, "paged"), (0, "contiguous")]:
        spec = InstanceSpec("both", c, 100_000, token_budget=2048, page_size=page, max_context=8192)
        eff[name] = Cluster(ClusterSpec([spec]), reqs).run().summary()["both_memory_efficiency"]
    assert eff["paged"] > 0.97 and eff["contiguous"] < 0.2  # ~1,100 tokens held of 8,192 reserved


def test_closed_loop_keeps_that_many_requests_in_flight(cal):
    reqs = long_context_mix(30, 200, 20, spread=0.5, seed=4)
    ledger = Cluster(ClusterSpec([InstanceSpec("both", costs(cal), 10**6, token_budget=4096)]), reqs,
                     closed_loop=5).run()
    assert ledger.finished == 30
    starts = sorted(f.arrival_s for f in ledger.flights)
    assert starts[:5] == [0.0] * 5 and starts[5] > 0


def test_calibration_regenerates_from_the_bench_jsons(cal):
    fresh = calibrate(BENCH)
    assert fresh.gpu == cal.gpu == "H200" and fresh.hbm_GBps == pytest.approx(4194.04, rel=1e-4)
    for group, keys in PARAMS.items():
        for key in keys:
            assert fresh.params[group][key] == pytest.approx(cal.params[group][key], rel=1e-6, abs=1e-12)
    assert 3000 < fresh.attention["bf16"]["GBps"] < 5000 and 0 < fresh.pick_churn < 0.5


def test_calibration_errors_name_the_file_or_key(tmp_path, cal):
    for name in BENCH_FILES.values():
        shutil.copy(BENCH / name, tmp_path / name)
    (tmp_path / BENCH_FILES["disagg"]).unlink()
    with pytest.raises(ConfigError) as err:
        read_bench(tmp_path)
    assert err.value.field == "bench.disagg"
    raw = json.loads(DEFAULT.read_text())
    del raw["params"]["prefill"]["flops_x"]
    (tmp_path / "cal.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as err:
        load_calibration(tmp_path / "cal.json")
    assert err.value.field == "calibration.params.prefill"


@pytest.mark.parametrize("group", list(PARAMS))
def test_predictions_are_affine_in_each_fitted_group(cal, group):
    """calibrate.fit_group reads the design matrix off predict(): that needs predict affine in the group."""
    rows = [r for r in measured_rows(read_bench(BENCH)) if r.id in cal.anchors[group]]
    saved = dict(cal.params[group])
    try:
        keys = PARAMS[group]

        def at(values):
            cal.params[group] = dict(zip(keys, values))
            return np.array([predict(r, cal) for r in rows])
        a, b = np.arange(1.0, len(keys) + 1), np.full(len(keys), 0.5)
        np.testing.assert_allclose(at(a + b), at(a) + at(b) - at(np.zeros(len(keys))), rtol=1e-9)
    finally:
        cal.params[group] = saved


def test_validation_covers_every_timed_row_and_predicts_the_anchors(cal):
    checked = check_rows(cal, measured_rows(read_bench(BENCH)))
    ids = {c.row.id for c in checked}
    assert "disagg TTFT (decode rank)" in ids and "serve ttft 8192 radix hit" in ids
    assert sum(c.row.kind == "decode" for c in checked) == 25
    all_hbm = [c for c in checked if c.row.kind == "decode" and c.row.case["scope"] == "all"]
    assert all(c.fitted for c in all_hbm) and max(abs(c.error) for c in all_hbm) < 0.10
    assert not any(c.fitted for c in checked if c.row.id.startswith("disagg"))  # the 2-GPU rows are held out


def test_lru_keeps_returning_picks_that_position_alone_misses():
    pattern = AttentionPattern(pages=512, k=40, churn=0.3, reuse=1.0, memory=8, seed=0)
    lru = place(LRU(), pattern, hbm_pages=160, steps=40)
    window = place(SinkWindow(sinks=4, window=64), pattern, hbm_pages=160, steps=40)
    assert lru.hit_rate > 0.9 > window.hit_rate
    assert 0 <= lru.promoted_per_step <= 1 and lru.attended_per_step >= 40


def test_sim_seed_recipe_runs_without_a_model(tmp_path):
    overrides = ["experiment=sim_seed001", "task.plots=false", "task.options={requests: 30}"]
    with initialize_config_dir(str(RECIPES), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    m = execute(cfg, tmp_path / "run")
    r = m["task_result"]
    assert r["task"] == "sim_seed001" and "| TTFT p99, mono -> disagg | 840 -> 112 ms |" in r["table"]
    assert r["monolithic"]["requests"] == r["disaggregated"]["requests"] == 30
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["task_result"]["table"] == r["table"]
    assert not math.isnan(r["transfer_ms_4096"])


def test_a_setting_a_simulator_run_would_not_read_is_refused_by_name():
    """experiment=sim_seed* loads no model: a sweep of the budget, a logger or a policy would give identical runs
    (a multirun of two such runs differed only in its plot's path), so the command is refused naming the key."""
    from kvtier.run import job_configs

    for args, key in ((["-m", "experiment=sim_seed001", "budget.fraction=0.2,0.3"], "budget.fraction"),
                      (["experiment=sim_seed000", "logger=wandb"], "logger"),
                      (["experiment=sim_seed002", "policy=lru"], "policy")):
        with pytest.raises(ConfigError, match="loads no model") as e:
            list(job_configs(args))
        assert e.value.field == key
    assert len(list(job_configs(["-m", "experiment=sim_seed001", "task.plots=true,false"]))) == 2


def test_sim_seed_refuses_unknown_seed_and_options():
    from kvtier.sim.task import SimSeed

    with pytest.raises(ConfigError, match="task.seed"):
        SimSeed(seed="007")
    with pytest.raises(ConfigError, match="task.options"):
        SimSeed(seed="000", options={"bogus": 1})


def test_tiered_decode_step_pays_misses_and_unhidden_prefetch_over_the_link(cal):
    from kvtier.sim.cluster import Offload

    c, rows, keys = costs(cal), 16, 16 * 65536

    def step(**kw) -> float:
        return Offload(Link("cxl", 32.0), hbm_fraction=0.2, **kw).step_ms(c, rows, keys)
    assert step(hit_rate=1.0) == pytest.approx(c.decode_ms(rows, keys))
    misses = keys * 0.1 * c.token_bytes() / 32e6  # ms for 10% of the keys over 32 GB/s
    assert step(hit_rate=0.9) == pytest.approx(c.decode_ms(rows, keys * 0.9) + misses)
    assert step(hit_rate=1.0, promoted=0.001) == step(hit_rate=1.0)  # a small prefetch hides behind compute
    assert step(hit_rate=1.0, promoted=1.0) == pytest.approx(keys * c.token_bytes() / 32e6)  # a large one shows
    slow = Offload(Link("cxl", 0.5), hbm_fraction=0.2)
    assert slow.chunk_ms(c, 4096, 1.0) == pytest.approx(4096 * 0.8 * c.token_bytes() / 0.5e6)
