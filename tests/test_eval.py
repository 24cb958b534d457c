"""Evaluation tasks on the real SmolLM2-135M-Instruct (CPU): scores, exactness of scope 'all', config errors."""

import math

import numpy as np
import pytest
import torch
from rich.progress import Progress

from kvtier.data import token_stream
from kvtier.engine import Engine
from kvtier.errors import ConfigError
from kvtier.eval import TASKS, Needle, Passkey, Perplexity, Ruler, build_task
from kvtier.hook import install
from kvtier.models import kv_layout_for, load_model
from kvtier.policies import LRU, SinkWindow
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.tiers import DeviceTier, HostTier

PPL_LENGTH, PPL_PREFIX = 96, 16


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: token-by-token decoding is overhead-bound, and on a busy 2-core machine two
    OpenMP threads contend (a decode step measured 0.5-1.5 s with two threads, 60 ms with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smol():
    """``(model, tokenizer, hf_nll)``: the model switched to kvtier attention, and the NLL of a plain HF
    (sdpa) forward over the perplexity test's tokens, computed before the switch."""
    torch.manual_seed(0)
    model, tok = load_model(None, dtype="float32")
    ids = token_stream(tok, "opticks", PPL_LENGTH)
    with torch.no_grad():
        logits = model(ids[None]).logits[0].double()  # [S, V]
    logp = torch.log_softmax(logits[PPL_PREFIX - 1 : -1], dim=-1)
    hf_nll = -logp.gather(1, ids[PPL_PREFIX:, None]).squeeze(1)  # [S - prefix]
    install()
    model.set_attn_implementation("kvtier")
    return model, tok, hf_nll


def engine_factory(model, budget_tokens, policy, scope, chunk=256):
    layout = kv_layout_for(model.config, page_size=16, dtype=torch.float32)
    return lambda: Engine(model, layout, [DeviceTier(layout, budget_tokens // 16, device="cpu"),
                                          HostTier(layout, 256)], policy(), scope, prefill=ChunkedPrefill(chunk))


def test_registry():
    assert set(TASKS) == {"perplexity", "passkey", "needle", "ruler", "longbench", "infinitebench"}
    assert (TASKS["passkey"], TASKS["ruler"]) == (Passkey, Ruler)
    assert build_task("passkey", {"context_tokens": 512}).context_tokens == 512


def test_perplexity_all_matches_hf_and_resident_is_bounded(smol):
    model, tok, hf_nll = smol
    task = Perplexity(length=PPL_LENGTH, prefix=PPL_PREFIX, block_tokens=32)
    with Progress(disable=True) as progress:
        # 'all' with a 64-token device budget: most pages are fetched from the host, still exact
        exact = task.run(engine_factory(model, 64, LRU, "all", 8), tok, progress=progress)
        (bar,) = progress.tasks
        assert bar.completed == bar.total == PPL_LENGTH - PPL_PREFIX
    ref = math.exp(float(hf_nll.mean()))
    assert exact["task"] == "perplexity" and exact["samples"] == 1 and exact["context_tokens"] == PPL_LENGTH
    assert exact["scored_tokens"] == PPL_LENGTH - PPL_PREFIX
    assert abs(exact["perplexity"] - ref) / ref < 1e-3, (exact["perplexity"], ref)
    assert exact["nll_mean"] == pytest.approx(float(hf_nll.mean()), rel=1e-3)
    assert len(exact["nll_blocks"]) == 3 and exact["tier1_hit_rate"] < 1.0

    streaming = task.run(engine_factory(model, 64, lambda: SinkWindow(sinks=4, window=16), "resident", 8), tok)
    assert math.isfinite(streaming["perplexity"]) and streaming["tier1_hit_rate"] == 1.0
    assert streaming["perplexity"] != pytest.approx(exact["perplexity"], rel=1e-3)  # it did drop context
    assert streaming["perplexity"] < 3 * exact["perplexity"]  # ... but sinks keep it bounded


def test_passkey_all_at_512(smol):
    model, tok, _ = smol
    task = Passkey(context_tokens=512, depths=[0.2, 0.8], seed=3)
    res = task.run(engine_factory(model, 1024, LRU, "all"), tok)
    assert res["task"] == "passkey" and res["samples"] == 2
    assert 480 <= res["context_tokens"] <= 512
    assert res["accuracy"] == 1.0, res["records"]
    assert res["per_depth"] == {"0.2": 1.0, "0.8": 1.0}
    for r in res["records"]:
        assert r["output"].split()[0].startswith(r["expected"])


def test_passkey_fails_when_the_key_is_evicted(smol):
    """Negative control: a 96-token window-only device budget (resident scope) loses the key."""
    model, tok, _ = smol
    task = Passkey(context_tokens=512, depths=[0.3], seed=3)
    res = task.run(engine_factory(model, 96, lambda: SinkWindow(sinks=0, window=48), "resident", 32), tok)
    assert res["accuracy"] == 0.0, res["records"]


def test_prompts_fit_and_hold_the_needle(smol):
    _, tok, _ = smol
    rng = np.random.default_rng(0)
    for task in (Passkey(context_tokens=700, depths=[0.0, 0.5, 1.0], samples=2),
                 Needle(context_tokens=700, depths=[0.0, 0.5, 1.0], samples=2)):
        positions = []
        for depth, ids, expected, _ in task.cases(tok, rng):
            text = tok.decode(ids)
            assert 600 <= ids.numel() <= 700
            needle = f"The pass key is {expected}." if isinstance(task, Passkey) else task.needle
            assert text.count(needle) == 1 and text.rstrip().endswith(task.answer_prefix)
            positions.append(text.index(needle) / len(text))
        assert positions[0] < 0.2 and 0.35 < positions[2] < 0.65 and positions[4] > 0.8, positions
    (_, ids, _, _), = Passkey(context_tokens=300, depths=[0.5], chat_template=True).cases(tok, rng)
    assert tok.decode(ids).endswith("<|im_start|>assistant\nThe pass key is") and ids.numel() <= 300


@pytest.mark.parametrize("cls, kwargs, field", [
    (Perplexity, {"length": 1}, "task.length"),
    (Perplexity, {"prefix": 0}, "task.prefix"),
    (Perplexity, {"length": 64, "prefix": 64}, "task.length"),  # no token left to score: the length is short
    (Perplexity, {"text": "hamlet"}, "task.text"),
    (Passkey, {"depths": [0.5, 1.5]}, "task.depths"),
    (Passkey, {"depths": []}, "task.depths"),
    (Passkey, {"samples": 0}, "task.samples"),
    (Passkey, {"context_tokens": 16}, "task.context_tokens"),
    (Passkey, {"max_new_tokens": 0}, "task.max_new_tokens"),
    (Needle, {"answer": "saffron"}, "task.answer"),
    (Needle, {"text": "hamlet"}, "task.text"),
])
def test_config_errors_name_their_field(cls, kwargs, field):
    with pytest.raises(ConfigError) as err:
        cls(**kwargs)
    assert err.value.field == field and str(err.value).startswith(field)


def test_build_task_errors():
    with pytest.raises(ConfigError) as err:
        build_task("mmlu")
    assert err.value.field == "task"
    with pytest.raises(ConfigError) as err:
        build_task("passkey", {"depth": 0.5})
    assert err.value.field == "task.depth"


def test_context_beyond_the_model_is_refused(smol):
    model, tok, _ = smol
    with pytest.raises(ConfigError) as err:
        Passkey(context_tokens=9000).run(engine_factory(model, 64, LRU, "all"), tok)
    assert err.value.field == "task.context_tokens"


def test_passkey_question_after_the_context(smol):
    """question_at='after': the context is prefilled, the question fed one decode step per token
    (under the budget when there is one); exact attention still finds the key."""
    model, tok, _ = smol
    task = Passkey(context_tokens=384, depths=[0.5], seed=3, question_at="after", max_new_tokens=6)
    made = []
    make = engine_factory(model, 1024, LRU, "all")
    res = task.run(lambda: made.append(make()) or made[-1], tok)
    assert res["accuracy"] == 1.0, res["records"]
    assert task.question_tokens > 5 and len(made[0].tpot_s) == task.question_tokens + 6 - 1
    with pytest.raises(ConfigError) as e:
        Passkey(question_at="before")
    assert e.value.field == "task.question_at"
