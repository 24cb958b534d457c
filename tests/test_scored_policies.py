"""Scored policies on planted inputs (each one's defining behaviour), the per-page statistics they
read, token budgets (sinks cost tokens, not pages; StreamingLLM token-exact against HF) and
compress-once after an exact prefill."""

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kvtier import KVLayout, TokenBudget
from kvtier.cache import TieredKVCache
from kvtier.errors import ConfigError, KVTierError
from kvtier.stats import DeviceStats, KeyStats, QueryStats
from kvtier.policies import (H2O, LRU, PINNED, TOVA, Compose, ExpectedAttention, Knorm, PageInfo, Quest,
                             ScoredPolicy, SinkWindow, SnapKV)
from kvtier.policies.h2o import AccumulatedAttention
from kvtier.policies.scored import Scorer, best_head
from kvtier.tiers import DeviceTier, HostTier

N_KV, D = 2, 8


def info(n_pages, seq_len=None, page=16):
    seq_len = n_pages * page if seq_len is None else seq_len
    return PageInfo(np.arange(n_pages), np.arange(n_pages), np.full(n_pages, seq_len), page, 0)


def feed(pol, rows_per_step, layers=1):
    """Planted attention: ``rows_per_step`` is a list of ``[r, n]`` arrays (mass per page, head 0;
    head 1 gets a tenth of it)."""
    pol.reset(layers)
    n = np.asarray(rows_per_step[0]).shape[-1]
    pol.on_append(np.arange(n), 0)
    for step, rows in enumerate(rows_per_step):
        rows = np.asarray(rows, dtype=np.float32)
        mass = np.stack([rows, rows / 10], -1)  # [r, n, N_kv]
        pol.on_step(step)
        for layer in range(layers):
            pol.on_attention(layer, np.arange(n), mass, step)
    return pol


def ranked(pol, n):
    """Priorities of pages 0..n-1 of a sequence whose page n is being written (always pinned)."""
    return pol.priority(info(n + 1, n * 16 + 1))[0][:n]


def middle_order(pol, n):
    prio = ranked(pol, n)
    assert np.isfinite(prio).all()
    return list(np.argsort(-prio, kind="stable"))


def test_h2o_keeps_the_largest_accumulated_attention():
    # page 2 wins every early step; page 4 wins only the last: accumulated, page 2 is the heavy hitter
    steps = [[[0.1, 0.1, 0.6, 0.1, 0.1]]] * 5 + [[[0.0, 0.1, 0.0, 0.0, 0.9]]]
    pol = feed(H2O(sinks=0, window=0), steps)
    order = middle_order(pol, 5)
    assert order[0] == 2 and order[1] == 4
    assert pol.attention_rows is None  # every query row (prefill rows included)


def test_attention_statistics_of_a_run_of_pids_are_read_only_views_equal_to_a_gather():
    """A sequence's pids in one ascending run read the store's arrays in place (read-only); any other set of pids
    gathers them; both give the same values."""
    pol = feed(H2O(sinks=0, window=0), [[[0.1, 0.2, 0.3, 0.4, 0.5, 0.6]]] * 3)
    store = pol.store
    run = store.stats(PageInfo(np.arange(1, 5), np.arange(4), np.full(4, 64), 16, 0))
    scattered = store.stats(PageInfo(np.array([4, 1, 3]), np.arange(3), np.full(3, 48), 16, 0))
    total = store.device.attention.read()["total"]  # [L, pids, N_kv]
    assert np.shares_memory(run.attention_total, total) and not run.attention_total.flags.writeable
    assert np.array_equal(run.attention_total, total[:, 1:5])
    assert not np.shares_memory(scattered.attention_total, total)
    assert np.array_equal(scattered.attention_total, total[:, [4, 1, 3]])
    with pytest.raises(ValueError):
        run.attention_total[0, 0, 0] = 1.0  # a scorer cannot write into the store


@dataclass
class ReadsEverySum(Scorer):
    """A scorer that declares every attention sum (the default), over a 3-row window."""

    needs = frozenset({"attention"})
    rows: int = 3

    def score(self, stats):
        return best_head(stats.attention_total + stats.attention_window)


def test_the_store_keeps_only_the_attention_sums_its_scorer_reads():
    """H2O's, TOVA's and SnapKV's stores keep one sum each, equal to a store keeping all three; a scorer that reads a
    sum its ``attention_fields`` do not name gets a named error, not zeros."""
    rng = np.random.default_rng(0)
    steps = [rng.random((int(rng.integers(1, 4)), 6)) for _ in range(7)]  # rows of 1-3 queries per step
    every = feed(ScoredPolicy(sinks=0, window=0, scorer=ReadsEverySum()), steps)
    pages = PageInfo(np.arange(6), np.arange(6), np.full(6, 96), 16, 0)
    for pol, field in ((H2O(sinks=0, window=0), "total"), (TOVA(sinks=0, window=0), "last"),
                       (SnapKV(sinks=0, window=0, obs_window=3), "window")):
        store = feed(pol, steps).store
        assert store.keeps == {field}
        assert np.allclose(getattr(store.stats(pages), f"attention_{field}"),
                           getattr(every.store.stats(pages), f"attention_{field}"))
        other = next(f for f in ("total", "last", "window") if f != field)
        with pytest.raises(KVTierError, match=f"attention_{other}"):
            getattr(store.stats(pages), f"attention_{other}")


