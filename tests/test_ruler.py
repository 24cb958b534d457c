"""RULER (kvtier.eval.ruler): every subtask's prompts as RULER builds them at the asked length in SmolLM2's and
Gemma-3's tokens, fixed by the seed; RULER's scoring; the task end to end through the engine at a tiny length;
the recipe."""

import random

import pytest
import torch
from transformers import AutoTokenizer

from kvtier.errors import ConfigError
from kvtier.eval import Ruler, build_task
from kvtier.eval.ruler import SUBTASKS, clean, hotpotqa_questions, squad_questions, string_match_all, \
    string_match_part
from kvtier.models import ensure_model

SYNTHETIC = [s for s, (kind, _) in SUBTASKS.items() if kind != "qa"]


@pytest.fixture(scope="module", params=["smollm2", "gemma3_270m"])
def tokenizer(request):
    return AutoTokenizer.from_pretrained(ensure_model(request.param), local_files_only=True)


def test_every_subtask_fits_its_length_and_holds_its_answers(tokenizer):
    task = Ruler(length=1024, subtasks=SYNTHETIC)
    assert set(task.skipped()) == set()  # no qa asked
    samples = list(task.samples(tokenizer))
    assert [s.group for s in samples] == SYNTHETIC
    for s in samples:
        assert s.ids.numel() + s.max_new_tokens <= 1024
        assert s.ids.numel() + s.max_new_tokens > 0.85 * 1024, (s.group, s.ids.numel())  # the haystack fills it
        prompt = tokenizer.decode(s.ids, skip_special_tokens=True)
        body = prompt.rsplit("\n", 1)[0]  # the context, before the question
        kind = SUBTASKS[s.group][0]
        if kind == "niah":
            for value in s.refs:
                assert f"is: {value}." in body  # each answer's needle is in the haystack
            assert prompt.endswith("mentioned in the provided text " + ("is" if len(s.refs) == 1 else "are"))
        elif kind == "vt":
            assert len(s.refs) == 5 and all(f"VAR {v} =" in body for v in s.refs)
        elif kind == "cwe":
            counts = {w: body.split("Question:")[-1].count(f". {w} ") for w in s.refs}  # the main list
            assert len(s.refs) == 10 and min(counts.values()) >= 5  # the common words are repeated
        else:
            words = body.split("Question:")[0].split()
            top = sorted(set(words) - {"..."}, key=words.count, reverse=True)[:3]
            assert set(top) == set(s.refs)


def test_the_seed_fixes_every_sample_whatever_else_is_asked(tokenizer):
    alone = list(Ruler(length=512, subtasks=["niah_multikey_2"], seed=7).samples(tokenizer))
    among = list(Ruler(length=512, subtasks=["niah_single_1", "niah_multikey_2"], seed=7).samples(tokenizer))
    assert torch.equal(alone[0].ids, among[1].ids) and alone[0].refs == among[1].refs
    other = list(Ruler(length=512, subtasks=["niah_multikey_2"], seed=8).samples(tokenizer))
    assert other[0].refs != alone[0].refs
    two = list(Ruler(length=512, subtasks=["niah_single_1"], samples_per_task=2).samples(tokenizer))
    assert two[0].refs != two[1].refs


def test_scoring_is_rulers():
    assert clean("  7649882.\x0bmore \n") == "7649882.\nmore"
    assert string_match_all("1234 and 99", ["1234", "5678"]) == 50.0
    assert string_match_part("1234 and 99", ["1234", "5678"]) == 100.0
    assert string_match_all("ABC", ["abc"]) == 100.0 and string_match_part("x", ["abc", "d"]) == 0.0
    task = Ruler(length=512, subtasks=["niah_multivalue"])
    sample = next(iter(task.samples(AutoTokenizer.from_pretrained(ensure_model("smollm2")))))
    assert task.score(" " + ", ".join(sample.refs[:3]), sample) == 75.0  # niah: the share of values found


def test_qa_questions_as_ruler_reads_them():
    squad = [{"title": "A", "context": "p1", "question": "q1", "answers": {"text": ["x"]}},
             {"title": "A", "context": "p2", "question": "q2", "answers": {"text": []}},  # unanswerable: dropped
             {"title": "B", "context": "p3", "question": "q3", "answers": {"text": ["y", "y2"]}}]
    questions, docs = squad_questions(squad)
    assert docs == ["p1", "p2", "p3"]
    assert questions == [{"query": "q1", "outputs": ["x"], "context": [0], "more": [1]},
                         {"query": "q3", "outputs": ["y", "y2"], "context": [2], "more": []}]
    hotpot = [{"question": "q", "answer": "a", "context": {"title": ["T1", "T2"], "sentences": [["s1", " s2"], ["u"]]}}]
    questions, docs = hotpotqa_questions(hotpot)
    assert docs == ["T1\ns1 s2", "T2\nu"] and questions[0]["context"] == [0, 1]


def test_qa_without_its_dataset_is_skipped_with_the_command(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    from kvtier.eval import ruler

    ruler.qa_data.cache_clear()
    task = Ruler(length=512, subtasks=["qa_1", "niah_single_1"])
    assert set(task.skipped()) == {"qa_1"}
    assert "hf download --repo-type dataset rajpurkar/squad_v2" in task.skipped()["qa_1"]
    assert [s.group for s in task.samples(AutoTokenizer.from_pretrained(ensure_model("smollm2")))] == ["niah_single_1"]


@pytest.mark.parametrize("kwargs, field", [({"subtasks": ["niah_single_9"]}, "task.subtasks"),
                                           ({"length": 100}, "task.length"), ({"haystack": "nope"}, "task.text"),
                                           ({"samples_per_task": 0}, "task.samples_per_task")])
def test_bad_settings_name_their_key(kwargs, field):
    with pytest.raises(ConfigError) as err:
        Ruler(**kwargs)
    assert err.value.field == field


def test_a_length_too_short_for_the_prompt_is_named():
    with pytest.raises(ConfigError, match="do not hold") as err:
        list(Ruler(length=600, subtasks=["vt"]).samples(AutoTokenizer.from_pretrained(ensure_model("smollm2"))))
    assert err.value.field == "task.length"


def test_ruler_end_to_end_on_smollm2(smollm2_engines):
    """A needle at 512 tokens through a fresh engine per sample (pages on the host too), scored per subtask."""
    make, tok = smollm2_engines
    task = build_task("ruler", {"length": 512, "subtasks": ["niah_single_1", "niah_multikey_2"],
                                "max_new_tokens": 12})
    result = task.run(make, tok)
    assert result["task"] == "ruler" and result["samples"] == 2
    assert set(result["per_group"]) == {"niah_single_1", "niah_multikey_2"}
    assert result["per_group"]["niah_single_1"] == 100.0  # SmolLM2 finds one needle in noise at 512 (measured)
    assert result["score"] == sum(result["per_group"].values()) / 2
    assert 0 < result["tier1_hit_rate"] < 1  # pages were read from the host
    for r in result["records"]:
        assert r["score"] == (100.0 if r["refs"][0] in r["output"] else 0.0)


def test_random_is_not_shared_between_samples():
    state = random.getstate()
    list(Ruler(length=512, subtasks=["niah_single_3"]).samples(AutoTokenizer.from_pretrained(ensure_model("smollm2"))))
    assert random.getstate() == state  # the global generator is left alone
