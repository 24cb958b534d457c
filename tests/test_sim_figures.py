"""kvtier.sim's figures, pinned: no step beats its bytes at the measured HBM rate or its FLOPs at the measured
peak (formulas written out here from the model's shape, not the simulator's), the measured rates are a sane share
of their datasheets, the dense decode roofline is the benches' own physical limit, the held-out validation, and
golden figures of every scenario (each at a small size; tolerance 2%: a setting that moves a figure fails here).

The golden figures come from the code at the commit that added them (``python -m pytest tests/test_sim_figures.py``
prints the new value of one that moved); when a change of the model moves them, the new values and the reason go
in with it, and bench/RESULTS.md's simulator tables are rerun.

Each shortcut issue 59 found, put back alone (tree f17842b) and run against ``tests/test_sim.py`` and this file:

| mutation | tests that fail |
| --- | --- |
| H100 HBM rate and bf16 peak 10x (`h100.json`) | share of datasheet, no step under its floor, dense-decode limit, all 4 scenarios, regenerated calibration |
| H100 datasheet HBM and peaks 10x (`hardware.GPUS`) | share of datasheet, held-out errors (cross-kind from the datasheet) |
| seed 000's throughput formula x3 | long-context offload figures |
| 60% of HBM reserved (`setups.HBM_RESERVED`) | all 4 scenarios' figures |
| all-reduce free, or its latency 0 (`costs`) | FP8 / all-reduce physics (both kinds), all 4 scenarios |
| the assumed latency 0 (`hardware.ALLREDUCE_LATENCY_US`) | regenerated calibration (its all-reduce line) |
| swaps free (`cluster._swap_ms`) | preemption: swaps cross the host link |
| step-time noise off (`cluster`) | noise is the measured spread; P/D (seed 001's jitter), memory managers, KV pool |
| FP8 weights at the bf16 peak | FP8 / all-reduce physics, long-context offload, memory managers |
| FP8 pages counted at bf16's bytes | FP8 / all-reduce physics, all 4 scenarios |
| linear layers' bytes + FLOPs summed (no roofline max) | dense-decode limit, held-out errors, regenerated calibration, 3 scenarios |
| held-out rows fitted too (`calibrate.fit_engine`) | held-out errors, regenerated calibration |
"""

import itertools

import numpy as np
import pytest

from kvtier.run import RECIPES
from kvtier.sim.calibration import load_calibration
from kvtier.sim.costs import StepCosts
from kvtier.sim.hardware import GPUS, MODELS
from kvtier.sim.kv_pool_cluster import KVPoolCluster
from kvtier.sim.long_context_offload import LongContextOffload
from kvtier.sim.measured import GROUPS, e2e_files, kind_of, read_json
from kvtier.sim.memory_managers import MemoryManagers
from kvtier.sim.pd_disaggregation import PDDisaggregation
from kvtier.sim.split import HELD_OUT
from kvtier.sim.validate import validation

BENCH = RECIPES.parents[1] / "bench" / "results"
GOLD = 0.02


@pytest.fixture(scope="module", params=["H100", "H200"])
def cal(request):
    return load_calibration(request.param)


def test_measured_rates_are_a_sane_share_of_their_datasheets(cal):
    """A microbenchmark reaches 60-100% of its datasheet: an HBM rate or a peak 10x off either way fails."""
    for name, share in cal.efficiency().items():
        assert 0.6 <= share <= 1.0, f"{cal.gpu} {name}: measured / datasheet = {share:.2f}"