def test_tova_drops_the_page_the_last_query_attends_least():
    # page 0 is the heavy hitter of the past; the newest query gives it the least
    steps = [[[0.9, 0.05, 0.02, 0.03]]] * 4 + [[[0.01, 0.5, 0.3, 0.19]]]
    pol = feed(TOVA(sinks=0, window=0), steps)
    order = middle_order(pol, 4)
    assert order[-1] == 0 and order[0] == 1
    assert pol.attention_rows == 1


def test_tova_a_page_the_last_query_did_not_attend_scores_zero():
    pol = TOVA(sinks=0, window=0)
    pol.reset(1)
    pol.on_append(np.arange(3), 0)
    pol.on_attention(0, np.arange(3), np.ones((1, 3, N_KV), np.float32), 0)
    pol.on_attention(0, np.array([0, 2]), np.full((1, 2, N_KV), 0.5, np.float32), 1)  # page 1 not attended
    np.testing.assert_allclose(ranked(pol, 3), [0.5, 0.0, 0.5])


def test_snapkv_pools_the_observation_window_only():
    # one prefill chunk of 6 rows: rows 0-2 favour page 0, the last 3 rows (the window) page 3
    rows = np.array([[0.9, 0.0, 0.1, 0.0]] * 3 + [[0.0, 0.2, 0.1, 0.7]] * 3)
    pol = feed(SnapKV(sinks=0, window=0, obs_window=3), [rows])
    prio = ranked(pol, 4)
    np.testing.assert_allclose(prio, [0.0, 0.6, 0.3, 2.1], rtol=1e-6)  # sums over the window rows, head 0
    wide = feed(SnapKV(sinks=0, window=0, obs_window=6), [rows])
    assert middle_order(wide, 4)[0] == 0  # the whole chunk as window: page 0 wins


def test_pins_are_sinks_and_window_pages():
    pol = feed(H2O(sinks=4, window=20), [[[0.0] * 6]])
    prio = pol.priority(info(6, 6 * 16 - 3))[0]
    assert list(np.flatnonzero(prio == PINNED)) == [0, 4, 5]  # page 4 holds some of the last 20 tokens


