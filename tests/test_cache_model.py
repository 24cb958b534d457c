"""The tiered cache on the real model: exact scope vs HF's own attention, generate(), salience."""

import time

import numpy as np
import pytest
import torch

from kvtier.cache import TieredKVCache
from kvtier.data import token_stream
from kvtier.engine import Engine
from kvtier.engine.attention import AttentionCallbacks
from kvtier.errors import ConfigError
from kvtier.hook import install
from kvtier.models import kv_layout_for
from kvtier.policies import ASPE, LRU, SinkWindow
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.tiers import DeviceTier, DiskTier, HostTier


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def hf_reference(smollm2):
    """HF sdpa logits for a 1k-token Opticks prompt and 32 greedy decode steps."""
    model, tok = smollm2
    model.set_attn_implementation("sdpa")
    ids = token_stream(tok, "opticks", 1024)[None]
    with torch.no_grad():
        out = model(ids, use_cache=True)
        past, logits, tokens = out.past_key_values, [out.logits[0, -1]], []
        for _ in range(32):
            tokens.append(logits[-1].argmax().view(1, 1))
            out = model(tokens[-1], past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits.append(out.logits[0, -1])
    return ids, tokens, torch.stack(logits)


def test_exact_scope_matches_hf_with_pages_on_host_and_disk(smollm2, hf_reference, tmp_path):
    """Host pages read in place, disk pages staged into pinned memory before each step: exact."""
    model, _ = smollm2
    ids, tokens, ref = hf_reference
    model.set_attn_implementation(install())
    layout = kv_layout_for(model.config, page_size=16, dtype=torch.float32)
    tiers = [DeviceTier(layout, 12, device="cpu"), HostTier(layout, 24), DiskTier(layout, 64, tmp_path)]
    cache = TieredKVCache(layout, tiers, LRU(), scope="all")
    got = [cache.prefill(model, ids, 256)[0, -1]]
    for t in tokens:
        got.append(cache.forward(model, t)[0, -1])
    got = torch.stack(got)
    occupancy = cache.table.occupancy()
    assert min(occupancy["disk"]) > 0 and min(occupancy["host"]) > 0  # pages really live on all tiers
    assert not torch.isnan(got).any()
    assert (got - ref).abs().max() / ref.abs().max() < 1e-4
    assert cache.engine.hit_rate() < 0.5 and cache.stats.fetched_bytes["disk->staging"] > 0  # in the run's ledger
    model.set_attn_implementation("sdpa")
    cache.close()


def test_generate_matches_hf_greedy(smollm2):
    model, tok = smollm2
    prompt = tok("The light of the sun is compounded of rays", return_tensors="pt").input_ids
    model.set_attn_implementation("sdpa")
    ref = model.generate(prompt, max_new_tokens=64, do_sample=False)
    model.set_attn_implementation(install())
    layout = kv_layout_for(model.config, page_size=16, dtype=torch.float32)
    cache = TieredKVCache(layout, [DeviceTier(layout, 3, device="cpu"), HostTier(layout, 16)],
                          SinkWindow(sinks=4, window=16), scope="all")
    got = model.generate(prompt, past_key_values=cache, max_new_tokens=64, do_sample=False)
    model.set_attn_implementation("sdpa")
    assert got.shape == ref.shape and torch.equal(got, ref)
    assert cache.transfer.pages_moved["device->host"] > 0  # pages did move while generating


def test_padding_other_than_left_is_refused(smollm2):
    """Left padding is kept out of the pages (tests/test_generate.py); a masked token after a row's first one is not."""
    model, tok = smollm2
    model.set_attn_implementation(install())
    layout = kv_layout_for(model.config, page_size=16, dtype=torch.float32)
    cache = TieredKVCache(layout, [DeviceTier(layout, 8, device="cpu")], LRU(), batch_size=2)
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    with pytest.raises(ConfigError) as e:
        model(ids, attention_mask=torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]]), past_key_values=cache)
    assert e.value.field == "attention_mask" and "row 0" in str(e.value)
    model.set_attn_implementation("sdpa")


