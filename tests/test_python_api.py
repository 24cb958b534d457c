"""The Python door's rules, each as a script against the public API would meet it (real SmolLM2 where a model runs):
one sizing rule with the recipes, the fastest kernel by default, the model's attention back when a cache closes, step
outputs the caller keeps, one budget object and one kernel keyword on every door, every scope option reachable, one
CUDA-graphs rule."""

import gc

import pytest
import torch

import kvtier
from kvtier import (DeviceTier, Engine, EngineConfig, HostTier, SinkWindow, TieredKVCache, TokenBudget,
                    kv_layout_for)
from kvtier.build import build, plan
from kvtier.checks import graphs_for
from kvtier.errors import ConfigError
from kvtier.kernels.reference import TorchBackend
from kvtier.offload import recipe_node
from kvtier.run import job_configs

TEXT = "The light of the sun is made of rays of many colours. "


@pytest.fixture
def model(smollm2):
    """SmolLM2 with its own (sdpa) attention before and after the test (earlier tests' caches, collected, route it
    no more)."""
    gc.collect()
    smollm2[0].set_attn_implementation("sdpa")
    yield smollm2[0]
    smollm2[0].set_attn_implementation("sdpa")


@pytest.fixture(scope="module")
def ids(smollm2):
    return smollm2[1](TEXT * 10, return_tensors="pt").input_ids  # [1, 131]


def layout_of(model):
    return kv_layout_for(model.config, page_size=16, dtype=model.dtype)


# -- item 3: one sizing rule ----------------------------------------------------------------------
def test_recipes_and_cache_for_size_one_stack_alike(model):
    """The default recipe's task with budget.fraction=0.3, and cache_for with hbm=0.3 for the same context: the
    same pages per tier (one rule, kvtier.build.size_stack)."""
    cfg = next(job_configs(["policy=sink_window", "budget.fraction=0.3", "tiers=device_host"]))
    recipe, task = plan(cfg), build(cfg.task, "task")
    cache = kvtier.cache_for(model, task.context_tokens, task.new_tokens, policy="sink_window", hbm=0.3)
    with cache:
        assert {t.name: t.capacity for t in cache.table.tiers} == recipe.capacities
    # a batch's rows each get the budget; the scratch slot their idle rows write comes out of it, as in the recipes
    with kvtier.cache_for(model, 131, 4, policy="sink_window", hbm=0.4, batch_size=2) as batch:
        assert batch.table.tiers[0].capacity == 2 * batch.layout.pages_for(int(0.4 * 131))


# -- (a) the fastest kernel for the device --------------------------------------------------------
def test_cache_for_picks_the_recipes_kernel_for_the_device(model, monkeypatch):
    """cache_for's default kernel is the recipes' (``kernel: auto``): the torch reference on this CPU, Triton on a
    GPU."""
    with kvtier.cache_for(model, 131, 4, hbm=0.3) as cache:
        assert isinstance(cache.engine.kernel, TorchBackend)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # what the recipe node builds for a model on a GPU
    assert build(recipe_node("kernel", "auto", "cuda"), "kernel").name == "triton"


# -- (b) the model's attention back -----------------------------------------------------------------
def test_a_closed_cache_gives_the_model_its_attention_back(model, ids):
    with kvtier.cache_for(model, ids.shape[1], 2, hbm=0.3) as cache:
        model.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False)
        assert model.config._attn_implementation == "kvtier"
    assert model.config._attn_implementation == "sdpa"
    model.generate(ids, max_new_tokens=2, do_sample=False)  # a plain generate works again
    first, second = (kvtier.cache_for(model, ids.shape[1], 2, hbm=0.3) for _ in range(2))
    first.close()
    assert model.config._attn_implementation == "kvtier"  # the second cache is still open
    with kvtier.offload(model, hbm=0.3):
        model.generate(ids, max_new_tokens=2, do_sample=False)
    assert model.config._attn_implementation == "kvtier"  # the offload block restored what it found
    second.close()
    assert model.config._attn_implementation == "sdpa"
    with kvtier.offload(model, hbm=0.3):
        pass
    assert model.config._attn_implementation == "sdpa"  # not the kvtier attention an earlier cache left


# -- (c) step outputs the caller keeps ------------------------------------------------------------
def test_engine_step_outputs_are_the_callers(model, ids):
    layout = layout_of(model)
    engine = Engine(model, layout, [DeviceTier(layout, 16), HostTier(layout, 16)], SinkWindow(4, 16), "resident",
                    config=EngineConfig(max_batch=2))
    try:
        engine.add(ids[0])
        first = engine.step()
        kept = first.clone()
        second = engine.step()
        other = engine.open(16)
        third = engine.iterate([(other, ids[0, :16])])
        assert torch.equal(first, kept) and not torch.equal(first, second)  # the next steps wrote elsewhere
        assert third.logits.data_ptr() not in (first.data_ptr(), second.data_ptr())
    finally:
        engine.close()