def keys_for(pages_keys, page=4):
    """KeyStats of 1 layer holding ``pages_keys [n_pages, page, N_kv, D]``."""
    layout = KVLayout(num_layers=1, num_kv_heads=N_KV, head_dim=D, page_size=page, dtype="float32")
    ks = KeyStats(layout, 64, "cpu")
    n = pages_keys.shape[0]
    ks.on_append(np.arange(n))
    ks.add(0, torch.arange(n * page) // page, pages_keys.reshape(n * page, N_KV, D))
    return ks


def bound_policy(pol, keys, queries=None):
    pol.reset(1)
    pol.attach([DeviceStats(keys, queries)])  # what an engine hands it: its key and query statistics
    return pol


def test_knorm_keeps_low_key_norm_pages():
    torch.manual_seed(0)
    pk = torch.randn(5, 4, N_KV, D)
    scale = torch.tensor([1.0, 3.0, 0.2, 2.0, 1.5])  # page 2 has the smallest keys, page 1 the largest
    pol = bound_policy(Knorm(sinks=0, window=0), keys_for(pk * scale[:, None, None, None]))
    order = middle_order(pol, 5)
    assert order[0] == 2 and order[-1] == 1
    np.testing.assert_allclose(pol.store.stats(info(5)).key_norm[0],
                               (pk * scale[:, None, None, None]).norm(dim=-1).mean(1).numpy(), rtol=1e-5)


def test_quest_policy_ranks_the_page_aligned_with_the_newest_query():
    torch.manual_seed(1)
    pk = torch.randn(6, 4, N_KV, D) * 0.1
    q = torch.randn(2 * N_KV, D)  # 2 query heads per kv head
    pk[3, 1, 0] = 5 * q[0]  # one key of page 3 aligned with query head 0
    queries = QueryStats(1, 1, 2 * N_KV, D, "cpu")
    queries.add(0, q[None])
    pol = bound_policy(Quest(sinks=0, window=0), keys_for(pk), queries)
    assert middle_order(pol, 6)[0] == 3
    empty = bound_policy(Quest(sinks=0, window=0), keys_for(pk), QueryStats(1, 1, 2 * N_KV, D, "cpu"))
    assert (ranked(empty, 6) == 0).all()  # no query yet: no preference


def test_expected_attention_follows_the_query_mean_and_variance():
    pk = torch.zeros(4, 4, N_KV, D)
    mu = torch.zeros(2 * N_KV, D)
    mu[:, 0] = 1.0
    pk[1, :, :, 0] = 3.0  # page 1 lies along the query mean
    pk[2, :, :, 5] = 3.0  # page 2 along channel 5, where the queries vary
    queries = QueryStats(1, 8, 2 * N_KV, D, "cpu")
    for sign in (1, -1, 1, -1):
        q = mu.clone()
        q[:, 5] = 2.0 * sign  # mean 0, variance 4 on channel 5
        queries.add(0, q[None])
    pol = bound_policy(ExpectedAttention(sinks=0, window=0), keys_for(pk), queries)
    prio = ranked(pol, 4)
    # page 1: mu.k/sqrt(D) = 3/sqrt(8); page 2: var*k^2/(2D) = 4*9/16
    np.testing.assert_allclose(prio, [0, 3 / np.sqrt(8), 4 * 9 / 16, 0], rtol=1e-5)
    assert list(np.argsort(-prio))[:2] == [2, 1]


def test_scored_policy_validates_itself():
    with pytest.raises(ConfigError) as e:
        ScoredPolicy()
    assert e.value.field == "policy.scorer"
    with pytest.raises(ConfigError) as e:
        SnapKV(obs_window=0)
    assert e.value.field == "policy.obs_window"
    with pytest.raises(ConfigError) as e:
        H2O(window=-1)
    assert e.value.field == "policy.window"
    assert isinstance(ScoredPolicy(scorer=AccumulatedAttention()).scorer, AccumulatedAttention)
    both = Compose(rank=H2O(), pins=[SinkWindow(), Knorm()])  # a combinator gathers what its parts need
    assert both.needs == {"attention", "keys"} and both.attention_rows is None


# -- the cache: statistics, token budgets, compress once ------------------------------------------
LAYOUT = KVLayout(num_layers=1, num_kv_heads=N_KV, head_dim=D, page_size=4, dtype="float32")


def make_cache(policy, scope="resident", device_pages=64, **kw):
    return TieredKVCache(LAYOUT, [DeviceTier(LAYOUT, device_pages, device="cpu"), HostTier(LAYOUT, 64)], policy,
                         scope=scope, **kw)


def eager(q, k, v, keep):
    """Eager attention of q ``[1, H, 1, D]`` over the keys ``keep`` (bool ``[S]``): out ``[H, D]``, probs ``[H, S]``."""
    kk, vv = k[0].repeat_interleave(3, dim=0), v[0].repeat_interleave(3, dim=0)  # [H, S, D]
    logits = (q[0, :, 0, None, :] * kk).sum(-1) * D ** -0.5
    probs = torch.softmax(logits.masked_fill(~keep, float("-inf")), dim=-1)
    return (probs[:, :, None] * vv).sum(1), probs


def run_steps(cache, k, v, qs, prefill):
    """Prefill ``prefill`` tokens (one chunk), then one decode step per remaining token; returns outputs."""
    outs = []
    cache.update(k[:, :, :prefill], v[:, :, :prefill], 0)
    cache.attend(0, torch.randn(1, 6, prefill, D))
    cache.end_prefill()
    for i in range(prefill, k.shape[2]):
        cache.update(k[:, :, i:i + 1], v[:, :, i:i + 1], 0)
        outs.append(cache.attend(0, qs[i][None, :, None]))
    cache.finish_step()
    return outs


def test_budget_counts_tokens_and_streaming_spans_are_token_exact():
    """budget 16 = 3 sink tokens + 13 recent tokens: never a whole sink page, checked against eager."""
    torch.manual_seed(4)
    S = 41
    k, v, qs = torch.randn(1, N_KV, S, D), torch.randn(1, N_KV, S, D), torch.randn(S, 6, D)
    cache = make_cache(SinkWindow(sinks=3, window=13), budget=TokenBudget(16, sinks=3, window=13))
    outs = run_steps(cache, k, v, qs, prefill=10)
    for i, out in zip(range(10, S), outs):
        keep = torch.zeros(S, dtype=torch.bool)
        keep[: i + 1] = True
        if i + 1 > 16:
            keep[3: i + 1 - 13] = False
        ref, _ = eager(qs[i][None, :, None], k[:, :, : S], v[:, :, : S], keep)
        assert torch.allclose(out[0, 0], ref, atol=1e-5), i
    per_step = cache.stats.attended_per_step()
    assert per_step == [float(min(i + 1, 16)) for i in range(10, S)]


def test_budget_middle_pages_follow_the_policy_under_resident_and_the_query_under_topk():
    torch.manual_seed(5)
    S = 49  # 12 full pages + 1
    k, v, qs = torch.randn(1, N_KV, S, D), torch.randn(1, N_KV, S, D), torch.randn(S, 6, D)
    k[:, :, 21] = 6 * qs[S - 1, ::3]  # token 21 (page 5) aligned with the last query
    # budget 4 sinks + 8 recent + 2 pages of 4
    topk = make_cache(LRU(), scope="topk", budget=TokenBudget(20, sinks=4, window=8))
    run_steps(topk, k, v, qs, prefill=48)
    chosen = topk.choose(0, qs[S - 1][None, :, None])[0]
    assert 5 in chosen.tolist() and topk.stats.attended_per_step() == [20.0]
    # resident: the H2O heavy hitter of the prefill's rows, whatever the query
    u = torch.nn.functional.normalize(torch.randn(N_KV, D), dim=-1)
    k2 = torch.randn(1, N_KV, S, D)
    k2[:, :, 30] = 5 * u  # token 30 (page 7) is what every prefill query looks for
    q_prefill = torch.randn(48, 6, D) + 3 * u.repeat_interleave(3, dim=0)
    pol = H2O(sinks=4, window=8)
    res = make_cache(pol, budget=TokenBudget(20, sinks=4, window=8), exact_prefill=True)
    res.update(k2[:, :, :48], v[:, :, :48], 0)
    res.attend(0, q_prefill.permute(1, 0, 2)[None])
    res.end_prefill()
    acc = pol.store.stats(info(12, 48, page=4)).attention_total[0].max(-1)  # [pages]
    assert np.argmax(acc[1:10]) + 1 == 7
    res.update(k2[:, :, 48:], v[:, :, 48:], 0)
    chosen = res.choose(0, qs[S - 1][None, :, None])[0]
    middle = sorted((np.argsort(-acc[1:10], kind="stable")[:2] + 1).tolist())  # candidates: pages 1-9
    assert chosen.tolist() == [0] + middle + [10, 11, 12] and 7 in middle


def test_page_attention_equals_eager_mass_per_page():
    torch.manual_seed(6)
    S = 30
    k, v, q = torch.randn(1, N_KV, S, D), torch.randn(1, N_KV, S, D), torch.randn(1, 6, 1, D)
    pol = TOVA(sinks=0, window=0)
    cache = make_cache(pol, budget=TokenBudget(14, sinks=2, window=8))
    cache.update(k[:, :, :-1], v[:, :, :-1], 0)
    cache.attend(0, torch.randn(1, 6, S - 1, D))
    cache.finish_step()
    cache.update(k[:, :, -1:], v[:, :, -1:], 0)
    # attended: tokens 0-1 (sinks), the middle page best by TOVA, tokens 22-29 (window)
    chosen = cache.choose(0, q)[0]
    cache.attend(0, q)
    cache.finish_step()
    cache.engine.feedback.take(upto=cache.engine.step_idx)  # the statistics as they are now
    last = pol.store.device.attention.read()["last"][0]  # [pids, N_kv] the decode row's mass
    keep = torch.zeros(S, dtype=torch.bool)
    keep[:2] = keep[22:] = True
    for page in chosen.tolist():
        if 1 <= page < 5:
            keep[page * 4:(page + 1) * 4] = True
    _, probs = eager(q, k, v, keep)  # [H, S]
    per_page = torch.nn.functional.pad(probs, (0, 2)).view(N_KV, 3, 8, 4).sum(-1).mean(1)  # [N_kv, pages]
    pids = cache.table.pages(0)
    np.testing.assert_allclose(last[pids].T, per_page.numpy(), atol=1e-5)  # a page not attended: 0 in both
    assert last.sum() == pytest.approx(N_KV, abs=1e-4)  # all the mass, each kv head


def test_compress_once_after_an_exact_prefill():
    torch.manual_seed(7)
    S = 45
    k, v, qs = torch.randn(1, N_KV, S, D), torch.randn(1, N_KV, S, D), torch.randn(S, 6, D)
    exact = make_cache(LRU(), scope="all")
    ref = run_steps(exact, k, v, qs, prefill=40)
    pol = SnapKV(sinks=4, window=8, obs_window=4)
    cache = make_cache(pol, budget=TokenBudget(20, sinks=4, window=8, mode="once"))
    cache.update(k[:, :, :40], v[:, :, :40], 0)
    out_prefill = cache.attend(0, qs[:40].permute(1, 0, 2)[None])
    exact_prefill = make_cache(LRU(), scope="all")
    exact_prefill.update(k[:, :, :40], v[:, :, :40], 0)
    assert torch.allclose(out_prefill, exact_prefill.attend(0, qs[:40].permute(1, 0, 2)[None]), atol=1e-6)
    cache.end_prefill()
    window_score = pol.store.stats(info(10, 40, page=4)).attention_window[0].max(-1)  # [pages]
    # candidates: pages 1..7 (window starts at token 41 - 8 = 33: page 8); 2 kept, the best by SnapKV
    best = sorted((np.argsort(-window_score[1:8], kind="stable")[:2] + 1).tolist())
    live = np.flatnonzero(cache.table.tier_of[0, cache.table.pages(0)] >= 0).tolist()
    assert live == [0] + best + [8, 9]
    assert cache.stats.compressed_pages == 5
    outs = []
    for i in range(40, S):
        cache.update(k[:, :, i:i + 1], v[:, :, i:i + 1], 0)
        outs.append(cache.attend(0, qs[i][None, :, None]))
    # the window grows from its fixed start: 4 + 2 pages + tokens 33..i (the last step is heard once closed)
    cache.finish_step()
    assert cache.stats.attended_per_step() == [4 + 8 + (i + 1 - 33) for i in range(40, S)]
    keep = torch.zeros(S, dtype=torch.bool)
    keep[:4] = keep[33:] = True
    for page in best:
        keep[page * 4:(page + 1) * 4] = True
    want, _ = eager(qs[S - 1][None, :, None], k, v, keep)
    assert torch.allclose(outs[-1][0, 0], want, atol=1e-5)
    assert not torch.allclose(outs[-1], ref[-1], atol=1e-3)  # compression did change the result


@pytest.mark.parametrize("kw,field", [
    (lambda: dict(budget=TokenBudget(10, sinks=4, window=8)), "budget"),
    (lambda: dict(budget=TokenBudget(32, window=0)), "cache.window"),
    (lambda: dict(budget=TokenBudget(32, window=8, mode="later")), "cache.mode"),
    (lambda: dict(budget=TokenBudget(32, window=8), scope="all"), "cache.attend_budget"),
    (lambda: dict(scope="topk", topk_pages=4, rank="best"), "scope.rank"),
    (lambda: dict(scope="topk"), "scope.pages"),
    (lambda: dict(budget=TokenBudget(32, window=8), dense_layers=2), "cache.dense_layers"),
    (lambda: dict(budget=TokenBudget(32, window=8), per_head=True), "scope.per_head"),  # resident: per head needs topk
    (lambda: dict(scope="topk", budget=TokenBudget(32, window=8), query_rows=0), "scope.query_rows"),
    (lambda: dict(scope="topk", budget=TokenBudget(32, window=8), policy_share=1.5), "scope.policy_share"),
    (lambda: dict(budget=32), "budget"),  # a number: the message names the TokenBudget to write
    (lambda: dict(budget=TokenBudget(32, window=8, page_size=8)), "budget"),  # the layout's pages hold 4 tokens
    (lambda: dict(budget=TokenBudget(96), window=8), "window"),  # the cache's old spelling: its new one named
    (lambda: dict(budget=TokenBudget(96), mode="once"), "mode"),
])
def test_bad_budget_configs(kw, field):
    with pytest.raises(ConfigError) as e:
        make_cache(LRU(), **{"scope": "resident", **kw()})
    assert e.value.field == field


def test_streaming_llm_token_exact_against_a_trimmed_hf_cache(smollm2):
    """Budget 28 = 4 sinks + 24 recent tokens; HF's own DynamicCache trimmed by hand to the same
    tokens before every decode step (keys keep their positions) gives the same logits."""
    from transformers import DynamicCache

    from kvtier.data import token_stream
    from kvtier.engine import Engine
    from kvtier.hook import install
    from kvtier.models import kv_layout_for

    model, tok = smollm2
    ids = token_stream(tok, "opticks", 64)[None]
    prompt, sinks, recent = 20, 4, 24
    model.set_attn_implementation("sdpa")
    ref = []
    with torch.no_grad():
        past = DynamicCache()
        out = model(ids[:, :prompt], past_key_values=past, use_cache=True)
        for i in range(prompt, ids.shape[1]):
            n = i + 1  # tokens once this one is in
            if n > sinks + recent:
                for layer in past.layers:
                    keep = list(range(sinks)) + list(range(layer.keys.shape[2] - (recent - 1), layer.keys.shape[2]))
                    layer.keys, layer.values = layer.keys[:, :, keep], layer.values[:, :, keep]
            out = model(ids[:, i:i + 1], past_key_values=past, position_ids=torch.tensor([[i]]), use_cache=True)
            ref.append(out.logits[0, -1])
    model.set_attn_implementation(install())
    layout = kv_layout_for(model.config, page_size=16, dtype=torch.float32)
    cache = TieredKVCache(layout, [DeviceTier(layout, 8, device="cpu"), HostTier(layout, 16)],
                          SinkWindow(sinks=sinks, window=recent), scope="resident",
                          budget=TokenBudget(sinks + recent, sinks=sinks, window=recent))
    cache.prefill(model, ids[:, :prompt])
    got = [cache.forward(model, ids[:, i:i + 1])[0, -1] for i in range(prompt, ids.shape[1])]
    model.set_attn_implementation("sdpa")
    ref, got = torch.stack(ref), torch.stack(got)
    assert (got - ref).abs().max() / ref.abs().max() < 1e-4
    assert cache.stats.attended_per_step()[-1] == sinks + recent
    full = ids.shape[1]  # and the trimming mattered: exact attention differs
    with torch.no_grad():
        exact = model(ids).logits[0, prompt - 1:full - 1]
    assert (exact[-1] - ref[-1]).abs().max() > 1e-2


QUEST = dict(unit="page", rank="quest")  # the page choice these tests are about


def test_topk_per_head_gives_each_kv_head_its_own_pages_within_the_budget():
    """budget 16 = 4 sinks + 8 recent + 1 page: kv head 0 needs page 5, kv head 1 page 8; per head,
    each gets its own (the step attends their union), checked against eager attention per head."""
    torch.manual_seed(7)
    S = 49
    k, v, qs = torch.randn(1, N_KV, S, D), torch.randn(1, N_KV, S, D), torch.randn(S, 6, D)
    k[:, 0, 21] = 6 * qs[S - 1, 0]  # page 5, kv head 0 (query heads 0-2)
    k[:, 1, 33] = 6 * qs[S - 1, 3]  # page 8, kv head 1 (query heads 3-5)
    shared = make_cache(LRU(), scope="topk", budget=TokenBudget(16, sinks=4, window=8), **QUEST)
    run_steps(shared, k, v, qs, prefill=48)
    assert len(set(shared.choose(0, qs[S - 1][None, :, None])[0].tolist()) & {5, 8}) == 1  # one page for both
    cache = make_cache(LRU(), scope="topk", budget=TokenBudget(16, sinks=4, window=8), per_head=True, **QUEST)
    out = run_steps(cache, k, v, qs, prefill=48)[-1]
    cache.finish_step()
    assert {5, 8} <= set(cache.choose(0, qs[S - 1][None, :, None])[0].tolist())
    per_head = cache.engine.scope.pick(0, qs[S - 1][None].contiguous(), cache.engine.callbacks.view(1))[0]  # [N_kv, K]
    assert 5 in per_head[0] and 8 not in per_head[0] and 8 in per_head[1] and 5 not in per_head[1]
    keep = torch.zeros(6, S, dtype=torch.bool)  # [H, S]
    keep[:, :4] = keep[:, 41:] = True
    keep[:3, 20:24] = keep[3:, 32:36] = True
    want, _ = eager(qs[S - 1][None, :, None], k, v, keep)
    assert torch.allclose(out[0, 0], want, atol=1e-5)
    assert cache.stats.attended_per_step() == [16.0]  # each head attends the budget


def test_topk_query_rows_keep_what_the_previous_queries_needed():
    torch.manual_seed(8)
    S = 49
    k, v, qs = torch.randn(1, N_KV, S, D), torch.randn(1, N_KV, S, D), torch.randn(S, 6, D)
    a = torch.randn(N_KV, D)
    qs[S - 2] = a.repeat_interleave(3, dim=0)  # every head of the query before the last looks for page 5
    k[:, :, 21] = 6 * a
    qs[S - 1] = -qs[S - 2]  # the last query looks away from it
    picks = {}
    for rows in (1, 3):
        cache = make_cache(LRU(), scope="topk", budget=TokenBudget(16, sinks=4, window=8), query_rows=rows, **QUEST)
        run_steps(cache, k, v, qs, prefill=47)  # decode steps 47 and 48
        picks[rows] = cache.choose(0, qs[S - 1][None, :, None])[0].tolist()  # the last query again: 3 rows
    assert 5 not in picks[1] and 5 in picks[3]


def test_topk_policy_share_spends_pages_on_the_policy_ranking():
    """share 1: the middle pages are H2O's heavy hitters of the prefill, whatever the query."""
    torch.manual_seed(5)
    S = 49
    k, v, qs = torch.randn(1, N_KV, S, D), torch.randn(1, N_KV, S, D), torch.randn(S, 6, D)
    u = torch.nn.functional.normalize(torch.randn(N_KV, D), dim=-1)
    k[:, :, 30] = 5 * u  # token 30 (page 7) is what every prefill query looks for
    q_prefill = torch.randn(48, 6, D) + 3 * u.repeat_interleave(3, dim=0)
    chosen = {}
    for share in (0.0, 1.0):
        pol = H2O(sinks=4, window=8)
        cache = make_cache(pol, scope="topk", budget=TokenBudget(16, sinks=4, window=8), exact_prefill=True, policy_share=share,
                           **QUEST)
        cache.update(k[:, :, :48], v[:, :, :48], 0)
        cache.attend(0, q_prefill.permute(1, 0, 2)[None])
        cache.end_prefill()
        cache.update(k[:, :, 48:], v[:, :, 48:], 0)
        chosen[share] = cache.choose(0, -qs[S - 1][None, :, None])[0].tolist()  # a query that avoids page 7
    assert 7 in chosen[1.0] and 7 not in chosen[0.0]


def gaussian_pages(n_pages: int, page: int, seed: int) -> torch.Tensor:
    """Keys ``[n_pages, page, N_KV, D]``: each page's keys drawn about its own mean with its own spread."""
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(n_pages, 1, N_KV, D, generator=g)
    spread = torch.rand(n_pages, 1, N_KV, 1, generator=g) * 3
    return mean + spread * torch.randn(n_pages, page, N_KV, D, generator=g)


def test_gauss_mass_is_the_log_normal_estimate_from_each_pages_keys():
    """``rank=gauss``'s page scores from KeyStats equal the estimate computed from the keys themselves: per head,
    log n + s q·mean + s^2/2 sum_d q_d^2 var_d, a softmax over the row's pages, 0 outside the candidates."""
    from kvtier.scopes.topk import gauss_mass

    n_pages, page = 12, 4
    keys = gaussian_pages(n_pages, page, seed=3)  # [M, P, N_kv, D]
    stats = KeyStats(LAYOUT, n_pages, "cpu")
    pids = torch.arange(n_pages)
    stats.add(0, pids.repeat_interleave(page), keys.reshape(-1, N_KV, D))
    q = torch.randn(2, 6, D, generator=torch.Generator().manual_seed(4))  # [B, H, D]
    cand = torch.rand(2, n_pages, generator=torch.Generator().manual_seed(5)) < 0.7  # [B, M]
    live = torch.arange(n_pages)[None, :] < torch.tensor([[n_pages], [n_pages - 3]])  # [B, M] row 1: 3 pages fewer
    got = gauss_mass(q, stats, 0, pids.expand(2, -1), live, cand)  # [B, M, H]
    kk = keys.repeat_interleave(3, dim=2)  # [M, P, H, D] each query head's keys
    mean, var = kk.mean(1), kk.var(1, unbiased=False)  # [M, H, D]
    s = D ** -0.5
    log_z = np.log(page) + s * (q[:, None] * mean).sum(-1) + 0.5 * s * s * (q[:, None] ** 2 * var).sum(-1)  # [B, M, H]
    want = torch.softmax(log_z.masked_fill(~live[..., None], float("-inf")), dim=1).masked_fill(~cand[..., None], 0)
    assert torch.allclose(got, want, atol=1e-5)


def test_gauss_choice_tracks_the_true_attention_mass_better_than_quests_bound():
    """On pages of Gaussian keys with different spreads, the pages ``rank=gauss`` picks hold more of the query's
    true attention mass than the pages of Quest's bound (which grows with every channel's range)."""
    from kvtier.stats import quest_bound
    from kvtier.scopes.base import best_of
    from kvtier.scopes.topk import gauss_mass

    n_pages, page, k = 64, 16, 8
    held = {"gauss": 0.0, "quest": 0.0, "oracle": 0.0}
    for seed in range(10):
        keys = gaussian_pages(n_pages, page, seed)  # [M, P, N_kv, D]
        stats = KeyStats(LAYOUT, n_pages, "cpu")
        pids = torch.arange(n_pages)
        stats.add(0, pids.repeat_interleave(page), keys.reshape(-1, N_KV, D))
        q = 2 * torch.randn(1, 6, D, generator=torch.Generator().manual_seed(100 + seed))  # [1, H, D]
        logits = (q[0, :, None, None] * keys.repeat_interleave(3, dim=2).permute(2, 0, 1, 3)).sum(-1) * D ** -0.5
        mass = torch.softmax(logits.reshape(6, -1), -1).view(6, n_pages, page).sum(-1).sum(0)  # [M] over heads
        cand = torch.ones(1, n_pages, dtype=torch.bool)
        picks = {"gauss": best_of(gauss_mass(q, stats, 0, pids[None], cand, cand).sum(-1), cand, k)[0],
                 "quest": best_of(quest_bound(q, stats.key_min[0][pids][None], stats.key_max[0][pids][None]).amax(-1),
                                  cand, k)[0],
                 "oracle": mass.topk(k).indices}
        for name, chosen in picks.items():
            held[name] += float(mass[chosen].sum()) / 10
    assert held["gauss"] > held["quest"] + 0.1 and held["oracle"] >= held["gauss"]


def test_a_full_rank_sketch_gives_each_pages_true_attention_share():
    """``rank=sketch`` with r = D: the sketch is the keys in another basis, so each page's share is its share of
    the head's softmax over every stored key, up to the sketch's 8-bit levels (keys written after the fit sketched
    as they come, pages partly filled, a row with fewer pages, holes in the candidates)."""
    from kvtier.scopes.topk import sketch_mass

    n_pages, page, full = 12, 4, 7
    keys = gaussian_pages(n_pages, page, seed=7)  # [M, P, N_kv, D]
    stats = KeyStats(LAYOUT, n_pages, "cpu", sketch_rank=D)
    pids = torch.arange(n_pages)
    stats.add(0, pids[:full].repeat_interleave(page), keys[:full].reshape(-1, N_KV, D))  # 7 full pages
    stats.fit_sketch([(np.arange(full), [keys[:full].reshape(-1, N_KV, D)])])
    rest = pids[full:]
    stats.add(0, rest.repeat_interleave(2), keys[full:, :2].reshape(-1, N_KV, D))  # then 2 keys of each other page
    stats.add(0, rest, keys[full:, 2])  # and one more (a decode step's rows)
    stored = torch.cat([torch.full((full,), page), torch.full((n_pages - full,), 3)])  # [M] keys per page
    q = torch.randn(2, 6, D, generator=torch.Generator().manual_seed(8))  # [B, H, D]
    cand = torch.rand(2, n_pages, generator=torch.Generator().manual_seed(9)) < 0.7  # [B, M]
    live = torch.arange(n_pages)[None, :] < torch.tensor([[n_pages], [n_pages - 3]])  # [B, M]
    got = sketch_mass(q, stats, 0, pids.expand(2, -1), live, cand)  # [B, M, H]
    logits = torch.einsum("bhd,mphd->bmph", q, keys.repeat_interleave(3, dim=2)) * D ** -0.5  # [B, M, P, H]
    ok = (torch.arange(page)[None, :] < stored[:, None])[None, :, :, None] & live[:, :, None, None]
    mass = torch.softmax(logits.masked_fill(~ok, float("-inf")).flatten(1, 2), 1).view_as(logits).sum(2)  # [B, M, H]
    assert torch.allclose(got, mass.masked_fill(~cand[..., None], 0), rtol=5e-2, atol=4e-2)  # 8-bit levels


def test_the_sketch_maps_lose_the_least_of_q_dot_k():
    """:func:`sketch_maps`: at r = D the form is q.k itself; with no query seen (or the query moment shrunk all the
    way to the identity), the projection on the keys' top principal directions (Loki's); with queries seen, a smaller
    expected error over those queries than that projection (the queries lie where the keys vary little), less so the
    more their moment is shrunk."""
    from kvtier.stats import sketch_maps

    g = torch.Generator().manual_seed(10)
    D, r, S = 8, 3, 4000
    keys = torch.randn(S, D, generator=g, dtype=torch.float64) * torch.linspace(3, 0.5, D, dtype=torch.float64)
    queries = torch.randn(S, D, generator=g, dtype=torch.float64) * torch.linspace(0.2, 4, D, dtype=torch.float64)
    k2, q2 = keys.T @ keys, queries.T @ queries  # [D, D]
    w, a = sketch_maps(k2, q2, D)
    assert torch.allclose(a @ w.T, torch.eye(D, dtype=torch.float64), atol=1e-8)
    w, a = sketch_maps(k2, torch.zeros(D, D, dtype=torch.float64), r)
    top = torch.linalg.eigh(k2).eigenvectors[:, -r:]  # [D, r]
    assert torch.allclose(a @ w.T, top @ top.T, atol=1e-8)
    w, a = sketch_maps(k2, q2, r, shrink=1.0)
    assert torch.allclose(a @ w.T, top @ top.T, atol=1e-8)
    err = lambda form: ((queries[:500] @ (torch.eye(D, dtype=torch.float64) - form) @ keys[:500].T) ** 2).mean()
    errs = [err(a @ w.T) for w, a in (sketch_maps(k2, q2, r, shrink=x) for x in (0.0, 0.5, 0.9))]
    assert errs[0] < 0.5 * err(top @ top.T)
    assert errs[0] <= errs[1] <= errs[2] < err(top @ top.T)


def test_a_low_rank_sketch_keeps_the_logits_of_keys_of_that_rank():
    """r < D: keys of rank r (per kv head) give the logits of any query through the 8-bit sketch up to its levels'
    rounding, before the fit and after it alike (keys inside the fitted range); the fitted keys' largest components
    lie at :data:`KeyStats.SKETCH_LEVELS` / ``SKETCH_MARGIN``, and a later key past every level is clamped to the
    last one (not wrapped)."""
    n_pages, page, r = 6, 4, 3
    g = torch.Generator().manual_seed(10)
    keys = torch.einsum("snr,nrd->snd", torch.randn(n_pages * page, N_KV, r, generator=g),
                        torch.randn(N_KV, r, D, generator=g))  # [S, N_kv, D] of rank r per kv head
    stats = KeyStats(LAYOUT, n_pages, "cpu", sketch_rank=r)
    pids = torch.arange(n_pages).repeat_interleave(page)
    stats.add_queries(0, torch.randn(40, 2 * N_KV, D, generator=g))
    stats.add(0, pids[:12], keys[:12])
    stats.fit_sketch([(np.arange(3), [keys[:12]])])
    later = torch.cat([keys[:11].flip(0) * 0.9, keys[:1] * 1000])  # inside the fitted range, then far past it
    stats.add(0, pids[12:], later)
    sketch = stats.sketch[0, :n_pages].reshape(-1, N_KV, r)  # [S, N_kv, r]
    top = round(KeyStats.SKETCH_LEVELS / KeyStats.SKETCH_MARGIN)
    assert sketch.dtype == torch.int8 and ((sketch[:12].abs().amax(0) - top).abs() <= 1).all()
    assert (sketch[-1].abs() == KeyStats.SKETCH_LEVELS).any() and torch.equal(sketch[-1].sign(), sketch[0].sign())
    q = torch.randn(N_KV, D, generator=g)
    want = torch.einsum("nd,snd->sn", q, torch.cat([keys[:12], later[:11]]))  # [S - 1, N_kv]
    got = torch.einsum("nd,ndr,snr->sn", q, stats.query_map[0], sketch[:-1].float())
    assert torch.allclose(got, want, atol=0.03 * float(want.abs().max()))


def test_topk_sketch_in_the_engine_sketches_every_key_it_stores():
    """An engine with ``rank=sketch`` under a token budget: the maps are fitted at the first choice (from the prompt
    queries too), and after decode steps (pages on the device and the host) every stored key's sketch is its 8-bit
    levels through the key map."""
    from kvtier.budget import TokenBudget
    from kvtier.engine import Engine, EngineConfig
    from kvtier.models import kv_layout_for, tiny_llama
    from kvtier.scheduler.chunked_prefill import ChunkedPrefill
    from kvtier.scopes import TopK

    model = tiny_llama(seed=1)
    layout = kv_layout_for(model.config, page_size=8, dtype=torch.float32)
    engine = Engine(model, layout, [DeviceTier(layout, 40, device="cpu"), HostTier(layout, 64)],
                    H2O(sinks=4, window=8), TopK(rank="sketch", per_head=True, sketch_rank=5, unit="page"),
                    prefill=ChunkedPrefill(32), budget=TokenBudget(40, 4, 8, 8, "continuous"), exact_prefill=True,
                    config=EngineConfig(max_batch=2, max_context=160))
    for n, seed in ((70, 0), (45, 1)):
        engine.add(torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)))
    for _ in range(12):
        engine.step()
    stats = engine.keys
    assert stats.key_map is not None and stats.key_map.shape[-1] == 5 and stats.query_second.abs().sum() > 0
    for seq in engine.table.seqs:
        pids = torch.from_numpy(engine.table.pages(seq))
        n = engine.table.seq_len(seq)
        for layer, kv in enumerate(engine.read_sequence(seq, n)):
            tok = torch.arange(n)
            want = torch.einsum("snd,ndr->snr", kv[0].float(), stats.key_map[layer]).clamp(-127, 127)  # [S, N_kv, r]
            got = stats.sketch[layer, pids[tok // 8], tok % 8].float()
            assert (got - want).abs().max() <= 0.5 + 1e-3, (seq, layer)  # rounded to the levels


def test_topk_sketch_refuses_a_rank_past_the_head_dim_and_a_rank_without_the_sketch():
    from kvtier.budget import TokenBudget
    from kvtier.engine import Engine, EngineConfig
    from kvtier.models import kv_layout_for, tiny_llama
    from kvtier.scopes import TopK

    model = tiny_llama(seed=1)
    layout = kv_layout_for(model.config, page_size=8, dtype=torch.float32)
    with pytest.raises(ConfigError, match="scope.sketch_rank"):
        Engine(model, layout, [DeviceTier(layout, 40, device="cpu")], H2O(sinks=4, window=8),
               TopK(rank="sketch", sketch_rank=layout.head_dim + 1), budget=TokenBudget(40, 4, 8, 8, "continuous"),
               config=EngineConfig(max_context=64))
    with pytest.raises(ConfigError, match="scope.sketch_rank.*only rank 'sketch'"):
        TopK(rank="gauss", sketch_rank=8)


def test_read_only_pid_arrays_index_the_statistics_without_a_warning():
    """Pids handed over as a read-only array (a broadcast, a view of a frozen table) index the device statistics as
    a copy: no "non-writable" warning in a run's console, and the pages named are the ones reset."""
    import warnings

    stats = KeyStats(LAYOUT, 16, "cpu")
    stats.count[:] = 3.0
    pids = np.broadcast_to(np.array([2, 5]), (2,))  # read-only
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stats.on_append(pids)
    assert stats.count[:, [2, 5]].eq(0).all() and stats.count[:, [0, 1, 3, 4]].eq(3).all()
