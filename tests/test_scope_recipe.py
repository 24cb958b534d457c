"""The recipe's ``scope`` group: each scope a class named by ``_target_`` with its own options (topk's Quest
settings), a user's Scope subclass decoding through the engine, and old or wrong keys named in one line."""

import math
import sys

import pytest

from kvtier.build import EngineFactory, build_scope, plan
from kvtier.errors import ConfigError
from kvtier.run import execute, job_configs, main, run_name
from kvtier.schema import MOVED
from kvtier.scopes import All, Resident, TopK

TINY = ["task.length=128", "task.prefix=96", "scheduler.prefill.chunk_size=16", "progress=false", "logger=none",
        "budget.fraction=0.75"]


def engine_for(args, tmp_path):
    """The engine a run of ``args`` builds (no model: nothing runs), and its plan."""
    (cfg,) = job_configs(args)
    factory = EngineFactory(cfg, p := plan(cfg), tmp_path, None)
    engine = factory()
    factory.close()
    return engine, p, cfg


@pytest.mark.parametrize("option,cls", [("all", All), ("resident", Resident), ("topk", TopK)])
def test_each_scope_option_builds_its_class_and_names_the_run(option, cls, tmp_path):
    engine, p, cfg = engine_for([f"scope={option}", "budget.fraction=0.5"], tmp_path)  # room for topk's key sketch
    assert type(engine.scope) is cls and p.labels["scope"] == option
    assert run_name(cfg).startswith(f"aspe-{option}-device_host-frac0.5-")


def test_topk_options_reach_the_scope_and_null_pages_are_the_device_tiers(tmp_path):
    engine, p, _ = engine_for(["scope=topk", "cache.sinks=8", "budget.fraction=0.5"], tmp_path)
    assert engine.scope.pages == p.capacities["device"] and engine.scope.sinks == 8  # sinks follow cache.sinks
    assert (engine.scope.unit, engine.scope.rank) == ("token", "sketch")  # the default: single keys by the sketch
    options = ["scope=topk", "scope.pages=3", "scope.sinks=0", "cache.attend_budget=true", "scope.unit=page",
               "scope.rank=quest_head", "scope.per_head=true", "scope.query_rows=2", "scope.policy_share=0.5"]
    engine, _, _ = engine_for(options, tmp_path)
    s = engine.scope
    assert (s.pages, s.sinks, s.recall_slots, s.rank, s.per_head, s.query_rows, s.policy_share) == \
        (3, 0, 0, "quest_head", True, 2, 0.5)
    with pytest.raises(ConfigError, match="scope.recall_slots: the recall cache admits one page list per row"):
        engine_for([*options, "scope.recall_slots=2"], tmp_path)  # each kv head's own list: no one row to admit
    (cfg,) = job_configs(["scope=topk", "scope.recall_slots=2", "scope.predictor=next_layer"])
    assert type(build_scope(cfg, 8).predictor).__name__ == "NextLayerQuery"
    with pytest.raises(ConfigError, match="compact runner"):  # an engine with no model (a hook's) predicts nothing
        engine_for(["scope=topk", "scope.recall_slots=2", "scope.predictor=next_layer", "budget.fraction=0.5"],
                   tmp_path)


def test_a_user_scope_named_by_target_decodes_through_the_engine(tmp_path):
    (cfg,) = job_configs([*TINY, "scope._target_=user_scope.Recent", "+scope.pages=3"])
    m = execute(cfg, tmp_path / "run")
    assert m["scope"] == "recent" and run_name(cfg).startswith("aspe-recent-")
    assert m["decode_steps"] > 0 and 1 < m["perplexity"] < math.inf
    assert 0 < m["attended_tokens_per_step_max"] <= 3 * 16  # its pick, not every page
    assert m["config"]["scope"] == {"_target_": "user_scope.Recent", "pages": 3}


@pytest.mark.parametrize("landing", [0, 1])
def test_a_recall_cache_with_a_predictor_reports_its_copies(landing, tmp_path):
    """topk with recall slots and prediction ahead through a recipe, on the real SmolLM2: metrics.json counts the
    pages the recall cache copied in after a read and ahead of one, the share of those the layers picked, and
    with a landing slot the misses admitted from where the decode kernel wrote them (no copy)."""
    (cfg,) = job_configs([*TINY, "scope=topk", "scope.pages=4", "scope.recall_slots=2", f"scope.landing_slots={landing}",
                          "scope.predictor=after_attention", "policy=sink_window", "scope.unit=page", "scope.rank=quest",
                          "budget.fraction=0.95"])  # Quest's key bounds take their share of the device
    m = execute(cfg, tmp_path / "run")
    assert m["pages_fetched_ahead"] > 0 and 0 <= m["predictor_accuracy"] <= 1
    assert m["recall_pages_copied"] + m["recall_pages_landed"] > 0 and (m["recall_pages_landed"] > 0) == bool(landing)
    assert m["config"]["scope"]["predictor"] == "after_attention" and 1 < m["perplexity"] < math.inf


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_cache_key_names_where_it_moved(old, tmp_path, monkeypatch, capsys):
    for args in ([f"{old}=1"], [f"+{old}=1"]):  # a key the recipe lacks, and one added past the schema
        with pytest.raises(ConfigError) as e:
            list(map(plan, job_configs(args)))
        assert e.value.field == old and f"moved to {MOVED[old]}" in str(e.value) and "scope=topk" in str(e.value)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["kvtier-run", f"{old}=1"])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err == f"kvtier-run: error: {old}: moved to {MOVED[old]}, an option of the " \
                                           f"topk scope: kvtier-run scope=topk {MOVED[old]}=..."
    assert list(tmp_path.iterdir()) == []


WRONG = [
    (["scope._target_=kvtier.policies.LRU"], "scope._target_", "subclass of kvtier.scopes.Scope"),
    (["scope._target_=user_scope.Nowhere"], "scope._target_", "has no 'Nowhere'"),
    (["scope=topk", "+scope.bogus=1"], "scope.bogus", "unexpected keyword argument 'bogus'"),
    (["scope=topk", "scope.bogus=1"], "scope", "has no key 'bogus'"),
    (["scope._target_=user_scope.Recent", "+scope.rank=quest"], "scope.rank", "unexpected keyword argument 'rank'"),
    (["scope._target_=user_scope.Recent", "+scope.pages=0"], "scope.pages", ">= 1"),
    (["scope=topk", "scope.pages=0"], "scope.pages", ">= 1"),
    (["scope=topk", "scope.recall_slots=-1"], "scope.recall_slots", ">= 0"),
    (["scope=topk", "scope.predictor=next_layer"], "scope.predictor", "set scope.recall_slots"),
    (["scope=topk", "scope.recall_slots=2", "scope.predictor=oracle"], "scope.predictor", "unknown predictor"),
]


@pytest.mark.parametrize("args,field,hint", WRONG, ids=[" ".join(a) for a, _, _ in WRONG])
def test_a_wrong_scope_is_named_before_the_model_loads(args, field, hint):
    with pytest.raises(ConfigError) as e:
        list(map(plan, job_configs(args)))
    assert e.value.field == field and hint in str(e.value), str(e.value)
