"""kvtier.sim's mechanics: event order, conservation of requests / tokens / bytes on small clusters, swap and
recompute preemption, decode steps run ahead as one event, the ITL bookkeeping, step-time noise, prefix tiers,
the shared pool and routing, calibration files, kvtier policies placing pages, and a seed recipe's run (no model).
The simulator's figures are pinned in tests/test_sim_figures.py."""

import json
import math
import shutil

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

import kvtier.sim.cluster as cluster_module
from kvtier.errors import ConfigError
from kvtier.policies.lru import LRU
from kvtier.policies.sink_window import SinkWindow
from kvtier.run import RECIPES, execute
from kvtier.sim.calibration import PARAMS, SHIPPED, load_calibration
from kvtier.sim.cluster import Cluster, ClusterSpec, InstanceSpec, Offload, hbm_prefix
from kvtier.sim.costs import StepCosts
from kvtier.sim.events import CausalityError, EventQueue
from kvtier.sim.hardware import MODELS, Link
from kvtier.sim.measured import SERVE_FILES, measured_rows, predict
from kvtier.sim.placement import AttentionPattern, place
from kvtier.sim.pool import BlockCache, Holders, Tier
from kvtier.sim.workload import long_context_mix, prefix_hit_ideal, trace_workload

BENCH = RECIPES.parents[1] / "bench" / "results"


@pytest.fixture(scope="module")
def cal():
    return load_calibration("H100")


@pytest.fixture(scope="module")
def quiet(cal):
    """The H100 calibration without step-time noise (runs compared step for step)."""
    c = load_calibration("H100")
    c.noise = dict.fromkeys(c.noise, 0.0)
    return c


def costs(cal, **kw):
    return StepCosts(cal, MODELS["llama8b-shape"], **kw)


def test_events_pop_in_time_order_and_ties_in_push_order():
    q = EventQueue()
    for t, name in [(2.0, "c"), (1.0, "a"), (2.0, "d"), (1.0, "b"), (0.5, "first")]:
        q.push(t, name)
    order = [q.pop()[0] for _ in range(len(q))]
    assert order == ["first", "a", "b", "c", "d"] and q.now == 2.0
    with pytest.raises(CausalityError):
        q.push(1.0, "late")


def _check_flights(ledger):
    for f in ledger.flights:
        times = f.token_times(ledger.instances)
        assert len(times) == f.req.output  # one time per generated token
        assert np.all(np.diff(times) > 0)
        assert f.arrival_s <= f.prefill_start_s <= f.prefill_end_s <= f.first_token_s <= f.finish_s


def test_disaggregated_cluster_conserves_requests_tokens_and_bytes(cal):
    c = costs(cal)
    reqs = long_context_mix(24, 3000, 40, rate=20.0, spread=0.5, shared_prefix=1024, seed=1)
    spec = ClusterSpec([InstanceSpec("prefill", c, 200_000, token_budget=2048, prefix=hbm_prefix(8192))]
                       + [InstanceSpec("decode", c, 200_000, max_batch=8)] * 2, kv_link=Link("test", 50.0))
    ledger = Cluster(spec, reqs).run()
    assert ledger.arrived == ledger.finished == len(reqs)
    assert ledger.prompt_tokens == sum(r.prompt for r in reqs) == ledger.cached_tokens + ledger.prefilled_tokens
    assert ledger.cached_tokens > 0  # the shared 1,024-token prefix, after the first request
    assert ledger.output_tokens == sum(r.output for r in reqs)
    token_bytes = MODELS["llama8b-shape"].kv_token_bytes(2.0)
    assert ledger.kv_sent_bytes == ledger.kv_landed_bytes == pytest.approx(ledger.prompt_tokens * token_bytes)
    _check_flights(ledger)
    s = ledger.summary()
    assert s["requests"] == len(reqs) and s["decode_peak_rows"] <= 8 and 0 < s["transfer_over_prefill"] < 1


