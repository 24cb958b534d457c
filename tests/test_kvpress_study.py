"""kvpress's presses in the policy study (bench/kvpress_study.py): a press through the harness on the real
SmolLM2 keeps kvtier's budget and answers as kvpress's own pipeline; without kvpress a kvpress config fails
at once, naming the extra. The first two run where kvpress is (``make compare-env``, ``make test-compare``)."""

import math
import sys

import numpy as np
import pytest

from bench import policy_study
from bench.kvpress_study import make_press, run_press
from kvtier.errors import ConfigError, MissingDependencyError
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