def _floor_ms(model, tp, rows, keys, parts, kv_bytes, weight_bytes, hbm_GBps, bf16_tflops, fp8_ratio):
    """Bytes every step must move at the HBM rate, FLOPs it must do at the peak: the larger (ms), per GPU."""
    embed = model.vocab * model.hidden
    read = (model.params - (0 if model.tied else embed)) * weight_bytes  # an untied embedding: rows only
    read += keys * 2 * model.layers * model.kv_heads * model.head_dim * kv_bytes
    peak = bf16_tflops * 1e12 * (fp8_ratio if weight_bytes == 1 else 1.0)
    head = embed if not model.tied else 0  # an untied output head, beside the matmul weights
    matmul = model.params - embed - head
    flops = 2 * (matmul + embed) * rows + sum(2 * matmul * n for n, _ in parts)
    attn = 4 * model.layers * model.q_heads * model.head_dim * (keys + sum(n * (p + (n + 1) / 2) for n, p in parts))
    return max(read / (hbm_GBps * 1e9), flops / peak, attn / (bf16_tflops * 1e12)) / tp * 1e3


def test_no_step_is_faster_than_its_bytes_or_its_flops_allow(cal):
    """Over a grid of models, TP degrees, batches, contexts, prompt chunks and dtypes: the roofline step is no
    faster than its floor at the measured rates, and neither it nor kvtier's engine beats the floor at the
    datasheet's rates (the engine's fitted multipliers may undercut a microbenchmark: the H200's KV read is 0.92x
    its x.sum() rate, not the datasheet)."""
    sheet = GPUS[cal.gpu]
    ratio = sheet.fp8_tflops / sheet.bf16_tflops
    rng = np.random.default_rng(0)
    for model, tp, kv, w in itertools.product(MODELS.values(), (1, 2, 8), (2.0, 1.0), (2.0, 1.0)):
        roof = StepCosts(cal, model, tp=tp, kv_bytes=kv, weight_bytes=w, engine=False)
        eng = StepCosts(cal, model, tp=tp, kv_bytes=kv, weight_bytes=w)
        for _ in range(6):
            rows = int(rng.integers(0, 600))
            keys = rows * float(rng.integers(1, 200_000))
            parts = [(int(rng.integers(1, 8192)), int(rng.integers(0, 100_000))) for _ in range(rng.integers(0, 3))]
            if not rows and not parts:
                continue
            t_roof, t_eng = roof.iteration_ms(rows, keys, parts), eng.iteration_ms(rows, keys, parts)
            measured = _floor_ms(model, tp, rows, keys, parts, kv, w, cal.hbm_GBps, cal.bf16_tflops, ratio)
            datasheet = _floor_ms(model, tp, rows, keys, parts, kv, w, sheet.hbm_GBps, sheet.bf16_tflops, ratio)
            assert t_roof >= measured * (1 - 1e-9) and t_roof >= datasheet and t_eng >= datasheet


def test_fp8_collectives_and_preemption_cost_what_their_physics_says(cal):
    """Llama-3-70B on 8 GPUs, the roofline: FP8 weights halve a compute-bound prefill's matmuls (the FP8 peak is
    twice bf16's) and FP8 pages halve a memory-bound decode's KV read; on kvtier's engine FP8 pages are still
    cheaper than bf16 ones (its measured kernel ratio); every layer pays two ring all-reduces on the calibration's
    alpha-beta line (latency + bytes at the bus rate), none on one GPU; a swap's bytes cross the host link at its
    measured rate."""
    m, sheet = MODELS["llama70b"], GPUS[cal.gpu]
    bf16, fp8 = (StepCosts(cal, m, tp=8, kv_bytes=b, weight_bytes=b, engine=False) for b in (2.0, 1.0))
    assert fp8.linear_ms(0, 8192) == pytest.approx(bf16.linear_ms(0, 8192) * sheet.bf16_tflops / sheet.fp8_tflops)
    keys = 64 * 131072
    assert fp8.decode_attention_ms(keys) == pytest.approx(bf16.decode_attention_ms(keys) / 2)
    eng = {b: StepCosts(cal, m, tp=8, kv_bytes=b).decode_attention_ms(keys) for b in (2.0, 1.0)}
    assert eng[1.0] < eng[2.0]
    tokens, lat = 512, cal.allreduce["latency_us"]
    ring = 2 * m.layers * (lat * 1e-6 + 2 * 7 / 8 * tokens * m.hidden * 2 / (cal.allreduce["bus_GBps"] * 1e9)) * 1e3
    assert bf16.allreduce_ms(tokens) == pytest.approx(ring) and ring > 2 * m.layers * lat * 1e-3
    assert StepCosts(cal, m, tp=1, engine=False).allreduce_ms(tokens) == 0.0
    assert bf16.host_ms(1000.0) == pytest.approx(1000.0 / cal.host_GBps)