# -- (d) one budget object -----------------------------------------------------------------------
def test_one_token_budget_on_the_engine_and_the_cache(model):
    layout = layout_of(model)
    budget = TokenBudget(64, sinks=4, window=16)  # no page size: the layout's
    engine = Engine(model, layout, [DeviceTier(layout, 16), HostTier(layout, 16)], SinkWindow(4, 16), "resident",
                    budget=budget)
    cache = TieredKVCache(layout, [DeviceTier(layout, 16), HostTier(layout, 16)], SinkWindow(4, 16), scope="resident",
                          budget=budget)
    assert engine.budget == cache.engine.budget == TokenBudget(64, 4, 16, layout.page_size)
    for make in (lambda: Engine(model, layout, [DeviceTier(layout, 16)], SinkWindow(4, 16), "resident", budget=64),
                 lambda: TieredKVCache(layout, [DeviceTier(layout, 16)], SinkWindow(4, 16), scope="resident", budget=64)):
        with pytest.raises(ConfigError) as err:
            make()
        assert err.value.field == "budget" and "kvtier.TokenBudget(64)" in str(err.value)
    engine.close()
    cache.close()


# -- (e) one kernel keyword ----------------------------------------------------------------------
def test_kernel_is_the_keyword_on_every_door(model):
    layout = layout_of(model)
    for kernel in ("torch", TorchBackend()):  # a name or a backend, on the engine and the cache alike
        engine = Engine(model, layout, [DeviceTier(layout, 16)], SinkWindow(4, 16), kernel=kernel)
        cache = TieredKVCache(layout, [DeviceTier(layout, 16)], SinkWindow(4, 16), kernel=kernel)
        assert isinstance(engine.kernel, TorchBackend) and isinstance(cache.engine.kernel, TorchBackend)
    for make in (lambda: TieredKVCache(layout, [DeviceTier(layout, 16)], SinkWindow(4, 16), backend=TorchBackend()),
                 lambda: kvtier.cache_for(model, 131, 4, hbm=0.3, backend="torch"),
                 lambda: kvtier.offload(model, hbm=0.3, backend="torch").__enter__()):
        with pytest.raises(ConfigError) as err:
            make()
        assert err.value.field == "backend" and "kernel=" in str(err.value)


# -- (f) every scope option ----------------------------------------------------------------------
def test_every_topk_option_reaches_the_cache(model, ids):
    quest = dict(scope="topk", topk_pages=2, unit="page", rank="quest", sinks=8)
    with kvtier.cache_for(model, 131, 4, hbm=0.5, **quest) as cache:
        scope = cache.engine.scope
        assert (scope.pages, scope.unit, scope.rank, scope.sinks) == (2, "page", "quest", 8)
    with kvtier.offload(model, hbm=0.5, scope="topk", sketch_rank=8) as caches:
        model.generate(ids, max_new_tokens=2, do_sample=False)
    assert caches[0].engine.scope.sketch_rank == 8
    assert caches[0].engine.scope.pages == caches[0].table.tiers[0].capacity  # no topk_pages: the device's pages
    for options in ({"topk_pages": 2}, {"unit": "page"}):
        with pytest.raises(ConfigError) as err:
            kvtier.cache_for(model, 131, 4, hbm=0.5, scope="resident", **options)
        assert err.value.field == f"scope.{next(iter(options))}"


# -- (g) one CUDA-graphs rule --------------------------------------------------------------------
def test_one_graphs_rule_on_every_door(model):
    """null: captured where a step can be; true where it cannot: a named error; the cache's engine follows it too
    (generate runs the forward, so there is nothing to capture: off, not silently forced)."""
    assert graphs_for(None, "cuda", False, False) is True
    assert not any(graphs_for(None, *case) for case in (("cpu", False, False, True), ("cuda", True, False, True),
                                                         ("cuda", False, True, True), ("cuda", False, False, False)))
    for case in (("cpu", False, False, True), ("cuda", False, False, False), ("cuda", True, False, True)):
        with pytest.raises(ConfigError) as err:
            graphs_for(True, *case)
        assert err.value.field == "engine.graphs"
    layout = layout_of(model)
    cache = TieredKVCache(layout, [DeviceTier(layout, 16)], SinkWindow(4, 16))
    assert cache.engine.config.graphs is None and cache.engine.graphs is False
    with pytest.raises(ConfigError) as err:
        Engine(model, layout, [DeviceTier(layout, 16)], SinkWindow(4, 16), config=EngineConfig(graphs=True))
    assert err.value.field == "engine.graphs"
