"""Sliding-window layers and the named refusal of attention kvtier cannot honour.

Tiny random-weight models built from HF config classes (no download): Llama (no window), Mistral
(every layer sliding) and Gemma 3 text (sliding and global layers mixed, MQA, head_dim 256). The
exact scope, with pages migrating between a small device tier and the host, must match HF's own
attention over prompts several windows long, in prefill chunks and decode, with pages on the host.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from transformers import (Gemma2Config, Gemma3ForCausalLM, Gemma3TextConfig, GptOssConfig, LlamaConfig,
                          LlamaForCausalLM, MistralConfig, MistralForCausalLM)

import kvtier.hook
from kvtier import KVLayout
from kvtier.budget import TokenBudget
from kvtier.cache import ACTIVE_CACHE, TieredKVCache
from kvtier.engine import Engine, EngineConfig
from kvtier.errors import ConfigError, UnsupportedAttentionError
from kvtier.hook import install, kvtier_attention
from kvtier.kernels.registry import make_backend
from kvtier.layout import decode_arithmetic_intensity, kv_footprint_bytes
from kvtier.models import kv_layout_for, load_model
from kvtier.policies import LRU, SinkWindow
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.scheduler.lookahead import LookaheadScheduler
from kvtier.scopes import All, Resident, TopK
from kvtier.scopes.base import KeyList
from kvtier.support import check_model_support, sliding_windows
from kvtier.table import DROPPED, BlockTable
from kvtier.tiers import DeviceTier, HostTier
from kvtier.window import attended_range, out_of_window

WINDOW, PAGE, PROMPT, DECODE = 24, 8, 90, 8
SMALL = dict(hidden_size=64, intermediate_size=96, vocab_size=256)


def build(family: str):
    """A random-weight fp32 model of ``family`` in eval mode (fixed seed)."""
    if family in ("llama", "llama_sw"):  # llama_sw: a sliding_window key that HF's Llama attention ignores
        extra = {"sliding_window": WINDOW, "layer_types": ["sliding_attention"] * 2} if family == "llama_sw" else {}
        cls, config = LlamaForCausalLM, LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                    **SMALL, **extra)
        assert family == "llama" or config.sliding_window == WINDOW  # carried, yet not applied
    elif family == "mistral":  # every layer sliding
        cls, config = MistralForCausalLM, MistralConfig(num_hidden_layers=2, num_attention_heads=4,
                                                        num_key_value_heads=2, sliding_window=WINDOW, **SMALL)
    else:  # gemma3: sliding and global layers, MQA, head_dim 256
        cls, config = Gemma3ForCausalLM, Gemma3TextConfig(
            num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=256, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"], **SMALL)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return cls._from_config(config, dtype=torch.float32).eval()


def hf_logits(model, ids, decode: int):
    """HF sdpa logits of every prompt position and of ``decode`` greedy steps: ``(tokens, [S + decode, V])``.

    The cache is a plain DynamicCache: the one HF builds from the config would keep only the last
    ``sliding_window`` tokens of a Llama whose config carries that key, which its attention ignores."""
    from transformers import DynamicCache

    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        out = model(ids, past_key_values=DynamicCache(), use_cache=True)
        logits, tokens = [out.logits[0]], []
        for _ in range(decode):
            tokens.append(logits[-1][-1].argmax().view(1, 1))
            out = model(tokens[-1], past_key_values=out.past_key_values, use_cache=True)
            logits.append(out.logits[0])
    return tokens, torch.cat(logits)


def kvtier_logits(model, ids, tokens, layout, scope="all", kernel=None, device_pages=3, policy=None):
    """The same logits through kvtier (chunked prefill of 16, then the given tokens); ``(logits, cache)``."""
    model.set_attn_implementation(install())
    cache = TieredKVCache(layout, [DeviceTier(layout, device_pages, device="cpu"), HostTier(layout, 64)],
                          policy or LRU(), scope=scope, kernel=kernel,
                          **(dict(topk_pages=3, sinks=PAGE) if scope == "topk" else {}))
    try:
        got = [cache.prefill(model, ids, 16)[0]] + [cache.forward(model, t)[0] for t in tokens]
        cache.finish_step()
    finally:
        model.set_attn_implementation("sdpa")
    return torch.cat(got), cache


def rel_err(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module", params=["llama", "llama_sw", "mistral", "gemma3"])
def family(request):
    model = build(request.param)
    ids = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    tokens, ref = hf_logits(model, ids, DECODE)
    return request.param, model, ids, tokens, ref


def test_exact_scope_matches_hf_with_pages_migrating(family):
    name, model, ids, tokens, ref = family
    layout = kv_layout_for(model.config, page_size=PAGE, dtype=torch.float32)
    assert layout.sliding_windows == {"llama": (), "llama_sw": (), "mistral": (WINDOW,) * 2,
                                      "gemma3": (WINDOW, 0, WINDOW)}[name]
    got, cache = kvtier_logits(model, ids, tokens, layout)
    assert not torch.isnan(got).any()
    assert (got - ref).abs().max() / ref.abs().max() < 1e-4  # every prompt position and every decode step
    assert sum(cache.transfer.pages_moved.values()) > 0 and cache.hit_rate() < 1  # pages moved and were read off the device
    sliding = [layer for layer in range(layout.num_layers) if layout.window(layer)]
    held = cache.table.occupancy()
    for layer in range(layout.num_layers):
        pages = sum(per_layer[layer] for per_layer in held.values())
        if layer in sliding:  # only the next query's window is kept
            assert pages <= -(-WINDOW // PAGE) + 1
        else:
            assert pages == layout.pages_for(PROMPT + DECODE)
    n_dropped = sum(int((cache.table.tier_of[layer] == DROPPED).sum()) for layer in sliding)
    assert cache.stats.dropped_pages == n_dropped and (n_dropped > 0) == bool(sliding)
    assert cache.stats.dropped_bytes == n_dropped * layout.page_bytes


def test_a_window_the_architecture_does_not_apply_is_refused_by_the_hook():
    """A layout windowed where the model's attention applies no window (Llama passes no sliding_window)."""
    model = build("llama_sw")
    ids = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(2))
    windowed = KVLayout(2, 2, 16, PAGE, torch.float32, sliding_windows=(WINDOW, WINDOW))
    with pytest.raises(UnsupportedAttentionError, match="sliding_window=None on layer 0"):
        kvtier_logits(model, ids, [], windowed)


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_ignoring_the_window_is_caught(name, monkeypatch):
    """Without the layout's windows the hook refuses the call; with that check bypassed the result is wrong."""
    model = build(name)
    ids = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(2))
    tokens, ref = hf_logits(model, ids, 2)
    base = kv_layout_for(model.config, page_size=PAGE, dtype=torch.float32)
    blind = KVLayout(base.num_layers, base.num_kv_heads, base.head_dim, PAGE, torch.float32)  # no windows
    with pytest.raises(UnsupportedAttentionError, match="sliding_window=24 on layer 0") as err:
        kvtier_logits(model, ids, tokens, blind)
    assert err.value.field == "model"
    monkeypatch.setattr(kvtier.hook, "check_attention_call", lambda *args: None)
    got, _ = kvtier_logits(model, ids, tokens, blind)
    assert rel_err(got[WINDOW:], ref[WINDOW:]) > 1e-2  # positions past the window differ
    assert rel_err(got[:WINDOW], ref[:WINDOW]) < 1e-5  # and only those