def test_the_dense_decode_roofline_is_the_benches_own_physical_limit(cal):
    """bench.e2e's ``limit`` rows (every weight and all KV once at the HBM rate it measured, its own code): the
    simulator's bf16 decode roofline at the calibration's rate gives each within 2%."""
    limits = [(d, r) for d in map(read_json, e2e_files(BENCH)) if kind_of(d["gpu"]) == cal.gpu
              for r in d["rows"] if r.get("system") == "limit"]
    assert len(limits) >= 4
    for d, r in limits:
        c = StepCosts(cal, MODELS[r["model"]], engine=False)
        assert c.decode_ms(r["B"], r["B"] * r["S"], serve=False) == pytest.approx(r["tpot_p50_ms"], rel=0.02)


@pytest.fixture(scope="module")
def checked():
    return validation(BENCH)


def test_held_out_rows_of_every_group_on_every_kind_are_never_fitted(checked):
    for kind in ("H100", "H200"):
        cal = load_calibration(kind)
        rows = checked["same_gpu"][kind]["rows"]
        for group in GROUPS:
            held = [r for r in rows if r["group"] == group and r["held_out"]]
            assert held, f"{kind} {group}: no held-out row"
            assert not {r["id"] for r in held} & set(cal.anchors[group])
            assert {r["id"] for r in held} <= set(HELD_OUT[group])


def test_the_validation_s_held_out_errors(checked):
    """Targets: median <= 10%, worst <= 25%, on the same GPU and across kinds. The medians meet them; the worst
    do not (bench/RESULTS.md says which rows and why): pinned at what they are."""
    assert checked["median_error"] <= 0.10 and checked["cross_hardware"]["median_error"] <= 0.10
    assert checked["cross_hardware_datasheet"]["median_error"] <= 0.10
    assert checked["median_error"] == pytest.approx(0.0402, abs=0.002)
    assert checked["worst_error"] == pytest.approx(0.2921, abs=0.002)
    assert checked["cross_hardware"]["median_error"] == pytest.approx(0.0599, abs=0.002)
    assert checked["cross_hardware"]["worst_error"] == pytest.approx(0.5784, abs=0.002)
    assert checked["cross_hardware"]["H200->H100"]["worst_error"] == pytest.approx(0.2864, abs=0.002)
    for kind, worst in (("H100", {"decode": 0.2781, "recall": 0.0453, "prefill": 0.0659, "serving": 0.1127}),
                        ("H200", {"decode": 0.0402, "recall": 0.2921, "prefill": 0.1560, "serving": 0.0144})):
        assert checked["same_gpu"][kind]["groups"] == pytest.approx(worst, abs=0.002)


def _gold(got: dict, want: dict):
    bad = {k: (got[k], v) for k, v in want.items() if got[k] != pytest.approx(v, rel=GOLD)}
    assert not bad, f"moved (got, golden): {bad}"


def test_long_context_offload_figures():
    r = LongContextOffload(load_calibration("H100"), placement_steps=4).run()
    e, f = r["engine"], r["roofline"]
    _gold({"engine tok/s": e["tok_s_seed_hit"], "roofline tok/s": f["tok_s_seed_hit"],
           "engine tok/s, LRU": e["tok_s_policy_hit"], "min offloaded engine": e["min_offloaded"],
           "min offloaded roofline": f["min_offloaded"], "TTFT engine": e["ttft_s"], "TTFT roofline": f["ttft_s"],
           "LRU hit": r["hit_rates"]["LRU"]},
          {"engine tok/s": 576.37, "roofline tok/s": 926.42, "engine tok/s, LRU": 96.08,
           "min offloaded engine": 0.6550, "min offloaded roofline": 0.6037, "TTFT engine": 156.94,
           "TTFT roofline": 70.23, "LRU hit": 0.9640})
    # no more than the batch over the step's weight read (FP8, all 8 GPUs' HBM), whatever is attended
    cal, m = load_calibration("H100"), MODELS["llama70b"]
    assert f["tok_s_seed_hit"] < 16 / (m.params / 8 / (cal.hbm_GBps * 1e9))