def test_preemption_swaps_over_the_host_link_or_recomputes_and_both_conserve(quiet):
    c = costs(quiet)
    reqs = long_context_mix(12, 500, 200, spread=0.2, seed=2)  # all at once; 12 x 700 tokens > 4,096 of KV
    runs = {}
    for mode in ("swap", "recompute"):
        spec = InstanceSpec("both", c, 4096, max_batch=12, token_budget=1024, preempt=mode)
        runs[mode] = ledger = Cluster(ClusterSpec([spec]), reqs).run()
        assert ledger.finished == 12 and ledger.output_tokens == sum(r.output for r in reqs)
        assert ledger.preemptions > 0
        assert ledger.prefilled_tokens == ledger.prompt_tokens + ledger.recomputed_tokens
        _check_flights(ledger)
    swap, recompute = runs["swap"], runs["recompute"]
    assert swap.recomputed_tokens == 0 and recompute.recomputed_tokens > 0 and recompute.swap_bytes == 0
    # every swapped byte went out and came back over the host link, the iteration that copies waiting for it:
    # with a free link the same iterations run (all requests arrive at once), each shorter by its copies
    assert swap.swap_bytes > 0 and swap.swap_bytes % (2 * c.token_bytes()) == 0
    busy = {}
    for GBps in (quiet.host_GBps, 1e9):
        spec = InstanceSpec("both", c, 4096, max_batch=12, token_budget=1024, host_link=Link("host", GBps))
        busy[GBps] = Cluster(ClusterSpec([spec]), reqs).run().instances[0].busy_s
    assert busy[quiet.host_GBps] - busy[1e9] == pytest.approx(swap.swap_bytes / (quiet.host_GBps * 1e9), rel=1e-6)
    with pytest.raises(ConfigError, match="preempt"):
        InstanceSpec("decode", c, 4096, preempt="recompute")


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


def _three_clusters(c):
    reqs = trace_workload("conversation", 160, time_scale=4.0, max_prompt=6000)
    yield ClusterSpec([InstanceSpec("prefill", c, 300_000, token_budget=2048, prefix=hbm_prefix(50_000))]
                      + [InstanceSpec("decode", c, 60_000, max_batch=48)] * 2, kv_link=Link("test", 50.0)), reqs
    yield ClusterSpec([InstanceSpec("both", c, 40_000, max_batch=64, token_budget=2048, prefix=hbm_prefix(20_000))]
                      * 2, router="cache_aware"), reqs
    yield ClusterSpec([InstanceSpec("both", c, 30_000, max_batch=64, token_budget=2048, preempt="recompute")]), reqs


def test_decode_steps_run_ahead_as_one_event_give_the_same_run_step_for_step(quiet, monkeypatch):
    """Quiet decode steps between an instance's own events are one event (cut short when work is routed to it);
    the run must be the one that one event per step gives: same iteration end times, same figures."""
    c = costs(quiet)
    for spec, reqs in _three_clusters(c):
        fast = Cluster(spec, reqs)
        ahead = fast.run()
        monkeypatch.setattr(cluster_module, "RUN_AHEAD", 1)
        slow = Cluster(spec, reqs)
        stepwise = slow.run()
        monkeypatch.undo()
        assert ahead.preemptions == stepwise.preemptions and ahead.output_tokens == stepwise.output_tokens
        for a, b in zip(ahead.instances, stepwise.instances):
            assert a.iters == b.iters
            np.testing.assert_allclose(a.iter_end_s, b.iter_end_s, rtol=1e-9)
        sa, sb = ahead.summary(), stepwise.summary()
        assert sa["ttft_p99_s"] == pytest.approx(sb["ttft_p99_s"])
        assert sa["itl_p99_ms"] == pytest.approx(sb["itl_p99_ms"])
        assert fast.q.popped < 0.8 * slow.q.popped  # it did run ahead


def test_inter_token_gaps_are_every_request_s_token_time_differences(cal):
    c = costs(cal)
    for spec, reqs in _three_clusters(c):
        ledger = Cluster(spec, reqs).run()
        done = [f for f in ledger.flights[20:]]  # a warm-up left out, as summary(warmup=) does
        direct = np.concatenate([np.diff(f.token_times(ledger.instances)) for f in done])
        values, weights = ledger.gaps(done)
        assert weights.sum() == len(direct)
        for q in (50, 99):
            order = np.sort(direct)
            assert ledger.summary(warmup=20)[f"itl_p{q}_ms"] == pytest.approx(
                order[math.ceil(q / 100 * len(order)) - 1] * 1e3)


def test_step_time_noise_is_the_measured_spread_on_the_engine_and_absent_on_the_roofline(cal):
    """Decode-only iterations of one instance at a constant batch: their spread is the calibration's decode
    sigma (p99 / p50 = exp(2.326 sigma)); the roofline's is zero."""
    sigma = cal.noise["decode"]
    assert 0 < sigma < 0.05
    reqs = long_context_mix(8, 64, 4000, seed=5)
    for engine, expect in ((True, sigma), (False, 0.0)):
        ledger = Cluster(ClusterSpec([InstanceSpec("both", costs(cal, engine=engine), 10**6)]), reqs, seed=1).run()
        d = np.diff(ledger.instances[0].iter_end_s[10:3000])
        d = d / np.polyval(np.polyfit(np.arange(d.size), d, 1), np.arange(d.size))  # the context's growth out
        assert np.log(d).std() == pytest.approx(expect, abs=0.15 * sigma)


