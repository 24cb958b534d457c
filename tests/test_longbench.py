"""LongBench v1/v2 and InfiniteBench: their metrics as the official scripts compute them, prompts from the shipped
fixtures (tests/data/*_fixture.jsonl), a missing dataset named with its hf download line, and both tasks end to
end through the engine on SmolLM2."""

import json
from pathlib import Path

import pytest

from kvtier.errors import ConfigError, MissingDependencyError
from kvtier.eval import InfiniteBench, LongBench
from kvtier.eval.infinitebench import correct
from kvtier.eval.longbench import classification, code_sim, count, extract_choice, qa_f1, retrieval, rouge_l, \
    truncate_middle

DATA = Path(__file__).parent / "data"
V1, V2, IB = DATA / "longbench_fixture.jsonl", DATA / "longbench_v2_fixture.jsonl", DATA / "infinitebench_fixture.jsonl"


def test_longbench_metrics():
    assert qa_f1("The river Wend.", "the river Wend") == 1.0
    assert qa_f1("river", "the river Wend") == pytest.approx(2 * 1 * 0.5 / 1.5)
    assert rouge_l("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1.0)
    assert 0 < rouge_l("the cat sat", "the cat sat on the mat") < 1 and rouge_l("", "x") == 0.0
    assert classification("City", "City", all_classes=["City", "Country"]) == 1.0
    assert classification("City or Country", "City", all_classes=["City", "Country"]) == 0.5
    assert retrieval("Paragraph 2, not 3", "Paragraph 2") == 0.5 and count("2", 2) == 1.0
    assert code_sim("# comment\n    return 2 * (width + height)", "    return 2 * (width + height)") == 1.0
    assert extract_choice("**The correct answer is (C)**") == "C" and extract_choice("C") is None
    assert truncate_middle(list(range(10)), 4) == [0, 1, 8, 9] and truncate_middle([1, 2], 4) == [1, 2]


def test_infinitebench_scoring():
    assert correct("passkey", " 71432.", ["71432"]) == 1.0 and correct("passkey", "1 71432", ["71432"]) == 0.0
    assert correct("kv_retrieval", ' "09dd".', ["09dd"]) == 1.0
    assert correct("longbook_choice_eng", " B. Driftwood", ["Driftwood", "B"]) == 1.0
    assert correct("longbook_choice_eng", " A", ["Driftwood", "B"]) == 0.0
    assert correct("math_find", " 9", [9]) == 1.0


def test_longbench_prompts_are_the_official_ones_cut_in_the_middle(smollm2_engines):
    _, tok = smollm2_engines
    task = LongBench(length=48, datasets=["hotpotqa", "lcc"], path=str(V1))
    samples = list(task.samples(tok))
    assert [s.group for s in samples] == ["hotpotqa", "lcc"] and all(s.ids.numel() <= 48 for s in samples)
    text = tok.decode(samples[0].ids)
    assert text.startswith("Answer the question based on the given passages.") and text.endswith("Answer:")
    full = LongBench(length=4096, datasets=["hotpotqa"], path=str(V1))
    assert "river Wend, north" in tok.decode(next(iter(full.samples(tok))).ids)  # nothing cut below the length
    assert samples[0].max_new_tokens == 32 and samples[1].max_new_tokens == 64  # dataset2maxlen


def test_longbench_and_infinitebench_end_to_end_on_smollm2(smollm2_engines):
    make, tok = smollm2_engines
    v1 = LongBench(length=256, datasets=["passage_count", "trec", "samsum"], path=str(V1)).run(make, tok)
    assert v1["samples"] == 3 and set(v1["per_group"]) == {"passage_count", "trec", "samsum"}
    assert all(0 <= v <= 100 for v in v1["per_group"].values())
    samsum = next(r for r in v1["records"] if r["group"] == "samsum")
    assert "\n" not in samsum["output"]  # samsum stops at a newline, as LongBench's pred.py
    v2 = LongBench(length=256, version="v2", path=str(V2)).run(make, tok)
    assert v2["samples"] == 1 and v2["score"] in (0.0, 100.0)
    ib = InfiniteBench(length=256, tasks=["passkey", "kv_retrieval"], path=str(IB)).run(make, tok)
    assert set(ib["per_group"]) == {"passkey", "kv_retrieval"}
    passkey = next(r for r in ib["records"] if r["group"] == "passkey")
    assert ib["per_group"]["passkey"] == (100.0 if passkey["output"].strip().startswith("71432") else 0.0)


def test_a_missing_dataset_names_the_download(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match=r"hf download --repo-type dataset THUDM/LongBench`"):
        LongBench(datasets=["hotpotqa"])
    with pytest.raises(ConfigError, match=r"hf download --repo-type dataset THUDM/LongBench-v2`"):
        LongBench(version="v2")
    with pytest.raises(ConfigError, match=r"hf download --repo-type dataset xinrongzhang2022/InfiniteBench`"):
        InfiniteBench(tasks=["passkey"])


def test_longbench_from_a_cached_snapshot(monkeypatch, tmp_path):
    """The HF cache's layout (datasets--THUDM--LongBench/snapshots/<rev>/data.zip, refs/main) read offline."""
    import zipfile

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "datasets--THUDM--LongBench"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    rows = [json.loads(line) for line in V1.read_text().splitlines() if '"trec"' in line]
    with zipfile.ZipFile(snapshot / "data.zip", "w") as z:
        z.writestr("data/trec.jsonl", "\n".join(json.dumps(r) for r in rows))
    task = LongBench(datasets=["trec"])
    assert task.rows()["trec"][0]["answers"] == ["City"]


def test_bad_settings_and_chinese_without_jieba(monkeypatch):
    with pytest.raises(ConfigError) as err:
        LongBench(datasets=["nope"], path=str(V1))
    assert err.value.field == "task.datasets"
    with pytest.raises(ConfigError, match="has no rows") as err:
        LongBench(datasets=["qasper"], path=str(V1))
    with pytest.raises(ConfigError) as err:
        InfiniteBench(tasks=["code_run"], path=str(IB))
    assert err.value.field == "task.tasks"
    import builtins

    real_import = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name))
                        if name == "jieba" else real_import(name, *a, **k))
    from kvtier.eval.longbench import qa_f1_zh

    with pytest.raises(MissingDependencyError, match=r"kvtier\[bench\]"):
        qa_f1_zh("答案", "答案")