def test_a_model_not_routed_through_the_hook_is_refused_and_the_cache_routes_it(smollm2):
    """With sdpa the layers would attend only the new tokens' K/V: the cache refuses at layer 1; its own
    ``forward`` switches the model to the hook itself."""
    model, _ = smollm2
    model.set_attn_implementation("sdpa")
    layout = kv_layout_for(model.config, page_size=16, dtype=torch.float32)
    cache = TieredKVCache(layout, [DeviceTier(layout, 8, device="cpu")], LRU())
    with pytest.raises(ConfigError) as e:
        model(torch.tensor([[1, 2, 3, 4]]), past_key_values=cache)
    assert e.value.field == "attn_implementation"
    cache = TieredKVCache(layout, [DeviceTier(layout, 8, device="cpu")], LRU())
    logits = cache.prefill(model, torch.tensor([[1, 2, 3, 4]]))
    assert model.config._attn_implementation == install()
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        assert rel_err(logits, model(torch.tensor([[1, 2, 3, 4]])).logits.float()) < 1e-4


def test_salience_equals_eager_max_probability():
    """Salience from per-page max logits and the merged LSE, as the step writes it into the policy's salience ring
    (Σ over kv heads of each page's max probability), vs an eager softmax over all keys, with pages on the host."""
    torch.manual_seed(0)
    from kvtier import KVLayout

    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, page_size=4, dtype="float32")
    policy = ASPE(sinks=0, window=0)
    cache = TieredKVCache(layout, [DeviceTier(layout, 3, device="cpu"), HostTier(layout, 16)], policy, scope="all")
    H, S = 6, 23
    k, v = torch.randn(1, 2, S, 8), torch.randn(1, 2, S, 8)
    cache.update(k[:, :, :-1], v[:, :, :-1], 0)  # prefill 22 tokens
    cache.attend(0, torch.randn(1, H, S - 1, 8))
    cache.finish_step()  # pages now spread over device and host
    assert cache.table.occupancy()["host"][0] > 0
    cache.update(k[:, :, -1:], v[:, :, -1:], 0)
    q = torch.randn(1, H, 1, 8)
    cache.attend(0, q, scaling=8 ** -0.5)
    cache.finish_step()
    kk = k[0].repeat_interleave(3, dim=0)  # [H, S, D]
    probs = torch.softmax((q[0, :, 0, None, :] * kk).sum(-1) * 8 ** -0.5, dim=-1)  # [H, S]
    probs = torch.nn.functional.pad(probs, (0, 1))  # [H, 24]: 6 pages of 4
    eager = probs.view(2, 3, 6, 4).amax(dim=(1, 3)).sum(0)  # [pages] Σ over kv heads of the max over the group
    sal = policy.store.device.salience
    got = sal.ring[torch.from_numpy(cache.table.pages(0)), int(sal.row), 0]  # [pages] the decode step's row
    assert torch.isfinite(got).all() and got.numel() == 6
    assert rel_err(got, eager) < 1e-5


def _synthetic_cache(scope, **kw):
    from kvtier import KVLayout

    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, page_size=4, dtype="float32")
    return TieredKVCache(layout, [DeviceTier(layout, 3, device="cpu"), HostTier(layout, 32)], LRU(), scope=scope, **kw)


def _decode_after_prefill(cache, k, v, q):
    cache.update(k[:, :, :-1], v[:, :, :-1], 0)
    cache.attend(0, torch.randn(1, 6, k.shape[2] - 1, 8))
    cache.finish_step()
    cache.update(k[:, :, -1:], v[:, :, -1:], 0)
    return cache.attend(0, q)


def test_topk_with_every_page_is_exact_and_small_k_picks_the_hot_page():
    torch.manual_seed(1)
    k, v, q = torch.randn(1, 2, 37, 8), torch.randn(1, 2, 37, 8), torch.randn(1, 6, 1, 8)
    exact = _decode_after_prefill(_synthetic_cache("all"), k, v, q)
    full = _decode_after_prefill(_synthetic_cache("topk", topk_pages=10), k, v, q)
    assert rel_err(full, exact) < 1e-6
    k_hot = k.clone()
    k_hot[:, :, 17] = 6 * q[0, ::3, 0]  # token 17 (page 4) aligned with the query of each kv group
    cache = _synthetic_cache("topk", topk_pages=4, sinks=4, unit="page", rank="quest")  # Quest's pages
    _decode_after_prefill(cache, k_hot, v, q)
    pages = cache.table.pages(0)
    chosen = cache.choose(0, q)[0]
    assert 4 in chosen.tolist() and 0 in chosen.tolist() and pages.size - 1 in chosen.tolist()
    assert len(chosen) == 4
    keys = _synthetic_cache("topk", topk_pages=1, sinks=4)  # one page's worth of keys, each kv head its own
    _decode_after_prefill(keys, k_hot, v, q)
    assert 4 in keys.choose(0, q)[0].tolist()  # the hot key's page


