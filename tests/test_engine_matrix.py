"""Every shipped policy x scope x tier stack runs through the one engine on the CPU with its real statistics, and
a policy that needs a statistic the scope or the kernel cannot give is refused when the engine is built."""

import numpy as np
import pytest
import torch

from kvtier.budget import TokenBudget
from kvtier.engine import Engine
from kvtier.errors import ConfigError
from kvtier.models import kv_layout_for, tiny_llama
from kvtier.policies import POLICIES, LRU, Compose, SinkWindow
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.scopes import All, Resident, Scope, TopK
from kvtier.tiers import DeviceTier, DiskTier, HostTier, RedisTier

SHIPPED = [name for name in POLICIES if name not in ("scored", "compose")]
STACKS = ["device", "host", "disk", "redis"]


@pytest.fixture(scope="module")
def tiny():
    model = tiny_llama(seed=2)
    return model, kv_layout_for(model.config, page_size=8, dtype=torch.float32)


@pytest.fixture(scope="module")
def redis_url():
    from kvtier.tiers.redis_server import LocalRedis

    try:
        server = LocalRedis()
    except Exception as e:  # the [redis] extra is part of the dev install; say so when it is not
        pytest.skip(f"no redis-server: {e}")
    yield server.url
    server.stop()


def tiers_for(layout, stack, tmp_path, redis_url):
    tiers = [DeviceTier(layout, 64 if stack == "device" else 6, device="cpu")]
    if stack != "device":
        tiers.append(HostTier(layout, 4 if stack in ("disk", "redis") else 64))
    if stack == "disk":
        tiers.append(DiskTier(layout, 64, tmp_path / "disk"))
    if stack == "redis":
        tiers.append(RedisTier(layout, 64, redis_url))
    return tiers


def policy_of(name):
    return POLICIES[name]() if name == "lru" else POLICIES[name](sinks=4, window=8)


class Heard:
    """Wraps a policy: counts what it hears."""

    def __init__(self, policy):
        self.counts = {"access": 0}
        real = policy.on_access

        def spy(*args):
            self.counts["access"] += 1
            return real(*args)
        policy.on_access = spy


@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("scope", ["all", "resident", "topk"])
def test_every_policy_runs_with_its_statistics(tiny, tmp_path, redis_url, stack, scope):
    model, layout = tiny
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(5))
    for name in SHIPPED:
        policy = policy_of(name)
        heard = Heard(policy)
        chooser = {"all": All(), "resident": Resident(), "topk": TopK(3)}[scope]
        engine = Engine(model, layout, tiers_for(layout, stack, tmp_path / name / scope, redis_url), policy, chooser,
                        prefill=ChunkedPrefill(16))
        engine.add(prompt)
        logits = [engine.step() for _ in range(4)]
        engine.feedback.take(upto=engine.step_idx)
        assert all(torch.isfinite(x).all() for x in logits), name
        if "salience" in policy.needs:  # Φ: mean over the observed steps of Σ over kv heads of a max probability
            phi = policy.store.salience_mean(engine.table.pages(0))  # [L, n]
            seen = np.isfinite(phi)
            assert seen[:, -1].all() and seen.mean() > 0.5, name  # the newest page: attended by every step
            assert ((phi[seen] > 0) & (phi[seen] <= layout.num_kv_heads + 1e-5)).all(), name
        if "attention" in policy.needs:  # each query row observed gives each kv head of each layer a mass of 1
            store, rows = policy.store, prompt.numel() + 4  # every prompt row (chunks of 16 <= rows kept), 4 steps
            want = {"total": rows, "last": 1, "window": min(store.rows, rows)}
            for field, got in store.device.attention.read().items():
                assert got.sum() == pytest.approx(want[field] * layout.num_layers * layout.num_kv_heads, rel=1e-5), \
                    (name, field)
        if policy.hears_access:
            assert heard.counts["access"] > 0, name
        if "keys" in policy.needs:
            assert engine.keys is not None and float(engine.keys.count.sum()) == 44 * layout.num_layers
        engine.close()


def test_a_budgeted_step_runs_every_policy_through_topk_and_resident(tiny):
    model, layout = tiny
    prompt = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(6))
    for name in SHIPPED:
        for chooser in (Resident(), TopK()):
            engine = Engine(model, layout, [DeviceTier(layout, 64, device="cpu"), HostTier(layout, 64)],
                            policy_of(name), chooser, prefill=ChunkedPrefill(16), budget=TokenBudget(32, 4, 8, 8),
                            exact_prefill=True)
            engine.add(prompt)
            for _ in range(3):
                engine.step()
            engine.feedback.take(upto=engine.step_idx)
            assert engine.stats.attended_per_step() == [32.0] * 3, (name, chooser.name)


