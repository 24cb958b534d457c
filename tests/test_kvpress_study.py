"""kvpress's presses beside kvtier's (kvtier/eval/kvpress.py): a press through the policy study on the real
SmolLM2 keeps kvtier's budget and answers as kvpress's own pipeline; without kvpress a kvpress config fails
at once, naming the extra; ``kvtier-run -m method=kvpress:<press>`` fills the leaderboard beside kvtier's policies.
All but the third run where kvpress is (``make compare-env``, ``make test-compare``)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench import policy_study
from kvtier.eval.kvpress import make_press, run_press
from kvtier.errors import ConfigError, MissingDependencyError
from kvtier import plot
from kvtier.eval import Passkey

NO_KVPRESS = "kvpress runs from its own environment, the [compare] extra: make compare-env && make test-compare"


def test_a_press_through_the_harness_keeps_kvtiers_budget():
    pytest.importorskip("kvpress", reason=NO_KVPRESS)
    args = policy_study.parse_args(["--protocol", "ctx2k", "--context", "128", "--continuation", "2", "--slices", "1",
                                     "--text", "lady_susan"])
    exact = policy_study.run_one(args, "ctx2k", "exact", 0.25)
    knorm = policy_study.run_one(args, "ctx2k", "kvpress:knorm", 0.25)
    assert knorm["kept_tokens"] == knorm["budget_tokens"] == exact["budget_tokens"] == 32
    assert math.isfinite(knorm["perplexity"]) and abs(knorm["perplexity"] / exact["perplexity"] - 1) > 1e-3
    assert knorm["attended_tokens"] == 33  # the one token fed after the prefill: the 32 kept and itself
    whole = policy_study.run_one(args, "ctx2k", "kvpress:knorm", 1.0)  # nothing dropped: the exact run
    assert whole["kept_tokens"] == 128 and whole["perplexity"] == pytest.approx(exact["perplexity"], rel=1e-4)


def test_the_question_after_a_compressed_context_answers_as_kvpress_pipeline():
    kvpress = pytest.importorskip("kvpress", reason=NO_KVPRESS)
    model, tok = policy_study.model_for("eager", "cpu")
    task = Passkey(context_tokens=160, depths=(0.5,), question_at="after", max_new_tokens=6)
    result = run_press(task, "snapkv", 80, model, tok, sinks=4, window=64)
    (_, ids, _, _), = task.cases(tok, np.random.default_rng(task.seed))
    n = ids.numel() - task.question_tokens
    pipeline = kvpress.KVPressTextGenerationPipeline(model=model, tokenizer=tok)
    answers = pipeline._forward({"context_ids": ids[None, :n], "questions_ids": [ids[None, n:]]},
                                press=make_press("snapkv", n, 80, 4, 64), max_new_tokens=6)
    assert result["kept_tokens"] == 80 and result["records"][0]["output"] == answers[0]


def test_a_kvpress_config_without_kvpress_fails_naming_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "kvpress", None)  # import kvpress raises ImportError
    out = tmp_path / "rows.json"
    with pytest.raises(MissingDependencyError) as err:
        policy_study.main(["--protocol", "ctx2k", "--configs", "exact,kvpress:snapkv", "--out", str(out)])
    assert "kvtier[compare]" in str(err.value) and "make compare-env" in str(err.value)
    assert not out.exists()  # refused before the exact run, not skipped after it
    with pytest.raises(ConfigError, match="unknown press 'kvpress:h2o'"):
        policy_study.main(["--protocol", "ctx2k", "--configs", "kvpress:h2o"])
    with pytest.raises(ConfigError, match="compresses the prefill once"):  # no budget over a stream's steps
        policy_study.main(["--protocol", "stream", "--configs", "kvpress:knorm"])


def test_a_kvtier_run_sweep_puts_presses_and_policies_in_one_leaderboard(tmp_path):
    """``kvtier-run -m method=kvpress:<press>`` beside a kvtier sweep into one folder, at a tiny RULER length: each
    press run keeps the budget's KV pairs, its metrics name the model, the task and the method, and kvtier-plot's
    leaderboard has a row for each method."""
    pytest.importorskip("kvpress", reason=NO_KVPRESS)
    common = ["task=ruler", "task.length=512", "task.subtasks=[niah_single_1]", "task.max_new_tokens=4",
              "budget.fraction=0.25", "cache.window=16", "progress=false", "logger=none", "hydra.sweep.dir=sweep"]
    for sweep in (["method=kvpress:snapkv,kvpress:knorm"], ["scope=resident", "policy=snapkv",
                                                            "cache.attend_budget=true"]):
        subprocess.run([sys.executable, "-m", "kvtier.run", "-m", *common, *sweep], cwd=tmp_path, check=True,
                       capture_output=True)
    runs = {m["method"]: m for m in map(json.loads, map(Path.read_text, (tmp_path / "sweep").glob("*/metrics.json")))}
    assert set(runs) == {"kvpress:snapkv", "kvpress:knorm", "resident:snapkv"}
    for name in ("kvpress:snapkv", "kvpress:knorm"):
        assert runs[name]["model"] == "smollm2" and runs[name]["task"] == "ruler"
        assert runs[name]["kept_tokens"] == runs[name]["budget_tokens"] == runs["resident:snapkv"]["budget_tokens"]
    assert plot.main([str(tmp_path / "sweep")]) == 0
    board = (tmp_path / "sweep" / "plots" / "leaderboard.md").read_text()
    assert {line.split(" | ")[0] for line in board.splitlines()[4:]} == {"| kvpress:snapkv", "| kvpress:knorm",
                                                                         "| resident:snapkv"}