def test_resident_scope_attends_only_device_pages_and_the_tail():
    torch.manual_seed(2)
    k, v, q = torch.randn(1, 2, 37, 8), torch.randn(1, 2, 37, 8), torch.randn(1, 6, 1, 8)
    cache = _synthetic_cache("resident")
    _decode_after_prefill(cache, k, v, q)  # the 36-token prefill spilled past 3 device pages: fetched, misses
    attended, resident = cache.engine.page_counts()
    out = cache.attend(0, q)  # decode again: only device pages, the newest page among them
    chosen = cache.choose(0, q)[0]
    pids = cache.table.pages(0)
    on_device = set(np.flatnonzero(cache.table.tier_of[0, pids] == 0).tolist())
    assert pids.size - 1 in on_device and set(chosen.tolist()) == on_device and len(chosen) < pids.size
    now_attended, now_resident = cache.engine.page_counts()
    assert now_attended - attended == now_resident - resident == len(chosen)
    assert not torch.isnan(out).any()


def test_fidelity_equals_eager_attention_mass_and_output_error():
    """Recall = eager softmax mass on the attended pages; rel. error vs eager full attention; uncounted."""
    torch.manual_seed(3)
    k, v, q = torch.randn(1, 2, 37, 8), torch.randn(1, 2, 37, 8), torch.randn(1, 6, 1, 8)
    plain, measured = _synthetic_cache("resident"), _synthetic_cache("resident", fidelity=True)
    out_plain = _decode_after_prefill(plain, k, v, q)
    out = _decode_after_prefill(measured, k, v, q)
    assert torch.equal(out, out_plain)  # measuring changes nothing the scope computes
    assert measured.stats.fetched_bytes == plain.stats.fetched_bytes
    assert measured.stats.attended_pages == plain.stats.attended_pages
    (layer, recall, recall_min, err), = measured.fidelity.calls  # one decode call (prefill is not measured)
    chosen = measured.choose(0, q)[0]
    assert 0 < len(chosen) < measured.table.pages(0).size
    kk, vv = k[0].repeat_interleave(3, dim=0), v[0].repeat_interleave(3, dim=0)  # [H, S, D]
    probs = torch.softmax((q[0, :, 0, None, :] * kk).sum(-1) * 8 ** -0.5, dim=-1)  # [H, S]
    on_chosen = torch.zeros(37, dtype=torch.bool)
    for page in chosen.tolist():
        on_chosen[page * 4:(page + 1) * 4] = True
    mass = probs[:, on_chosen].sum(-1)  # [H]
    exact = (probs[:, :, None] * vv).sum(1)  # [H, D]
    assert layer == 0 and recall_min <= recall < 1
    assert abs(recall - mass.mean().item()) < 1e-5 and abs(recall_min - mass.min().item()) < 1e-5
    assert abs(err - rel_err(out[0, 0], exact)) < 1e-5
    full = _synthetic_cache("topk", topk_pages=10, fidelity=True)  # every page chosen: exact
    _decode_after_prefill(full, k, v, q)
    (_, recall, _, err), = full.fidelity.calls
    assert abs(recall - 1) < 1e-6 and err < 1e-6
    assert _synthetic_cache("all", fidelity=True).fidelity is None  # exact scope: nothing to measure


def test_engine_leaves_the_fidelity_pass_out_of_tpot(monkeypatch):
    """TTFT/TPOT exclude the measurement pass: a pass made to take 0.25 s per layer does not show."""
    from kvtier.models import random_llama

    model = random_llama(num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=16,
                         vocab_size=32, dtype="float32", device="cpu")
    model.set_attn_implementation(install())
    layout = kv_layout_for(model.config, page_size=4, dtype=torch.float32)
    real = AttentionCallbacks.measure_fidelity

    def slow(self, *args):
        real(self, *args)
        time.sleep(0.25)
        self.engine.stats.fidelity_s += 0.25

    monkeypatch.setattr(AttentionCallbacks, "measure_fidelity", slow)
    engine = Engine(model, layout, [DeviceTier(layout, 3, device="cpu"), HostTier(layout, 8)], LRU(), "resident",
                    prefill=ChunkedPrefill(8), fidelity=True)
    engine.add(torch.randint(0, 32, (16,)))
    for _ in range(3):
        engine.step()
    assert len(engine.fidelity.calls) == 3 * 2 and engine.stats.fidelity_s > 3 * 2 * 0.25
    assert max(engine.tpot_s) < 0.25 and min(engine.tpot_s) > 0