class Blind(Scope):
    """A user scope whose attention gives no per-page statistics."""

    name = "blind"
    gives = frozenset()

    def pick(self, layer, q, view):
        return None


def test_a_statistic_the_scope_or_kernel_cannot_give_is_refused_at_construction(tiny):
    model, layout = tiny
    tiers = lambda: [DeviceTier(layout, 64, device="cpu")]  # noqa: E731
    for needs in ("aspe", "h2o"):
        with pytest.raises(ConfigError) as e:
            Engine(model, layout, tiers(), policy_of(needs), Blind())
        assert e.value.field == "scope" and "blind" in str(e.value)
    Engine(model, layout, tiers(), SinkWindow(sinks=4, window=8), Blind())  # needs nothing: fine
    with pytest.raises(ConfigError) as e:
        Engine(model, layout, tiers(), Compose(rank=policy_of("h2o"), pins=[LRU()]), Blind())
    assert e.value.field == "scope"

    class NoSalience:
        from kvtier.kernels.base import Capabilities

        name, can = "flashinfer-like", Capabilities(page_stats=False)
    with pytest.raises(ConfigError) as e:
        Engine(model, layout, tiers(), policy_of("aspe"), All(), kernel=NoSalience())
    assert e.value.field == "kernel"
    from kvtier.engine import EngineConfig
    with pytest.raises(ConfigError) as e:
        Engine(model, layout, tiers(), LRU(), All(), config=EngineConfig(lookahead=0))
    assert e.value.field == "engine.lookahead"
    with pytest.raises(ConfigError) as e:
        Engine(model, layout, tiers(), "lru", All())
    assert e.value.field == "policy"

    class ReadsNothingBound(LRU):  # needs attention, but keeps no statistics to read it from
        needs = frozenset({"attention"})

    with pytest.raises(ConfigError, match="requests") as e:
        Engine(model, layout, tiers(), ReadsNothingBound(), All())
    assert e.value.field == "policy"


def test_python_api_mistakes_are_named(tiny):
    """A string policy, tiers out of order, a layout built for other heads, a float, empty, 2-D or
    out-of-vocabulary prompt and finishing an unknown sequence: each a named error, nothing half-built."""
    from kvtier import KVLayout
    from kvtier.errors import KVTierError

    model, layout = tiny
    tiers = lambda lay=layout: [DeviceTier(lay, 64, device="cpu")]  # noqa: E731
    with pytest.raises(ConfigError) as e:
        Engine(model, layout, tiers(), "sink_window", All())
    assert e.value.field == "policy" and "kvtier.policies" in str(e.value)
    for stack in ([HostTier(layout, 8), DeviceTier(layout, 8, device="cpu")], tiers() + tiers()):
        with pytest.raises(ConfigError, match="the device tier comes first and only once") as e:
            Engine(model, layout, stack, LRU(), All())
        assert e.value.field == "tiers"
    wrong = KVLayout(layout.num_layers, layout.num_kv_heads, layout.head_dim * 2, layout.page_size, "float32")
    with pytest.raises(ConfigError) as e:  # refused before anything is allocated
        Engine(model, wrong, tiers(wrong), LRU(), All())
    assert e.value.field == "layout.head_dim"
    engine = Engine(model, layout, tiers(), LRU(), All())
    seq = engine.open(10)
    with pytest.raises(ConfigError) as e:
        engine.prefill_chunk(seq, torch.rand(10))
    assert e.value.field == "prompt" and "integer" in str(e.value)
    vocab = model.config.vocab_size
    for bad, says in ((torch.zeros(0, dtype=torch.long), "non-empty 1-D"), (torch.zeros(2, 5, dtype=torch.long), "1-D"),
                      (torch.tensor([3, vocab]), f"in \\[0, {vocab}\\)"), (torch.tensor([-1, 3]), "from -1 to 3")):
        with pytest.raises(ConfigError, match=says) as e:
            engine.add(bad)
        assert e.value.field == "prompt"
    with pytest.raises(KVTierError, match="unknown sequence 99"):
        engine.finish(99)
    assert engine.row_seq.count(seq) == 1  # the bad calls changed nothing