def test_generate_through_the_hook_matches_hf_greedy():
    model = build("gemma3")
    prompt = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(5))
    ref = model.generate(prompt, max_new_tokens=30, do_sample=False)
    layout = kv_layout_for(model.config, page_size=PAGE, dtype=torch.float32)
    cache = TieredKVCache(layout, [DeviceTier(layout, 4, device="cpu"), HostTier(layout, 32)], LRU())
    model.set_attn_implementation(install())
    try:
        got = model.generate(prompt, past_key_values=cache, max_new_tokens=30, do_sample=False)
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(got, ref) and cache.stats.dropped_pages > 0
    assert [layer.is_sliding for layer in cache.layers] == [True, False, True]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="a CPU model through the interpreter; on a GPU, python -m bench.gpu_checks --windows")
def test_triton_kernels_with_windows_match_hf():
    model = build("gemma3")
    ids = torch.randint(0, 256, (1, 56), generator=torch.Generator().manual_seed(3))
    tokens, ref = hf_logits(model, ids, 3)
    layout = kv_layout_for(model.config, page_size=PAGE, dtype=torch.float32)
    got, cache = kvtier_logits(model, ids, tokens, layout, kernel=make_backend("triton"))
    assert (got - ref).abs().max() / ref.abs().max() < 1e-4 and cache.stats.dropped_pages > 0


