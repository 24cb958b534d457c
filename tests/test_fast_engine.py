"""The fast decode path on the CPU (eager, the torch reference of the static kernel): exact against HF's
own attention with batched sequences of different lengths joining and finishing while pages move,
the top-k scope against the hook path's, and lookahead prefetch k steps ahead."""

import numpy as np
import pytest
import torch

from kvtier.cache import TieredKVCache
from kvtier.engine import Engine
from kvtier.errors import ConfigError
from kvtier.fast.engine import FastEngine
from kvtier.fast.scopes import resident_pages
from kvtier.models import kv_layout_for, tiny_llama
from kvtier.policies import LRU, SinkWindow
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.tiers import DeviceTier, DiskTier, HostTier


@pytest.fixture(scope="module")
def tiny():
    model = tiny_llama(seed=1)
    return model, kv_layout_for(model.config, page_size=8, dtype=torch.float32)


def hf_greedy(model, prompt, steps):
    """HF sdpa logits of the prompt's last position and ``steps`` greedy steps: ``[steps + 1, V]``."""
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        out = model(prompt[None], use_cache=True)
        past, logits = out.past_key_values, [out.logits[0, -1]]
        for _ in range(steps):
            out = model(logits[-1].argmax().view(1, 1), past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, logits + [out.logits[0, -1]]
    return torch.stack(logits)


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_batched_decode_matches_hf_while_sequences_join_finish_and_pages_move(tiny):
    model, layout = tiny
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in (37, 50, 21)]
    refs = [hf_greedy(model, p, 12) for p in prompts]
    tiers = [DeviceTier(layout, 16, device="cpu"), HostTier(layout, 200)]
    engine = FastEngine(model, layout, tiers, SinkWindow(sinks=4, window=16), max_batch=3, max_context=128,
                        prefill=ChunkedPrefill(16))
    got = {}
    for p in prompts[:2]:
        seq, logits = engine.add(p)
        got[seq] = [logits[-1]]
    for step in range(12):
        if step == 4:  # joins mid-run
            seq, logits = engine.add(prompts[2])
            got[seq] = [logits[-1]]
        logits = engine.step()
        for row, seq in enumerate(engine.row_seq[:logits.shape[0]]):
            if seq is not None:
                got[seq].append(logits[row].clone())
        if step == 8:  # finishes mid-run; its pages go back to the tiers
            engine.finish(0)
    for seq, ref in enumerate(refs):
        mine = torch.stack(got[seq])
        assert rel_err(mine, ref[:len(mine)]) < 1e-4
        assert torch.equal(mine.argmax(-1), ref[:len(mine)].argmax(-1))
    assert len(got[0]) == 10 and len(got[1]) == 13 and len(got[2]) == 9
    assert engine.transfer.pages_moved["device->host"] > 0 and engine.transfer.pages_moved["host->device"] > 0
    assert engine.stats.hit_rate() < 1  # some pages were read in place from host memory


@pytest.mark.parametrize("on_host", [False, True])
def test_prefill_on_a_shared_prefix_computes_its_tail_and_copies_no_device_page(tiny, on_host):
    """A prompt opened on another sequence's 4 full pages (a radix hit) computes only its last token: exact
    against HF over the whole prompt. Its attention reads device pages in place (no copy of the prefix);
    only a prefix with pages on the host is gathered into a temporary pool."""
    model, layout = tiny
    prompt = torch.randint(0, 256, (33,), generator=torch.Generator().manual_seed(3))
    ref = hf_greedy(model, prompt, 0)[0]
    engine = FastEngine(model, layout, [DeviceTier(layout, 16, device="cpu"), HostTier(layout, 16)], LRU(),
                        max_batch=2, max_context=64)
    first, _ = engine.add(prompt)
    prefix = engine.table.pages(first)[:4]  # tokens 0..31
    if on_host:
        engine.transfer.migrate_many([(layer, prefix, 1) for layer in range(layout.num_layers)])
    gathered = []
    gather = engine.transfer.gather
    engine.transfer.gather = lambda layer, pids, device: gathered.append(layer) or gather(layer, pids, device)
    seq = engine.open(33, prefix, 32)
    logits = engine.prefill_chunk(seq, prompt[32:])
    assert rel_err(logits[-1], ref) < 1e-4
    assert gathered == (list(range(layout.num_layers)) if on_host else [])
    model.set_attn_implementation("sdpa")


