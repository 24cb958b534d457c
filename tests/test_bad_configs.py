"""Bad configuration at every library boundary: a named ConfigError (field + what to change), nothing written."""

import os

import pytest

from kvtier import KVLayout
from kvtier.errors import ConfigError

LAYOUT = dict(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float32")


def layout():
    return KVLayout(**LAYOUT)


def device(capacity=4):
    from kvtier.tiers import DeviceTier

    return DeviceTier(layout(), capacity, device="cpu")


def cache(**kw):
    from kvtier.cache import TieredKVCache
    from kvtier.policies import LRU

    return TieredKVCache(layout(), [device()], kw.pop("policy", LRU()), **kw)


def flashinfer_with_aspe():
    from kvtier.kernels.flashinfer import FlashInferBackend
    from kvtier.policies import ASPE

    return cache(policy=ASPE(), kernel=FlashInferBackend.__new__(FlashInferBackend))


def tier_of(kind, capacity, tmp_path):
    from kvtier.tiers import DiskTier, HostTier

    return HostTier(layout(), capacity) if kind == "host" else DiskTier(layout(), capacity, tmp_path / "d")


CASES = {
    "page_size zero": (lambda p: KVLayout(**{**LAYOUT, "page_size": 0}), "page_size"),
    "page_size not a power of two": (lambda p: KVLayout(**{**LAYOUT, "page_size": 24}), "page_size"),
    "negative layers": (lambda p: KVLayout(**{**LAYOUT, "num_layers": -2}), "num_layers"),
    "zero kv heads": (lambda p: KVLayout(**{**LAYOUT, "num_kv_heads": 0}), "num_kv_heads"),
    "unsupported dtype": (lambda p: KVLayout(**{**LAYOUT, "dtype": "int4"}), "dtype"),
    "device capacity zero": (lambda p: device(0), "capacity"),
    "host capacity negative": (lambda p: tier_of("host", -3, p), "capacity"),
    "disk capacity zero": (lambda p: tier_of("disk", 0, p), "capacity"),
    "disk path under a file": (lambda p: (p / "f").write_text("x") and __import__("kvtier.tiers", fromlist=["DiskTier"])
                               .DiskTier(layout(), 4, p / "f" / "sub"), "tiers.stack.disk.path"),
    "negative window": (lambda p: __import__("kvtier.policies", fromlist=["SinkWindow"]).SinkWindow(window=-1),
                        "policy.window"),
    "negative sinks": (lambda p: __import__("kvtier.policies", fromlist=["ASPE"]).ASPE(sinks=-1), "policy.sinks"),
    "aspe thresholds crossed": (lambda p: __import__("kvtier.policies", fromlist=["ASPE"]).ASPE(
        theta_evict=0.2, theta_prefetch=0.1), "policy.theta_evict"),
    "aspe empty observation window": (lambda p: __import__("kvtier.policies", fromlist=["ASPE"]).ASPE(obs_window=0),
                                      "policy.obs_window"),
    "compose without ranking": (lambda p: __import__("kvtier.policies", fromlist=["Compose"]).Compose(),
                                "policy.rank"),
    "no moves per step": (lambda p: __import__("kvtier.scheduler", fromlist=["LookaheadScheduler"]).LookaheadScheduler(
        max_moves_per_step=0), "scheduler.placement.max_moves_per_step"),
    "chunk size zero": (lambda p: __import__("kvtier.scheduler.chunked_prefill", fromlist=["ChunkedPrefill"])
                        .ChunkedPrefill(0), "scheduler.prefill.chunk_size"),
    "unknown scope": (lambda p: cache(scope="nearby"), "scope"),
    "topk without k": (lambda p: cache(scope="topk"), "scope.pages"),
    "unknown kernel": (lambda p: __import__("kvtier.kernels.registry", fromlist=["make_backend"]).make_backend("cutlass"),
                       "kernel"),
    "salience policy on flashinfer": (lambda p: flashinfer_with_aspe(), "kernel"),
    "unknown transfer method": (lambda p: __import__("kvtier.mover", fromlist=["TransferEngine"]).TransferEngine(
        cache().table, method="rdma"), "transfer.method"),
    "model path missing": (lambda p: __import__("kvtier.models", fromlist=["load_model"]).load_model(
        str(p / "no-such-model")), "model.path"),
    "model dtype": (lambda p: __import__("kvtier.models", fromlist=["load_model"]).load_model(None, dtype="int8"),
                    "model.dtype"),
    "unknown task": (lambda p: __import__("kvtier.eval", fromlist=["build_task"]).build_task("summarize"), "task"),
    "unknown text": (lambda p: __import__("kvtier.eval.perplexity", fromlist=["Perplexity"]).Perplexity(
        text="hamlet"), "task.text"),
    # issue 60
    "disk path under /proc": (lambda p: __import__("kvtier.tiers", fromlist=["DiskTier"]).DiskTier(
        layout(), 4, "/proc/kvtier"), "tiers.stack.disk.path"),
    "redis timeout zero": (lambda p: __import__("kvtier.tiers", fromlist=["RedisTier"]).RedisTier(
        layout(), 4, "redis://127.0.0.1:1/0", timeout_s=0, name="remote"), "tiers.stack.remote.timeout_s"),
    "prompt over max_context": (lambda p: engine(max_context=32).open(100), "engine.max_context"),
    "graphs on a CPU": (lambda p: engine(graphs=True), "engine.graphs"),
    "dense layers past the model's": (lambda p: cache(dense_layers=5), "cache.dense_layers"),
    "rows not runs of a prompt": (lambda p: cache(batch_size=3, expand=2), "expand"),
    "perplexity shorter than its prefix": (lambda p: __import__("kvtier.eval.perplexity", fromlist=["Perplexity"])
                                           .Perplexity(length=2), "task.length"),
    "model path a file": (lambda p: (p / "f").write_text("x") and __import__("kvtier.models", fromlist=["load_model"])
                          .load_model(str(p / "f")), "model.path"),
}


def engine(**config):
    from kvtier.engine import Engine, EngineConfig
    from kvtier.policies import LRU

    return Engine(None, layout(), [device(16)], LRU(), config=EngineConfig(**config))


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_config_is_named(name, tmp_path):
    make, field = CASES[name]
    before = set(os.listdir(tmp_path))
    with pytest.raises(ConfigError) as e:
        make(tmp_path)
    assert e.value.field == field, str(e.value)
    assert field in str(e.value)
    assert set(os.listdir(tmp_path)) - before <= {"f"}  # nothing written (but the test's own file)


def test_at_least_twenty_distinct_cases():
    assert len(CASES) >= 20