@pytest.mark.parametrize("scope", ["resident", "topk"])
def test_approximate_scopes_never_attend_outside_the_window(scope, monkeypatch):
    from kvtier.scopes.base import window_pages

    model = build("mistral")
    ids = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(4))
    tokens, ref = hf_logits(model, ids, DECODE)
    layout = kv_layout_for(model.config, page_size=PAGE, dtype=torch.float32)
    seen = []
    cls = {"resident": Resident, "topk": TopK}[scope]
    method = "plan" if cls.query_free else "pick"  # resident plans a group of layers, topk picks one
    chosen_by = getattr(cls, method)

    def recorded(self, layers, *args):  # each decode call's pages, beside the first page its window shows
        picks = chosen_by(self, layers, *args)
        view = args[-1]
        _, lens, _ = view.rows(layers)
        first, _ = window_pages(lens, view.window(layers), view.page_size)
        for lists in (picks if method == "plan" else [picks]):
            listed = (lists.keys // view.page_size if isinstance(lists, KeyList) else lists)[0].reshape(-1)
            seen.append((int(first[0]), listed[listed >= 0]))
        return picks

    monkeypatch.setattr(cls, method, recorded)
    got, cache = kvtier_logits(model, ids, tokens, layout, scope=scope, device_pages=4)
    assert len(seen) == 2 * DECODE
    assert all(chosen.min() >= first for first, chosen in seen)
    assert sum(first > 0 for first, _ in seen) > len(seen) // 2
    # a window cut inside a page is attended whole: these scopes are exact on sliding layers then
    assert not torch.isnan(got).any() and rel_err(got, ref) < 0.05


def test_attended_range_follows_hf_semantics():
    # query i sees keys i - W < j <= i
    assert attended_range(100, 1, 8, 24) == (9, 9)  # first key 77 is in page 9, which the window cuts
    assert attended_range(103, 1, 8, 24) == (10, 12)  # first key 80 starts page 10: pages 10, 11 seen whole
    assert attended_range(32, 16, 8, 24) == (1, 1)  # a prefill chunk: the window cuts page 1 for its first rows
    assert attended_range(5, 10, 8, 24) == (0, 0)  # shorter than the window but the last query is past it
    assert attended_range(5, 3, 8, 24) == (0, 0)  # the whole sequence is in every window
    assert attended_range(100, 1, 8, 0) == (0, 12)  # a global layer


def test_dropped_pages_are_shared_safely_and_never_planned():
    layout = KVLayout(2, 1, 4, page_size=4, dtype="float32", sliding_windows=(6, 0))
    table = BlockTable(layout, [DeviceTier(layout, 8, device="cpu"), HostTier(layout, 16)])
    table.add_sequence(0)
    table.append(0, 12)  # pages 0-2
    table.fork(0, 1)  # sequence 1 shares them
    table.append(0, 12)  # sequence 0 grows to 24 tokens (pages 0-5)
    pages = table.pages(0)
    # sequence 0's next query (24) sees keys 19..24 (pages 4, 5); sequence 1's (12) keys 7..12 (pages 1, 2)
    assert out_of_window(table.seqs, 4, 6).tolist() == sorted(pages[[0, 3]].tolist())
    table.free(1)
    gone = out_of_window(table.seqs, 4, 6)
    assert gone.tolist() == sorted(pages[:4].tolist())
    assert table.drop(0, gone).tolist() == gone.tolist() and table.drop(0, gone).size == 0  # idempotent
    assert (table.tier_of[0, gone] == DROPPED).all() and (table.tier_of[1, gone] >= 0).all()
    assert table.occupancy()["device"] == [2, 6]
    assert np.flatnonzero(table.tier_of[0, pages] >= 0).tolist() == [4, 5]  # the live pages of layer 0
    table.set_pinned(gone)  # even pinned and admitted, a dropped page is never moved
    plan = LookaheadScheduler().plan(table, SinkWindow(sinks=24, window=0), step=0)
    assert all(not np.isin(m.pids[m.layers == 0], gone).any() for m in plan.moves)
    table.free(0)  # releasing a sequence with dropped pages frees only what is held
    assert table.occupancy() == {"device": [0, 0], "host": [0, 0]}


def test_footprint_caps_sliding_layers_at_their_window():
    full = kv_footprint_bytes(4, 1, 256, 2, 4096, 1)
    mixed = kv_footprint_bytes(4, 1, 256, 2, 4096, 1, windows=[512, 0, 512, 0])
    assert full == 2 * 4 * 256 * 2 * 4096 and mixed == 2 * 256 * 2 * (512 + 4096 + 512 + 4096)
    short = kv_footprint_bytes(4, 1, 256, 2, 100, 1, windows=[512, 0, 512, 0])
    assert short == kv_footprint_bytes(4, 1, 256, 2, 100, 1)  # shorter than every window: no cap
    assert decode_arithmetic_intensity(1e9, 4, 1, 256, 2, 8192, 64, windows=[512] * 4) > \
        decode_arithmetic_intensity(1e9, 4, 1, 256, 2, 8192, 64)
    with pytest.raises(ConfigError, match="one entry per layer"):
        kv_footprint_bytes(4, 1, 256, 2, 100, 1, windows=[512])
    with pytest.raises(ConfigError, match="sliding_windows"):
        KVLayout(2, 1, 4, sliding_windows=(8, -1))
    assert KVLayout(2, 1, 4, sliding_windows=[0, 0]).sliding_windows == ()  # no sliding layer


def test_configs_that_kvtier_cannot_honour_are_refused(tmp_path):
    gemma2 = Gemma2Config(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                          sliding_window=WINDOW, **SMALL)
    with pytest.raises(UnsupportedAttentionError, match="soft-capping") as err:
        kv_layout_for(gemma2)
    assert err.value.feature == "logit soft-capping"
    gemma2.save_pretrained(tmp_path)  # config only: refused before any weight is read
    with pytest.raises(UnsupportedAttentionError, match="soft-capping"):
        load_model(str(tmp_path), attn_implementation="kvtier")
    with pytest.raises(UnsupportedAttentionError, match="sinks"):
        check_model_support(GptOssConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=16, **SMALL))
    gemma3 = build("gemma3").config
    gemma3.use_bidirectional_attention = True
    with pytest.raises(UnsupportedAttentionError, match="non-causal"):
        check_model_support(gemma3)
    gemma3.use_bidirectional_attention = False
    gemma3.layer_types = ["sliding_attention", "chunked_attention", "full_attention"]
    with pytest.raises(UnsupportedAttentionError, match="chunked_attention"):
        sliding_windows(gemma3)