def test_fast_path_matches_hf_on_smollm2(smollm2):
    model, tok = smollm2
    layout = kv_layout_for(model.config, page_size=16, dtype=torch.float32)
    prompt = tok("The light of the sun is compounded of rays differently refrangible, and those rays which are "
                 "more refrangible than others are also more reflexible, as appears by experiments with prisms "
                 "and the colours of bodies seen through them", return_tensors="pt").input_ids[0]
    ref = hf_greedy(model, prompt, 6)
    tiers = [DeviceTier(layout, 3, device="cpu"), HostTier(layout, 16)]
    engine = FastEngine(model, layout, tiers, LRU(), max_context=128, prefill=ChunkedPrefill(32))
    got = [engine.add(prompt)[1][-1]] + [engine.step()[0].clone() for _ in range(6)]
    model.set_attn_implementation("sdpa")
    assert rel_err(torch.stack(got), ref) < 1e-4
    assert engine.table.occupancy()["host"][0] > 0 and engine.stats.hit_rate() < 1


def test_topk_scope_picks_the_pages_the_hook_path_picks(tiny):
    model, layout = tiny
    prompt = torch.randint(0, 256, (90,), generator=torch.Generator().manual_seed(3))
    hook = TieredKVCache(layout, [DeviceTier(layout, 64, device="cpu")], LRU(), scope="topk", topk_pages=4)
    engine = Engine(model, ChunkedPrefill(90))
    want = [engine.run_prefill(hook, prompt[None])[0, -1]]
    for _ in range(5):
        want.append(engine.decode_step(hook, want[-1].argmax().view(1, 1))[0])
    fast = FastEngine(model, layout, [DeviceTier(layout, 64, device="cpu")], LRU(), scope="topk", topk_pages=4,
                      max_context=128, prefill=ChunkedPrefill(90))
    got = [fast.add(prompt)[1][-1]] + [fast.step()[0].clone() for _ in range(5)]
    assert rel_err(torch.stack(got), torch.stack(want)) < 1e-4
    exact = hf_greedy(model, prompt, 5)
    assert rel_err(torch.stack(got)[1:], exact[1:]) > 1e-3  # 4 of 12 pages: really not exact


def test_resident_pages_lists_device_pages_and_the_tail():
    table = torch.tensor([[3, -1, 5, -2, 7], [-1, -1, -3, 2, -4]], dtype=torch.int32)
    got = resident_pages(table, torch.tensor([4, 3]))
    assert got.tolist() == [[0, -1, 2, -1, 4], [-1, -1, -1, 3, 4]]


@pytest.mark.parametrize("lookahead", [1, 2])
def test_lookahead_prefetches_picks_k_steps_ahead(tiny, lookahead):
    """A page top-k picked at step t is in the device table at step t + k, and not always before."""
    model, layout = tiny
    tiers = [DeviceTier(layout, 14, device="cpu"), HostTier(layout, 64)]
    engine = FastEngine(model, layout, tiers, LRU(), scope="topk", topk_pages=4, max_context=256,
                        lookahead=lookahead, prefill=ChunkedPrefill(64))
    engine.add(torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(5)))
    picks, tables = [], []
    for _ in range(24):
        engine.step()
        picks.append(engine.page_list[:, 0].clone().numpy())  # [L, K] what this step attended
        tables.append(engine.mirror[:, 0].copy())  # [L, M] the table this step read
    early = 0
    for t in range(len(picks) - lookahead):
        for layer in range(layout.num_layers):
            pages = picks[t][layer][picks[t][layer] >= 0]
            assert (tables[t + lookahead][layer, pages] >= 0).all()  # resident k steps later
            early += int((tables[t + lookahead - 1][layer, pages] < 0).any())
    assert early > 0  # some were promoted just in time: the check above is not vacuous


def test_lookahead_zero_feeds_nothing_back(tiny):
    """Without lookahead the picks never reach the policy: fewer attended pages are on the device."""
    model, layout = tiny
    rates = {}
    for k in (0, 2):
        tiers = [DeviceTier(layout, 14, device="cpu"), HostTier(layout, 64)]
        engine = FastEngine(model, layout, tiers, LRU(), scope="topk", topk_pages=4, max_context=256, lookahead=k,
                            prefill=ChunkedPrefill(64))
        engine.add(torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(5)))
        for _ in range(16):
            engine.step()
        rates[k] = engine.stats.hit_rate()
    assert rates[0] < rates[2]


def test_bad_setups_are_named(tiny, tmp_path):
    model, layout = tiny
    with pytest.raises(ConfigError, match="tiers"):
        FastEngine(model, layout, [DeviceTier(layout, 8, device="cpu"), DiskTier(layout, 8, tmp_path)], LRU())
    engine = FastEngine(model, layout, [DeviceTier(layout, 8, device="cpu")], LRU(), max_context=32)
    with pytest.raises(ConfigError, match="max_context"):
        engine.add(torch.zeros(40, dtype=torch.long))
    with pytest.raises(ConfigError, match="topk_pages"):
        FastEngine(model, layout, [DeviceTier(layout, 8, device="cpu")], LRU(), scope="topk")
    model.config.model_type = "gemma2"
    try:
        with pytest.raises(ConfigError, match="fast decode path"):
            FastEngine(model, layout, [DeviceTier(layout, 8, device="cpu")], LRU())
    finally:
        model.config.model_type = "llama"
    assert np.all(engine.mirror == engine.scratch[:, None, None])  # nothing was written by the refusals