def test_pd_disaggregation_figures():
    r = PDDisaggregation(load_calibration("H100"), requests=150).run()
    want = {"engine": {"mono TTFT p99": 2.5245, "disagg TTFT p99": 9.2997, "disagg ITL p99": 12.620,
                       "seqs per node": 240.37, "4,096 prefill": 178.95, "ratio": 0.11892,
                       "mono ITL std": 24.368, "disagg ITL std": 0.33665},
            "roofline": {"mono TTFT p99": 1.9700, "disagg TTFT p99": 7.3457, "disagg ITL p99": 7.5920,
                         "seqs per node": 240.37, "4,096 prefill": 151.34, "ratio": 0.094717,
                         "mono ITL std": 15.290, "disagg ITL std": 0.18200}}
    for side, w in want.items():
        s = r[side]
        _gold({"mono TTFT p99": s["monolithic"]["ttft_p99_s"], "disagg TTFT p99": s["disaggregated"]["ttft_p99_s"],
               "disagg ITL p99": s["disaggregated"]["itl_p99_ms"], "seqs per node": s["seqs_per_node"],
               "4,096 prefill": s["prefill_ms_4096"], "ratio": s["ratio"],
               "mono ITL std": s["monolithic"]["itl_std_ms"], "disagg ITL std": s["disaggregated"]["itl_std_ms"]}, w)
        assert s["disaggregated"]["itl_p50_ms"] >= s["weights_ms"]  # no decode step beats reading its weights
    # the jitter verdict is not by construction: the engine's disaggregated ITL spreads more than the roofline's,
    # by the measured step-time noise
    assert r["engine"]["disaggregated"]["itl_std_ms"] > 1.5 * r["roofline"]["disaggregated"]["itl_std_ms"]


def test_memory_managers_figures():
    r = MemoryManagers(load_calibration("H100"), requests=300, rounds=3).run()["engines"]
    want = {("contiguous", "engine"): (44, 33.17, 17.890, 105.84, 0.11244),
            ("contiguous", "roofline"): (44, 33.93, 8.8278, 79.430, 0.11244),
            ("paged BF16", "engine"): (404, 58.95, 3.0099, 114.46, 0.99099),
            ("paged BF16", "roofline"): (404, 50.81, 1.9469, 81.823, 0.99102),
            ("disaggregated FP8", "engine"): (284, 18.49, 3.3807, 21.910, 0.99797),
            ("disaggregated FP8", "roofline"): (404, 15.89, 1.5944, 9.0488, 0.99797)}
    for (name, side), values in want.items():
        s = r[name][side]
        keys = ("max_streams", "streams", "ttft_p95_s", "itl_p99_ms", "kv_util")
        _gold({f"{name} {side} {k}": s[k] for k in keys}, {f"{name} {side} {k}": v for k, v in zip(keys, values)})


def test_kv_pool_cluster_figures():
    """A shared pool finds more of the prompts than each instance's HBM, routing by the cache more than by load."""
    k = KVPoolCluster(load_calibration("H100"), requests=3000)
    rows = {(p, r): k.run_one(p, r) for p, r in (("hbm", "least_loaded"), ("hbm", "cache_aware"),
                                                 ("pool", "cache_aware"))}
    want = {("hbm", "least_loaded"): (0.05847, 1.1189), ("hbm", "cache_aware"): (0.22910, 0.36265),
            ("pool", "cache_aware"): (0.31186, 0.26305)}
    for key, (hit, ttft) in want.items():
        _gold({f"{key} hit": rows[key]["prefix_hit"], f"{key} TTFT p50": rows[key]["ttft_p50_s"]},
              {f"{key} hit": hit, f"{key} TTFT p50": ttft})