class _Attention(torch.nn.Module):
    """Stands in for an HF attention module of layer 0."""

    layer_idx = 0
    is_causal = True


@pytest.mark.parametrize("kwargs,feature", [
    (dict(softcap=50.0), "logit soft-capping"),
    (dict(s_aux=torch.zeros(4)), "attention sinks"),
    (dict(position_bias=torch.zeros(1, 4, 1, 9)), "position bias"),
    (dict(is_causal=False), "non-causal"),
    (dict(cu_seq_lens_q=torch.tensor([0, 9])), "packed varlen"),
    (dict(attention_mask=torch.ones(1, 1, 1, 9)), "explicit attention mask"),
    (dict(sliding_window=16), "sliding_window=16 on layer 0"),
    (dict(sliding_window=None), "sliding_window=None on layer 0"),
    (dict(head_mask=torch.ones(4)), "'head_mask'"),
])
def test_each_unhonoured_kwarg_raises_a_named_error(kwargs, feature):
    layout = KVLayout(1, 2, 8, page_size=4, dtype="float32", sliding_windows=(WINDOW,))
    cache = TieredKVCache(layout, [DeviceTier(layout, 8, device="cpu")], LRU())
    q, k = torch.randn(1, 4, 9, 8), torch.randn(1, 2, 9, 8)
    cache.update(k, k, 0)
    mask = kwargs.pop("attention_mask", None)
    harmless = dict(position_ids=torch.arange(9)[None], cache_position=torch.arange(9), use_cache=True, softcap=None,
                    s_aux=None, output_attentions=False)
    out, _ = kvtier_attention(_Attention(), q, k, k, None, scaling=0.3, sliding_window=WINDOW, **harmless)
    assert out.shape == (1, 9, 4, 8)
    ACTIVE_CACHE.set(cache)  # an attention call takes the link that its layer's update set: the next calls' link
    with pytest.raises(UnsupportedAttentionError, match=feature) as err:
        kvtier_attention(_Attention(), q, k, k, mask, scaling=0.3, **{"sliding_window": WINDOW, **kwargs})
    assert err.value.field == "model" and "_Attention" in str(err.value)
    module = _Attention()
    module.is_causal = False  # an encoder-style module
    with pytest.raises(UnsupportedAttentionError, match="non-causal"):
        kvtier_attention(module, q, k, k, None, sliding_window=WINDOW)
    ACTIVE_CACHE.set(None)


