"""bench/baselines.py on the CPU: the physical-limit arithmetic and the HF decode attending the whole context."""

import pytest
import torch

from bench.baselines import WARMUP_STEPS, fill_cache, hf_decode_tpot, physical_limit_ms, weight_read_bytes
from kvtier.models import tiny_llama


def test_physical_limit_by_hand():
    model = tiny_llama()  # fp32, hidden 64, 2 layers, 4/2 heads, D=16, MLP 128, vocab 256, untied
    # per layer: q,o 64·64 each, k,v 64·32 each, MLP 3·64·128, 2 norms of 64 = 36,992 params
    # all: 2·36,992 + embedding 256·64 + lm_head 256·64 + final norm 64 = 106,816 params
    assert sum(p.numel() for p in model.parameters()) == 106_816
    # read: all but the embedding, plus its B=2 gathered rows: (106,816 - 16,384 + 2·64)·4 B
    assert weight_read_bytes(model, batch=2) == 362_240
    # KV: 2 (K,V) · 2 layers · 2 heads · 16 · 2 B · 64 tokens · 2 sequences = 32,768 B; at 1 GB/s, 1 B = 1e-6 ms
    assert physical_limit_ms(model, batch=2, context=64, hbm_read_GBps=1.0) == pytest.approx(0.395008)
    assert physical_limit_ms(model.config, 2, 64, 2.0, weight_bytes=1000) == pytest.approx(33_768 / 2e6)
    with pytest.raises(ValueError):
        physical_limit_ms(model.config, 2, 64, 1.0)


def test_tied_embedding_counted_once():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8, hidden_size=16,
                         intermediate_size=32, vocab_size=100, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert weight_read_bytes(model, batch=4) == sum(p.numel() for p in model.parameters()) * 4


def one_step_logits(model, cache, batch, context, perturb=False):
    """Logits of one decode step after ``context`` random tokens (seed 0); ``perturb`` changes token 0's keys."""
    with torch.no_grad():
        fill_cache(cache, model, batch, context)
        if perturb:
            for layer in cache.layers:
                layer.keys[:, :, 0] += 1
        token = torch.full((batch, 1), 7)
        return model(input_ids=token, past_key_values=cache, use_cache=True).logits  # [B, 1, V]


def test_hf_decode_attends_the_whole_context():
    from transformers import DynamicCache, StaticCache

    model, batch, context, steps = tiny_llama(), 2, 64, 3
    row = hf_decode_tpot(model, batch, context, steps, "eager", return_cache=True)
    assert row["cache"].get_seq_length() == context + WARMUP_STEPS + steps
    assert row["tpot_p50_ms"] > 0 and row["tok_s"] == pytest.approx(batch / row["tpot_p50_ms"] * 1e3)
    dynamic = one_step_logits(model, DynamicCache(config=model.config), batch, context)
    static_cache = StaticCache(config=model.config, max_cache_len=context + 8)
    static = one_step_logits(model, static_cache, batch, context)
    assert int(static_cache.get_seq_length()) == context + 1
    torch.testing.assert_close(static, dynamic)  # same K/V, same positions, padding slots masked
    perturbed = one_step_logits(model, DynamicCache(config=model.config), batch, context, perturb=True)
    assert not torch.allclose(perturbed, dynamic)  # the first context token is attended


def test_e2e_prompts_are_places_in_opticks(smollm2):
    """bench/e2e.py's prompts: disjoint windows while the text holds them, evenly spread overlapping ones past
    that (the capacity rows' 5x batch), and a context longer than the text refused by name."""
    from bench.e2e import text_windows
    from kvtier.data import token_stream

    _, tok = smollm2
    ids = token_stream(tok, "opticks")
    disjoint = text_windows(tok, 4, 1000)
    assert all(torch.equal(w, ids[i * 1000:(i + 1) * 1000]) for i, w in enumerate(disjoint))
    half = len(ids) // 2
    spread = text_windows(tok, 5, half)  # 2.5x the text
    stride = (len(ids) - half) // 4
    assert all(torch.equal(w, ids[i * stride:i * stride + half]) for i, w in enumerate(spread))
    assert len(ids) - 4 <= 4 * stride + half <= len(ids)  # the last one ends at the text's end
    assert len({tuple(w[:8].tolist()) for w in spread}) == 5  # five different places
    with pytest.raises(ValueError, match="Opticks has"):
        text_windows(tok, 1, len(ids) + 1)