def test_fast_path_honours_sliding_windows():
    """Mistral, every layer sliding (window 24), prompt and decode several windows long, pages moving."""
    from tests.test_sliding_window import build

    model = build("mistral")
    layout = kv_layout_for(model.config, page_size=8, dtype=torch.float32)
    assert layout.window(0) == 24
    prompt = torch.randint(0, model.config.vocab_size, (70,), generator=torch.Generator().manual_seed(2))
    ref = hf_greedy(model, prompt, 8)
    tiers = [DeviceTier(layout, 8, device="cpu"), HostTier(layout, 32)]
    engine = FastEngine(model, layout, tiers, LRU(), max_context=96, prefill=ChunkedPrefill(16))
    got = [engine.add(prompt)[1][-1]] + [engine.step()[0].clone() for _ in range(8)]
    assert rel_err(torch.stack(got), ref) < 1e-4
    assert engine.table.occupancy()["host"][0] > 0


def test_margin_prefetches_the_next_best_pages(tiny):
    """With a margin the policy hears the top (k + margin) pages: they are resident k steps later."""
    model, layout = tiny
    tiers = [DeviceTier(layout, 20, device="cpu"), HostTier(layout, 64)]
    engine = FastEngine(model, layout, tiers, LRU(), scope="topk", topk_pages=3, margin=3, max_context=256,
                        lookahead=1, prefill=ChunkedPrefill(64))
    engine.add(torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(5)))
    extra = 0
    for _ in range(12):
        engine.step()
        predicted, attended = engine.predicted[:, 0].clone().numpy(), engine.page_list[:, 0].clone().numpy()
        engine.step()
        for layer in range(layout.num_layers):
            assert set(attended[layer]) <= set(predicted[layer])
            pages = predicted[layer][predicted[layer] >= 0]
            assert (engine.mirror[layer, 0, pages] >= 0).all()  # the predictions are resident a step later
            extra += len(set(pages) - set(attended[layer]))
    assert extra > 0
    with pytest.raises(ConfigError, match="margin"):
        FastEngine(model, layout, [DeviceTier(layout, 8, device="cpu")], LRU(), scope="all", margin=2)


def test_recall_cache_changes_where_pages_are_read_not_what_is_attended(tiny):
    """topk with device-managed recall slots: the same logits as without them (same picks, read from
    HBM instead of host memory), more hits, and the host never promotes a pick."""
    model, layout = tiny
    prompt = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(6))
    runs = {}
    for slots in (0, 6):
        tiers = [DeviceTier(layout, 12 + slots, device="cpu"), HostTier(layout, 64)]
        engine = FastEngine(model, layout, tiers, SinkWindow(sinks=4, window=16), scope="topk", topk_pages=4,
                            max_context=256, lookahead=0, recall_slots=slots, prefill=ChunkedPrefill(64))
        engine.add(prompt)
        logits = [engine.step()[0].clone() for _ in range(16)]
        runs[slots] = (torch.stack(logits), engine.stats.hit_rate(), engine)
    assert rel_err(runs[6][0], runs[0][0]) < 1e-6
    assert runs[6][1] > runs[0][1]
    recall = runs[6][2].recall
    assert int(recall.copied) > 0
    with pytest.raises(ConfigError, match="recall_slots"):
        FastEngine(model, layout, [DeviceTier(layout, 8, device="cpu")], LRU(), scope="topk", topk_pages=2,
                   recall_slots=4)


@pytest.mark.parametrize("policy,hears", [(SinkWindow(sinks=4, window=16), False), (LRU(), True)])
def test_plans_only_when_the_policy_heard_something_or_room_is_short(tiny, policy, hears):
    """resident + lookahead: a policy that ignores accesses is told nothing and planned for only around new
    pages (room for them, their append); LRU hears the picks every step, so every step plans."""
    model, layout = tiny
    prompt = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(9))
    engine = FastEngine(model, layout, [DeviceTier(layout, 8, device="cpu"), HostTier(layout, 64)], policy,
                        scope="resident", lookahead=1, max_context=128, prefill=ChunkedPrefill(32))
    engine.add(prompt)
    plans, accesses = [], []
    real_plan, real_access = engine.scheduler.plan, policy.on_access
    engine.scheduler.plan = lambda *a, **k: plans.append(engine.step_idx) or real_plan(*a, **k)
    policy.on_access = lambda *a, **k: accesses.append(a) or real_access(*a, **k)
    for _ in range(3 * layout.page_size):
        engine.step()
    assert bool(accesses) == hears
    if hears:
        assert len(set(plans)) >= 3 * layout.page_size - 2
    else:  # plans around new pages (room for the next ones, the append's news), not every step
        assert 1 <= len(set(plans)) <= 3 * layout.page_size // 2