SCOPES = {  # every scope and choice, under a token budget
    "all": lambda: All(), "resident": lambda: Resident(), "topk": lambda: TopK(),
    "topk_quest": lambda: TopK(unit="page", rank="quest"),
    "topk_gauss_head": lambda: TopK(unit="page", rank="gauss", per_head=True),
    "topk_sketch_pages": lambda: TopK(unit="page", rank="sketch"),
}


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_every_scope_and_choice_runs_on_sliding_window_models(name):
    """Every scope and choice under a token budget on sliding-only (Mistral) and mixed (Gemma 3) models, pages
    dropped left of the windows and read off the device; with the fused choices (keys, Quest's pages) the torch
    kernels (the oracle) and the Triton ones (interpreter) give the same logits, and a key choice never lists a key
    its window hides."""
    from kvtier.kernels.triton_decode import static_decode

    model = build(name)
    layout = kv_layout_for(model.config, page_size=PAGE, dtype=torch.float32)
    prompt = torch.randint(0, 256, (PROMPT,), generator=torch.Generator().manual_seed(7))
    hidden = []  # per key-list call: does it list a key its window hides
    for scope, make in SCOPES.items():
        logits = {}
        for kernel in ("torch", "triton") if scope in ("topk", "topk_quest") else ("torch",):
            budget = None if scope == "all" else TokenBudget(48, 4, 16, PAGE, "continuous")
            engine = Engine(model, layout, [DeviceTier(layout, 10, device="cpu"), HostTier(layout, 64)],
                            SinkWindow(sinks=4, window=16), make(), kernel=make_backend(kernel), budget=budget,
                            exact_prefill=True, config=EngineConfig(max_context=PROMPT + DECODE + 1))
            if kernel == "triton" and scope == "topk":
                def watch(q, dev, host, table, lens, *args, key_list=None, window_left=-1, **kw):
                    if key_list is not None and window_left >= 0:  # keys before the window's first: never listed
                        lo = (lens.long() - 1 - window_left).clamp(min=0)[:, None, None]
                        hidden.append(bool(((key_list >= 0) & (key_list < lo)).any()))
                    return static_decode(q, dev, host, table, lens, *args, key_list=key_list,
                                         window_left=window_left, **kw)
                engine.kernel.decode = watch
            engine.add(prompt)
            logits[kernel] = torch.stack([engine.step()[0].clone() for _ in range(4)])
            assert engine.stats.dropped_pages > 0, (scope, kernel)
        assert torch.isfinite(logits["torch"]).all(), scope
        if "triton" in logits:  # the fused choices and the decode kernel against the torch oracle
            assert (logits["torch"] - logits["triton"]).abs().max() < 1e-4 * logits["torch"].abs().max(), scope
    assert hidden and not any(hidden)
