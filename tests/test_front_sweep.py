"""Issue 60's front-end sweep (bench/front_sweep.py), a fast part of it in the suite: the inputs refused before any
model loads (kvtier-run and the Python door) and the few Python-door cases whose fix needs the model, each classed
as the full sweep classes it (named: one line naming the key and value at fault; never a traceback, a silent run, a
check after the model loaded, a wrong key or a printed password)."""

import pytest

from bench import front_sweep as sweep

CLI = [  # each was a traceback, a wrong key or a check after the model loaded on main before this sweep (the issue's
    # own cases are held by tests/test_trust.py and tests/test_bad_configs.py); then a few of the wordings
    "model.device tpu", "model.attn_implementation bogus", "host.pin_memory text", "placement not a scheduler", "scope.pages under resident",
    "cache.fidelity maybe", "engine.compile maybe", "cache.attend_budget window over budget",
    "disk.size over the free disk", "page_size over context",
    "task.length 2", "host.capacity", "disk.fraction zero", "remote.url password, nothing answers",
    "task.length 128 alone (default budget too small for aspe)",
]
FILES = ["config.json a JSON array", "gguf missing", "model.path a plain file", "run dir on a read-only file system"]
PYTHON_BARE = [  # no model needed
    "TieredKVCache layout a dict", "TieredKVCache unknown keyword", "Engine model a string", "Engine config a dict",
    "DeviceTier on cuda without a GPU", "RedisTier password, nothing answers", "RedisTier url of another scheme",
    "offload of a string",
]
PYTHON_MODEL = [
    "offload exact_prefill string", "offload nested", "cache_for topk pages zero", "generate num_beams 0",
    "generate use_cache False", "Engine layout not the model's", "kv_layout_for of a model",
]
CASES = {case.name: case for case in sweep.cases()}


def test_the_sweep_holds_every_door_and_enough_inputs():
    doors = {case.door for case in CASES.values()}
    assert doors == {"cli", "file", "python"} and len(CASES) >= 122
    groups = {a.lstrip("+-").split("=")[0].split(".")[0].split("/")[0] for c in CASES.values() if c.cli for a in c.cli}
    assert {"model", "task", "budget", "cache", "scope", "policy", "tiers", "scheduler", "engine", "hydra",
            "logger"} <= groups


@pytest.mark.parametrize("name", CLI + FILES)
def test_kvtier_run_input_is_named_before_the_model_loads(name, tmp_path):
    case = CASES[name]
    if case.setup:
        case.setup(tmp_path)
    result = sweep.run_cli(sweep.argv_of(case, tmp_path), tmp_path)
    outcome, message = sweep.classify_cli(case, result)
    assert (outcome, result["loaded"]) == ("named", False), message
    assert "hunter2" not in result["text"]


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    return sweep.Ctx(tmp_path_factory.mktemp("front"))


@pytest.mark.parametrize("name", PYTHON_BARE)
def test_python_door_input_is_named(name, ctx):
    outcome, message = sweep.run_python(CASES[name], ctx)
    assert outcome == "named", message


@pytest.mark.parametrize("name", PYTHON_MODEL)
def test_python_door_input_is_named_with_the_model(name, ctx, smollm2):
    ctx._model = smollm2
    outcome, message = sweep.run_python(CASES[name], ctx)
    assert outcome == "named", message


def test_a_refusal_that_names_another_key_is_no_pass():
    """The classer fails a message naming another key, a late check and a silent run (the sweep can fail)."""
    case = sweep.Case("x", "cli", "cache.window", cli=["cache.window=-1"])
    line = "kvtier-run: error: budget: 96 tokens cannot hold sinks (4) + window (4096)"
    assert sweep.classify_cli(case, {"code": 2, "text": line, "loaded": False, "metrics": []})[0] == "wrong_key"
    named = "kvtier-run: error: cache.window: must be >= 0"
    assert sweep.classify_cli(case, {"code": 2, "text": named, "loaded": True, "metrics": []})[0] == "late"
    assert sweep.classify_cli(case, {"code": 0, "text": "", "loaded": True, "metrics": [{}]})[0] == "silent"
    assert sweep.classify_cli(case, {"code": 1, "text": "Traceback (most recent call last):\n  boom",
                                     "loaded": False, "metrics": []})[0] == "traceback"