def test_block_caches_evict_a_prefix_after_what_extends_it_and_drop_to_the_tier_below():
    below = BlockCache(2)
    top = BlockCache(3, below)
    top.touch((1, 2, 3))  # one prompt's blocks: 1 is its first
    top.touch((7,))
    assert 3 not in top and 3 in below and top.match((1, 2, 3)) == 2  # the leaf went first, a tier down
    holders = Holders(4)
    caches = [BlockCache(50, holders=holders, bit=i) for i in range(4)]
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 6))
        caches[int(rng.integers(4))].touch(tuple(int(b) for b in rng.integers(0, 30, n)))
    for _ in range(100):
        prompt = tuple(int(b) for b in rng.integers(0, 30, 6))
        assert holders.runs(prompt) == [c.match(prompt) for c in caches]


def test_prefix_hits_by_placement_and_routing_stay_under_the_ideal_shared_cache(cal):
    """On a trace slice: routing by the cache finds more of each prompt than routing by load; a pool shared by all
    instances finds nearly what one unbounded cache would, never more; what a pool read brings is on the NIC."""
    c = costs(cal)
    reqs = trace_workload("conversation", 1200, max_prompt=16384)  # at the trace's own rate: ~90% busy
    ideal = prefix_hit_ideal(reqs)

    def hit(router, pool=()):
        spec = ClusterSpec([InstanceSpec("both", c, 120_000, max_batch=128, token_budget=4096,
                                         prefix=hbm_prefix(400_000))] * 4,
                           router=router, pool=pool, nic=Link("nic", 100.0) if pool else None)
        ledger = Cluster(spec, reqs).run()
        assert ledger.finished == len(reqs)
        return ledger
    by_load, by_cache = hit("least_loaded"), hit("cache_aware")
    pooled = hit("cache_aware", (Tier("DRAM", 10**6),))
    h = {k: v.cached_tokens / v.prompt_tokens for k, v in (("load", by_load), ("cache", by_cache), ("pool", pooled))}
    assert h["load"] < h["cache"] < h["pool"] <= ideal + 1e-9 and h["pool"] > ideal - 0.03
    assert pooled.read_tokens > 0 and by_cache.read_tokens == 0
    read = pooled.prefix_read_bytes["pool DRAM"]
    assert read >= pooled.read_tokens * c.token_bytes() * 0.999  # a read block may go unused (evicted first)


def test_a_trace_tiled_past_its_end_shares_no_prefix_between_copies():
    one = trace_workload("conversation", 12031)
    two = trace_workload("conversation", 2 * 12031)
    assert [r.blocks for r in two[:12031]] == [r.blocks for r in one]
    first = {b for r in two[:12031] for b in r.blocks}
    assert not first & {b for r in two[12031:] for b in r.blocks}
    arrivals = [r.arrival_s for r in two]
    assert arrivals == sorted(arrivals) and arrivals[12031] > arrivals[12030]
    assert prefix_hit_ideal(one) == pytest.approx(0.3736, abs=0.001)  # the trace README's figure


def test_calibrations_regenerate_from_the_bench_jsons():
    from kvtier.sim.calibrate import calibrate

    for kind in ("H100", "H200"):
        shipped, fresh = load_calibration(kind), calibrate(BENCH, kind)
        assert fresh.gpu == shipped.gpu == kind
        for key in ("hbm_GBps", "bf16_tflops", "host_GBps", "nvlink_GBps", "fp8_kv_x"):
            assert getattr(fresh, key) == pytest.approx(getattr(shipped, key)), key
        assert fresh.allreduce == shipped.allreduce
        for group, keys in PARAMS.items():
            for key in keys:
                assert fresh.params[group][key] == pytest.approx(shipped.params[group][key], rel=1e-6, abs=1e-12)
        assert fresh.noise == pytest.approx(shipped.noise) and fresh.anchors == shipped.anchors


def test_the_all_reduce_line_is_bench_collectives_fit_or_the_named_assumption(tmp_path):
    """Without a collectives.json the calibration says its all-reduce latency is the assumption; with one, the
    alpha-beta line bench.collectives fits (here over exact ring times of 6 us + bytes at 360 GB/s) is read back,
    from its largest GPU group."""
    from bench.collectives import SIZES, fit_line
    from kvtier.sim.calibrate import allreduce_line
    from kvtier.sim.hardware import ALLREDUCE_LATENCY_US

    assumed = allreduce_line(tmp_path, 300.0)
    assert assumed["latency_us"] == ALLREDUCE_LATENCY_US and assumed["source"].startswith("assumption")
    fits = []
    for p, (lat, bus) in ((2, (4.0, 150.0)), (8, (6.0, 360.0))):
        rows = [{"bytes": n, "us": lat + 2 * (p - 1) / p * n / (bus * 1e3)} for n in SIZES]
        fits.append({"gpus": p, **fit_line(rows, p)})
    (tmp_path / "collectives.json").write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3", "fits": fits}))
    line = allreduce_line(tmp_path, 300.0)
    assert line["latency_us"] == pytest.approx(6.0) and line["bus_GBps"] == pytest.approx(360.0)
    assert line["source"].startswith("measured") and "8 x NVIDIA H100" in line["source"]


def test_calibration_errors_name_the_file_or_key(tmp_path):
    from kvtier.sim.calibrate import calibrate

    for name in SERVE_FILES["H100"]:
        shutil.copy(BENCH / name, tmp_path / name)
    with pytest.raises(ConfigError, match="not found"):
        calibrate(tmp_path, "H100")
    raw = json.loads(SHIPPED["H100"].read_text())
    del raw["params"]["prefill"]["attn_x"]
    (tmp_path / "cal.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as err:
        load_calibration(tmp_path / "cal.json")
    assert err.value.field == "calibration.params.prefill"
    raw = json.loads(SHIPPED["H100"].read_text())
    raw["allreduce"]["bus_GBps"] = 0
    (tmp_path / "cal.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="bus_GBps") as err:
        load_calibration(tmp_path / "cal.json")
    assert err.value.field == "calibration.allreduce"


@pytest.mark.parametrize("group", list(PARAMS))
def test_predictions_are_affine_in_each_fitted_group(cal, group):
    """calibrate.fit reads its design matrix off predict(): that needs predict affine in the group's parameters."""
    rows = [r for r in measured_rows(BENCH, "H100") if r.group in ("prefill", "serving")
            or r.group == group][:8]
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


def test_lru_keeps_returning_picks_that_position_alone_misses():
    pattern = AttentionPattern(pages=512, k=40, churn=0.3, reuse=1.0, memory=8, seed=0)
    lru = place(LRU(), pattern, hbm_pages=160, steps=40)
    window = place(SinkWindow(sinks=4, window=64), pattern, hbm_pages=160, steps=40)
    assert lru.hit_rate > 0.9 > window.hit_rate
    assert 0 <= lru.promoted_per_step <= 1 and lru.attended_per_step >= 40


def test_tiered_decode_step_pays_misses_and_unhidden_prefetch_over_the_link(cal):
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


def test_sim_seed_recipe_runs_without_a_model(tmp_path):
    overrides = ["experiment=sim_pd_disaggregation", "task.plots=false", "task.options={requests: 40}"]
    with initialize_config_dir(str(RECIPES), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    m = execute(cfg, tmp_path / "run")
    r = m["task_result"]
    assert r["task"] == "sim_seed001" and "| TTFT p99, mono -> disagg | 840 -> 112 ms |" in r["table"]
    assert "| deciding assumption |" in r["table"].splitlines()[0]
    assert r["engine"]["monolithic"]["requests"] == r["roofline"]["disaggregated"]["requests"] == 40
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["task_result"]["table"] == r["table"]


def test_a_setting_a_simulator_run_would_not_read_is_refused_by_name():
    """experiment=sim_* loads no model: a sweep of the budget, a logger or a policy would give identical runs
    (a multirun of two such runs differed only in its plot's path), so the command is refused naming the key."""
    from kvtier.run import job_configs

    for args, key in ((["-m", "experiment=sim_pd_disaggregation", "budget.fraction=0.2,0.3"], "budget.fraction"),
                      (["experiment=sim_long_context_offload", "logger=wandb"], "logger"),
                      (["experiment=sim_memory_managers", "policy=lru"], "policy")):
        with pytest.raises(ConfigError, match="loads no model") as e:
            list(job_configs(args))
        assert e.value.field == key
    assert len(list(job_configs(["-m", "experiment=sim_pd_disaggregation", "task.plots=true,false"]))) == 2


def test_sim_seed_refuses_unknown_seed_options_and_calibration():
    from kvtier.sim.task import SimSeed

    with pytest.raises(ConfigError, match="task.seed"):
        SimSeed(seed="007")
    with pytest.raises(ConfigError, match="task.options"):
        SimSeed(seed="000", options={"bogus": 1})
    with pytest.raises(ConfigError, match="calibration"):
        SimSeed(seed="000", calibration="A100")
