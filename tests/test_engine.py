"""The engine on the CPU (eager, the torch reference of the static kernel): exact against HF's own attention
with batched sequences of different lengths joining and finishing while pages move, the top-k scope's picks
against Quest's bound computed from the stored keys, lookahead promotion of the picks, and the recall cache."""

import dataclasses

import numpy as np
import pytest
import torch

from kvtier.cache import TieredKVCache
from kvtier.engine import Engine, EngineConfig
from kvtier.errors import ConfigError
from kvtier.hook import use_hook
from kvtier.kernels.base import STAGED
from kvtier.models import kv_layout_for, tiny_llama
from kvtier.mover.paged_io import read_tokens
from kvtier.policies import LRU, SinkWindow
from kvtier.policies.base import PageInfo
from kvtier.scheduler.base import MigrationPlan
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.scopes import DROPPED, All, Resident, StepView, TopK
from kvtier.scopes.base import compact
from kvtier.scopes.recall import overlay_recall, plan_admission
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


def make(model, layout, tiers, policy, scope="all", chunk=64, **config):
    return Engine(model, layout, tiers, policy, scope, prefill=ChunkedPrefill(chunk), config=EngineConfig(**config))


def greedy(engine, prompt, steps):
    """Logits of the prompt's last position and ``steps`` decode steps of row 0: ``[steps + 1, V]``."""
    return torch.stack([engine.add(prompt)[1][-1]] + [engine.step()[0].clone() for _ in range(steps)])


def record_picks(engine):
    """Wrap the scope's ``pick``: per decode step, per layer ``(q, page list, table)`` of row 0."""
    steps, pick = [], engine.scope.pick

    def spy(layer, q, view):
        out = pick(layer, q, view)
        if layer == 0:
            steps.append([])
        steps[-1].append((q[0].clone(), None if out is None else out[0].clone(), view.table[layer, 0].clone()))
        return out

    engine.scope.pick = spy
    return steps


def test_batched_decode_matches_hf_while_sequences_join_finish_and_pages_move(tiny):
    model, layout = tiny
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in (37, 50, 21)]
    refs = [hf_greedy(model, p, 12) for p in prompts]
    tiers = [DeviceTier(layout, 16, device="cpu"), HostTier(layout, 200)]
    engine = make(model, layout, tiers, SinkWindow(sinks=4, window=16), chunk=16, max_batch=3, max_context=128)
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
    assert engine.hit_rate() < 1  # some pages were read in place from host memory


@pytest.mark.parametrize("on_host", [False, True])
def test_prefill_on_a_shared_prefix_computes_its_tail_and_copies_no_device_page(tiny, on_host):
    """A prompt opened on another sequence's 4 full pages (a radix hit) computes only its last token: exact
    against HF over the whole prompt. Its attention reads device pages in place (no copy of the prefix);
    only a prefix with pages on the host is gathered into a temporary pool, and only its host pages count as read
    over the link."""
    model, layout = tiny
    prompt = torch.randint(0, 256, (33,), generator=torch.Generator().manual_seed(3))
    ref = hf_greedy(model, prompt, 0)[0]
    engine = make(model, layout, [DeviceTier(layout, 16, device="cpu"), HostTier(layout, 16)], LRU(),
                  max_batch=2, max_context=64)
    first, _ = engine.add(prompt)
    prefix = engine.table.pages(first)[:4]  # tokens 0..31
    if on_host:
        L = layout.num_layers
        engine.transfer.migrate_many(np.repeat(np.arange(L), prefix.size), np.tile(prefix, L), 1)
        engine.transfer.synchronize()
    engine.scheduler.plan = lambda table, policy, step, reserve=0, ranking=None: MigrationPlan(step)  # the prefix stays put
    gathered = []
    gather = engine.transfer.gather
    engine.transfer.gather = lambda layer, pids, device: gathered.append(layer) or gather(layer, pids, device)
    fetched = dict(engine.stats.fetched_bytes)
    seq = engine.open(33, prefix, 32)
    logits = engine.prefill_chunk(seq, prompt[32:])
    assert rel_err(logits[-1], ref) < 1e-4
    assert gathered == (list(range(layout.num_layers)) if on_host else [])
    # the ledger counts the prefix's host pages; the chunk's own device page is copied within the device, not moved
    read = {k: v - fetched.get(k, 0) for k, v in engine.stats.fetched_bytes.items() if v != fetched.get(k, 0)}
    assert read == ({"host->device": layout.num_layers * prefix.size * layout.page_bytes} if on_host else {})


def test_engine_matches_hf_on_smollm2(smollm2):
    model, tok = smollm2
    layout = kv_layout_for(model.config, page_size=16, dtype=torch.float32)
    prompt = tok("The light of the sun is compounded of rays differently refrangible, and those rays which are "
                 "more refrangible than others are also more reflexible, as appears by experiments with prisms "
                 "and the colours of bodies seen through them", return_tensors="pt").input_ids[0]
    ref = hf_greedy(model, prompt, 6)
    tiers = [DeviceTier(layout, 3, device="cpu"), HostTier(layout, 16)]
    engine = make(model, layout, tiers, LRU(), chunk=32, max_context=128)
    got = greedy(engine, prompt, 6)
    model.set_attn_implementation("sdpa")
    assert rel_err(got, ref) < 1e-4
    assert engine.table.occupancy()["host"][0] > 0 and engine.hit_rate() < 1


def test_topk_picks_the_sinks_the_tail_and_the_best_quest_bounds(tiny):
    """topk(4): each decode step of each layer lists 4 pages: the sink page, the page being written and the 2
    pages with the largest Quest bound, computed here from the keys read back from the pages; the logits are not
    exact (4 of 12 pages), and a topk covering every page is."""
    model, layout = tiny
    prompt = torch.randint(0, 256, (90,), generator=torch.Generator().manual_seed(3))
    engine = make(model, layout, [DeviceTier(layout, 65, device="cpu")], LRU(), TopK(4, unit="page", rank="quest"), chunk=90,
                  max_context=128)
    steps = record_picks(engine)
    got = greedy(engine, prompt, 5)
    exact = hf_greedy(model, prompt, 5)
    assert rel_err(got[0], exact[0]) < 1e-4  # the prefill is exact
    assert rel_err(got[1:], exact[1:]) > 1e-3  # 4 of 12 pages: really not exact
    P, G = layout.page_size, model.config.num_attention_heads // layout.num_kv_heads
    assert len(steps) == 5
    for t, step in enumerate(steps):
        n = prompt.numel() + t + 1  # tokens incl. the one being written
        n_pages = -(-n // P)
        for layer, (q, picks, _) in enumerate(step):
            keys = read_tokens(engine.table, layer, engine.running[0])[0, :n - 1]  # [n - 1, N_kv, D] written before
            keys = torch.nn.functional.pad(keys, (0, 0, 0, 0, 0, n_pages * P - keys.shape[0]), value=float("nan"))
            pages = keys.view(n_pages, P, *keys.shape[1:])[:-1]  # full pages before the tail: [n_pages - 1, P, N_kv, D]
            kmin, kmax = pages.amin(1), pages.amax(1)  # [n_pages - 1, N_kv, D]
            qg = q.view(layout.num_kv_heads, G, -1)  # [N_kv, G, D]
            bound = torch.maximum(qg * kmin[:, :, None], qg * kmax[:, :, None]).sum(-1).flatten(1).amax(1)
            bound[0] = float("-inf")  # the sink page is forced in
            want = {0, n_pages - 1} | set(torch.topk(bound, 2).indices.tolist())  # 4 pages in all
            assert set(picks[picks >= 0].tolist()) == want, (t, layer)
    wide = make(model, layout, [DeviceTier(layout, 65, device="cpu")], LRU(), TopK(12, unit="page", rank="quest"), chunk=90,
                max_context=128)
    assert rel_err(greedy(wide, prompt, 5), exact) < 1e-4


def test_topk_wider_than_the_table_is_exact(tiny):
    """Sink pages + tail + pages beyond the table's width: every page is listed (exact), none cut."""
    model, layout = tiny
    prompt = torch.randint(0, 256, (90,), generator=torch.Generator().manual_seed(3))
    engine = make(model, layout, [DeviceTier(layout, 65, device="cpu")], LRU(), TopK(16), chunk=90, max_context=128)
    assert rel_err(greedy(engine, prompt, 3), hf_greedy(model, prompt, 3)) < 1e-4


def test_adapter_through_the_models_own_forward_matches_the_engine(tiny):
    """TieredKVCache (HF's forward, the attention hook) and Engine.step (the engine's runner) give the same
    logits with scope topk, and with scope all the logits of HF's own attention."""
    model, layout = tiny
    prompt = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(4))
    for scope, k in (("topk", 3), ("all", None)):
        engine = make(model, layout, [DeviceTier(layout, 33, device="cpu")], LRU(),
                      TopK(k) if k else All(), chunk=70, max_context=128)
        want = greedy(engine, prompt, 4)
        cache = TieredKVCache(layout, [DeviceTier(layout, 33, device="cpu")], LRU(), scope=scope, topk_pages=k)
        use_hook(model)
        try:
            with torch.no_grad():
                got = [model(input_ids=prompt[None], past_key_values=cache, use_cache=True).logits[0, -1]]
                for _ in range(4):
                    out = model(input_ids=got[-1].argmax().view(1, 1), past_key_values=cache, use_cache=True)
                    got.append(out.logits[0, -1])
                # a forward without the cache: refused by name, never attended over this cache's pages
                with pytest.raises(ConfigError, match="past_key_values=TieredKVCache"):
                    model(input_ids=got[-1].argmax().view(1, 1), use_cache=False)
            cache.close()
        finally:
            model.set_attn_implementation("sdpa")
        assert rel_err(torch.stack(got), want) < 1e-4, scope
        if scope == "all":
            assert rel_err(want, hf_greedy(model, prompt, 4)) < 1e-4


def test_resident_lists_device_pages_and_the_tail():
    table = torch.tensor([[[3, -1, 5, -2, 7], [-1, DROPPED, -3, 2, -4]]], dtype=torch.int32)  # [L=1, R=2, M=5]
    lens = torch.tensor([33, 25], dtype=torch.int32)  # 5 and 4 pages of 8; the tail: pages 4 and 3
    view = StepView(table, lens, torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, 5, dtype=torch.int32), None,
                    2, 8, None, False, 0, (0,))
    got = Resident().pick(0, torch.zeros(2, 1, 4), view)
    assert got.tolist() == [[0, 2, 4, -1, -1], [3, -1, -1, -1, -1]]


@pytest.mark.parametrize("lookahead", [1, 2])
def test_lookahead_promotes_picks_k_steps_ahead(tiny, lookahead):
    """LRU hears what top-k picked at step t before step t + k is planned: those pages are in the device
    table at step t + k, and not always before."""
    model, layout = tiny
    tiers = [DeviceTier(layout, 14, device="cpu"), HostTier(layout, 64)]
    engine = make(model, layout, tiers, LRU(), TopK(4, unit="page", rank="quest"), max_context=256,
                  lookahead=lookahead)
    steps = record_picks(engine)
    engine.add(torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(5)))
    for _ in range(24):
        engine.step()
    early = 0
    for t in range(len(steps) - lookahead):
        for layer in range(layout.num_layers):
            picks = steps[t][layer][1]
            pages = picks[picks >= 0].long()
            assert (steps[t + lookahead][layer][2][pages] >= 0).all(), (t, layer)  # resident k steps later
            early += int((steps[t + lookahead - 1][layer][2][pages] < 0).any())
    assert early > 0  # some were promoted just in time: the check above is not vacuous
    assert engine.hit_rate() < 1


def test_lookahead_zero_feeds_nothing_back(tiny):
    """lookahead 0 is refused for a policy that hears accesses; for one that hears nothing it changes nothing."""
    model, layout = tiny
    with pytest.raises(ConfigError, match="lookahead"):
        make(model, layout, [DeviceTier(layout, 14, device="cpu"), HostTier(layout, 64)], LRU(), TopK(4),
             lookahead=0)
    prompt = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(5))
    runs = {}
    for k in (0, 1):
        tiers = [DeviceTier(layout, 8, device="cpu"), HostTier(layout, 64)]
        engine = make(model, layout, tiers, SinkWindow(sinks=4, window=16), TopK(4), max_context=256, lookahead=k)
        runs[k] = (greedy(engine, prompt, 6), engine.hit_rate(), engine.transfer.pages_moved.copy())
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1:] == runs[1][1:]
    assert runs[0][1] < 1 and runs[0][2]["device->host"] > 0  # pages moved and were read from the host


def test_bad_setups_are_named(tiny):
    model, layout = tiny
    engine = make(model, layout, [DeviceTier(layout, 8, device="cpu")], LRU(), max_context=32)
    with pytest.raises(ConfigError, match="max_context"):
        engine.add(torch.zeros(40, dtype=torch.long))
    with pytest.raises(ConfigError, match="pages >= 1"):
        make(model, layout, [DeviceTier(layout, 8, device="cpu")], LRU(), "topk")
    with pytest.raises(ConfigError, match="recall_slots"):
        make(model, layout, [DeviceTier(layout, 8, device="cpu")], LRU(), TopK(2, recall_slots=4))
    with pytest.raises(ConfigError, match="scope"):
        make(model, layout, [DeviceTier(layout, 8, device="cpu")], LRU(), "nearest")
    with pytest.raises(ConfigError, match="dense_layers"):
        Engine(model, layout, [DeviceTier(layout, 8, device="cpu")], LRU(), dense_layers=layout.num_layers + 1)
    with pytest.raises(ConfigError, match="max_batch"):
        EngineConfig(max_batch=0)
    assert np.all(engine.plan.table == engine.planner.scratch[:, None, None])  # nothing was written by the refusals


def test_engine_honours_sliding_windows():
    """Mistral, every layer sliding (window 24), prompt and decode several windows long, pages moving."""
    from tests.test_sliding_window import build

    model = build("mistral")
    layout = kv_layout_for(model.config, page_size=8, dtype=torch.float32)
    assert layout.window(0) == 24
    prompt = torch.randint(0, model.config.vocab_size, (70,), generator=torch.Generator().manual_seed(2))
    ref = hf_greedy(model, prompt, 8)
    tiers = [DeviceTier(layout, 4, device="cpu"), HostTier(layout, 32)]
    engine = make(model, layout, tiers, LRU(), chunk=16, max_context=96)
    got = greedy(engine, prompt, 8)
    assert rel_err(got, ref) < 1e-4
    assert engine.stats.dropped_pages > 0 and engine.transfer.pages_moved["device->host"] > 0


def test_compact_lists_the_kept_pages_in_page_order():
    """``compact`` (a prefix sum and a scatter) against a list built page by page: rows with none, some and every
    page kept, with leading dims."""
    g = torch.Generator().manual_seed(3)
    for shape in [(4, 1), (3, 37), (2, 5, 64)]:
        for p in (0.0, 0.3, 1.0):
            keep = torch.rand(shape, generator=g) < p
            want = [[m for m in range(shape[-1]) if row[m]] for row in keep.reshape(-1, shape[-1]).tolist()]
            want = torch.tensor([w + [-1] * (shape[-1] - len(w)) for w in want], dtype=torch.int32).view(shape)
            assert torch.equal(compact(keep), want)


def _slot_index(slots: torch.Tensor, capacity: int = 128) -> torch.Tensor:
    """``[1, capacity]``: each device slot's recall-slot index, -1 none."""
    return torch.full((1, capacity), -1).scatter(1, slots, torch.arange(slots.shape[1])[None])


def test_the_overlay_points_cached_pages_at_their_slots_and_empties_the_stale():
    """Five recall slots of one layer over two rows of four pages: pages still on the host are read from their slots;
    a slot whose page went home to the device, was dropped for good or belongs to a row outside the bucket is
    emptied, and the table keeps the host's placement there."""
    D = DROPPED
    home = torch.tensor([[[-2, 5, D, -4], [-1, -3, 6, -5]]], dtype=torch.int32)  # [L=1, B=2, M=4]
    page = torch.tensor([[0, 2, 1, 5, 8]])  # row * M + logical; 8: a third row, idle in this bucket
    table = torch.zeros_like(home)
    overlay_recall(home, table, page, torch.tensor([[100, 101, 102, 103, 104]]))
    assert table.tolist() == [[[100, 5, D, -4], [-1, 103, 6, -5]]] and page.tolist() == [[0, -1, -1, 5, -1]]


def test_recall_admission_takes_the_least_recently_picked_slots():
    """One layer's admission at step 8, four slots last picked at steps 5, 2, 5 and 5: a pick already cached is
    refreshed and not copied; two picks at home on the host take the oldest slot (stamp 2), then the lowest of the
    equal stamps 5; a pick on the device takes none."""
    table = torch.tensor([[[7, -3, -5, 100, 0, 0, 0, 0]]], dtype=torch.int32)  # device slots; host slot h as -h - 1
    page = torch.tensor([[3, 9, 6, 5]])  # cached pages (row * M + logical): slot 100 holds logical 3
    stamp = torch.tensor([[5, 2, 5, 5]])
    slots, copied = torch.tensor([[100, 101, 102, 103]]), torch.zeros((), dtype=torch.int64)
    picks = torch.tensor([[[3, 1, 2, 0]]], dtype=torch.int32)  # 3: cached (the overlay pointed it at slot 100)
    ahead, predicted = torch.tensor([[True, False, False, True]]), torch.zeros((), dtype=torch.int64)
    before = table.clone()
    src, dst = plan_admission(picks, table, None, page, stamp, slots, _slot_index(slots), torch.tensor([99]),
                              torch.tensor(8), copied, ahead, predicted, False)
    assert src.tolist() == [[-1, 2, 4, -1]] and dst.tolist() == [[99, 101, 102, 99]]  # host slots 2 and 4
    assert page.tolist() == [[3, 1, 2, 5]] and stamp.tolist() == [[8, 8, 8, 5]] and int(copied) == 2
    assert int(predicted) == 1 and not ahead.any()  # slot 100 was filled ahead and picked; slot 103 was not picked
    assert torch.equal(table, before)  # after the read: the next step's overlay points the table


def test_a_staged_disk_page_is_not_admitted():
    """A pick staged from disk for the step (table ``-(STAGED + slot)``) is not in the host pool: it takes no slot
    and nothing is copied for it, beside a host pick that is admitted."""
    table = torch.tensor([[[7, -(STAGED + 3), -5, 0]]], dtype=torch.int32)
    page, stamp, slots = torch.tensor([[-1, -1]]), torch.tensor([[-1, -1]]), torch.tensor([[100, 101]])
    copied, predicted = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    src, dst = plan_admission(torch.tensor([[[1, 2]]], dtype=torch.int32), table, None, page, stamp, slots,
                              _slot_index(slots), torch.tensor([99]), torch.tensor(8), copied,
                              torch.zeros(1, 2, dtype=torch.bool), predicted, False)
    assert src.tolist() == [[-1, 4]] and dst.tolist() == [[99, 100]] and page.tolist() == [[2, -1]]
    assert int(copied) == 1


def test_a_miss_that_landed_swaps_its_landing_slot_with_its_victims():
    """The admission of the test above with landing slots: logical 1 landed in its row's landing slot 1 (slot 201),
    logical 2 did not (more host pages than landing slots). Logical 1's victim slot takes device slot 201 (nothing
    copied) and its old slot 101 becomes the row's landing slot 1; logical 2 is copied from the host as before."""
    table = torch.tensor([[[7, -3, -5, 100, 0, 0, 0, 0]]], dtype=torch.int32)
    page, stamp = torch.tensor([[3, 9, 6, 5]]), torch.tensor([[5, 2, 5, 5]])
    slots = torch.tensor([[100, 101, 102, 103]])
    index = _slot_index(slots, 256)
    copied, landed, predicted = (torch.zeros((), dtype=torch.int64) for _ in range(3))
    picks = torch.tensor([[[3, 1, 2, 0]]], dtype=torch.int32)
    land = torch.tensor([[[200, 201]]])  # [L=1, R=1, n=2] the row's landing slots
    land_index = torch.tensor([[[-1, 1, -1, -1]]], dtype=torch.int32)  # each pick's landing slot, -1 none
    src, dst = plan_admission(picks, table, None, page, stamp, slots, index, torch.tensor([99]), torch.tensor(8),
                              copied, torch.zeros(1, 4, dtype=torch.bool), predicted, False, land_index, land, landed)
    assert src.tolist() == [[-1, -1, 4, -1]] and dst.tolist() == [[99, 101, 102, 99]]  # only logical 2 copied
    assert int(copied) == 1 and int(landed) == 1
    assert page.tolist() == [[3, 1, 2, 5]] and stamp.tolist() == [[8, 8, 8, 5]]
    assert slots.tolist() == [[100, 201, 102, 103]] and land.tolist() == [[[200, 101]]]
    assert index[0, 201] == 1 and index[0, 101] == -1 and index[0, [100, 102, 103]].tolist() == [0, 2, 3]
    assert (index >= 0).sum() == 4


def test_a_prediction_is_admitted_ahead_and_counted_when_picked():
    """Step 8: the prediction (logical 1 and 2, on the host) fills the two oldest slots, marked ahead and stamped
    this step, and the table points at them (the evicted logical 4, cached in slot 103, back at home on the host);
    the layer then picks 2 and 6: 2 is a hit counted as predicted, 6 (on the host) cannot evict this step's slots and
    stays a miss read in place."""
    home = torch.tensor([[[7, -3, -5, -2, -7, 0, -9, 0]]], dtype=torch.int32)
    table = torch.tensor([[[7, -3, -5, 100, 103, 0, -9, 0]]], dtype=torch.int32)  # the step's overlay
    page, stamp = torch.tensor([[3, 9, 6, 4]]), torch.tensor([[5, 2, 5, 4]])
    slots, scratch, step = torch.tensor([[100, 101, 102, 103]]), torch.tensor([99]), torch.tensor(8)
    copied, prefetched, predicted = (torch.zeros((), dtype=torch.int64) for _ in range(3))
    ahead = torch.zeros(1, 4, dtype=torch.bool)
    index = _slot_index(slots)
    src, dst = plan_admission(torch.tensor([[[1, 2]]], dtype=torch.int32), table, home, page, stamp, slots, index,
                              scratch, step, prefetched, ahead, predicted, True)
    assert src.tolist() == [[2, 4]] and dst.tolist() == [[101, 103]] and int(prefetched) == 2
    assert page.tolist() == [[3, 1, 6, 2]] and ahead.tolist() == [[False, True, False, True]]
    assert table.tolist() == [[[7, 101, 103, 100, -7, 0, -9, 0]]]
    stamp[0, [0, 2]] = 8  # this step's other picks hold the remaining slots
    src, dst = plan_admission(torch.tensor([[[2, 6]]], dtype=torch.int32), table, None, page, stamp, slots, index,
                              scratch, step, copied, ahead, predicted, False)
    assert src.tolist() == [[-1, -1]] and int(copied) == 0 and int(predicted) == 1 and not ahead.any()


def test_recall_admission_of_a_group_equals_each_layer_alone():
    """Fresh random tables, caches and picks of three layers and two rows: the admission of the group in one call
    equals the admissions of its layers one by one (what changes, what is copied)."""
    g = torch.Generator().manual_seed(5)
    L, B, M, C, K = 3, 2, 12, 5, 4
    for trial in range(20):
        slots = torch.stack([torch.randperm(40, generator=g)[:C] + 50 for _ in range(L)])  # [L, C] device slots
        page = torch.full((L, C), -1)
        table = -torch.randint(1, 30, (L, B, M), generator=g, dtype=torch.int32)  # at home on the host
        for layer in range(L):  # some pages cached, the table pointing at their slots
            for c in torch.randperm(C, generator=g)[:3].tolist():
                key = int(torch.randint(0, B * M, (1,), generator=g))
                if (page[layer] == key).any():
                    continue
                page[layer, c] = key
                table.view(L, -1)[layer, key] = int(slots[layer, c])
        table.view(L, -1)[torch.rand(L, B * M, generator=g) < 0.2] = 7  # some on the device
        stamp = torch.randint(0, 8, (L, C), generator=g)
        picks = torch.stack([torch.stack([torch.randperm(M, generator=g)[:K] for _ in range(B)]) for _ in range(L)])
        picks[torch.rand(L, B, K, generator=g) < 0.2] = -1
        ahead = torch.rand(L, C, generator=g) < 0.3
        step = torch.tensor(8)
        index = torch.full((L, 128), -1).scatter(1, slots, torch.arange(C).expand(L, C))
        state = [t.clone() for t in (page, stamp, ahead)]
        counts = [torch.zeros((), dtype=torch.int64) for _ in range(2)]
        src, dst = plan_admission(picks.int(), table, None, *state[:2], slots, index, torch.full((L,), 99), step,
                                  counts[0], state[2], counts[1], False)
        for layer in range(L):
            one = [t[layer:layer + 1].clone() for t in (page, stamp, ahead)]
            c1 = [torch.zeros((), dtype=torch.int64) for _ in range(2)]
            s1, d1 = plan_admission(picks[layer:layer + 1].int(), table[layer:layer + 1], None, *one[:2],
                                    slots[layer:layer + 1], index[layer:layer + 1], torch.tensor([99]), step, c1[0],
                                    one[2], c1[1], False)
            assert torch.equal(s1[0], src[layer]) and torch.equal(d1[0], dst[layer]), trial
            assert all(torch.equal(a[0], b[layer]) for a, b in zip(one, state)), trial
            counts[0] -= c1[0]
            counts[1] -= c1[1]
        assert int(counts[0]) == 0 and int(counts[1]) == 0


def test_recall_cache_changes_where_pages_are_read_not_what_is_attended(tiny, tmp_path):
    """topk with device-managed recall slots (device + host tiers, CPU; and + disk, whose staged pages are not
    admitted), with and without landing slots: the same tokens and logits as without them (same picks, read from
    the device instead of host memory) and more hits; with landing slots the pages read from the host are admitted
    from where the decode wrote them, not copied from the host again."""
    model, layout = tiny
    prompt = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(6))
    runs = {}
    for slots, land, disk in ((0, 0, False), (6, 0, False), (6, 2, False), (6, 2, True)):
        tiers = [DeviceTier(layout, 12 + slots + land, device="cpu"), HostTier(layout, 8 if disk else 64)]
        tiers += [DiskTier(layout, 64, tmp_path / "disk")] if disk else []  # most pages staged from disk
        engine = make(model, layout, tiers, SinkWindow(sinks=4, window=16),
                      TopK(4, recall_slots=slots, landing_slots=land, unit="page", rank="quest"), max_context=256)
        runs[slots, land, disk] = (greedy(engine, prompt, 16), engine.hit_rate(), engine)
    assert runs[6, 2, True][2].stats.fetched_bytes["disk->staging"] > 0
    for key in ((6, 0, False), (6, 2, False), (6, 2, True)):
        assert torch.equal(runs[key][0].argmax(-1), runs[0, 0, False][0].argmax(-1))
        assert rel_err(runs[key][0], runs[0, 0, False][0]) < 1e-6
        assert runs[key][1] > runs[0, 0, False][1]
        assert runs[key][2].buffers.block_table is not runs[key][2].buffers.home  # the overlay never writes the host's copy
    plain, landed = runs[6, 0, False][2].recall, runs[6, 2, False][2].recall
    assert int(plain.copied) > 0 and int(plain.landed) == 0
    assert int(landed.landed) > 0 and int(landed.copied) < int(plain.copied)
    assert int(landed.landed) + int(landed.copied) == int(plain.copied)  # the same admissions, fewer copies
    with pytest.raises(ConfigError, match="scope.landing_slots.*recall_slots"):
        TopK(4, landing_slots=2, unit="page", rank="quest")


@pytest.mark.parametrize("policy,hears", [(SinkWindow(sinks=4, window=16), False), (LRU(), True)])
def test_the_policy_hears_accesses_only_when_it_listens(tiny, policy, hears):
    """scope resident: a policy that ignores accesses is told none; LRU hears the picks every step."""
    model, layout = tiny
    prompt = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(9))
    engine = make(model, layout, [DeviceTier(layout, 8, device="cpu"), HostTier(layout, 64)], policy, "resident",
                  chunk=32, max_context=128)
    engine.add(prompt)
    steps = []
    real_access = policy.on_access
    policy.on_access = lambda layer, pids, step: steps.append(step) or real_access(layer, pids, step)
    try:
        for _ in range(2 * layout.page_size):
            engine.step()
    finally:
        del policy.on_access
    assert bool(steps) == hears
    if hears:
        assert len(set(steps)) >= 2 * layout.page_size - 1


def test_pages_attended_are_each_listed_page_once_in_row_layer_page_order(tiny):
    """The feedback's attended pages from per-head page lists: every listed live page of a (row, layer) once (heads
    that list the same page, padding -1 and pages past the row's end left out), sorted by row, layer, page."""
    model, layout = tiny
    engine = make(model, layout, [DeviceTier(layout, 40, device="cpu")], LRU(), max_batch=3, max_context=128)
    rng = np.random.default_rng(4)
    L, R, M = 3, 3, 10
    lists = rng.integers(-1, M + 2, size=(L, R, layout.num_kv_heads * 4))  # [L', R, G * K], repeats across heads
    n_pages = np.array([10, 4, 7])
    row, at, logical = engine.feedback._attended(np.arange(L), np.zeros((R, M), dtype=np.int64), n_pages,
                                                 n_pages * layout.page_size, lists)
    want = sorted({(r, li, int(p)) for li in range(L) for r in range(R) for p in lists[li, r] if 0 <= p < n_pages[r]})
    assert list(zip(row.tolist(), at.tolist(), logical.tolist())) == want


def test_every_page_of_every_layer_is_heard_in_one_call_as_page_by_page(tiny):
    """Scope ``all`` without sliding windows: LRU hears each step's pages for every layer at once
    (``layer=slice(None)``) and ends in the state the per-(layer, page) feed gives."""
    model, layout = tiny
    states, calls = [], []
    for every_layer_at_once in (True, False):
        policy = LRU()
        engine = make(model, layout, [DeviceTier(layout, 40, device="cpu"), HostTier(layout, 64)], policy,
                      chunk=32, max_batch=2, max_context=128)
        engine.feedback._all_pages_every_layer = every_layer_at_once
        real_access = policy.on_access
        policy.on_access = lambda layer, pids, step: calls.append(type(layer)) or real_access(layer, pids, step)
        for n, seed in ((70, 0), (45, 1)):
            engine.add(torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)))
        for _ in range(2 * layout.page_size):
            engine.step()
        del policy.on_access
        states.append(policy.last_access(np.arange(engine.table.ref.size)))  # [L, every pid]
    assert slice in calls and np.ndarray in calls  # both forms ran
    assert np.array_equal(states[0], states[1])


def test_a_decoding_row_whose_last_page_is_shared_writes_a_copy(tiny):
    """Copy-on-write under decode: a sequence shares its partly filled last page with a fork; the row's next write
    goes to its private copy (the block table and the engine's mirror point at it), the fork keeps its tokens, and the
    row's logits are those of a run without the fork."""
    model, layout = tiny
    prompt = torch.randint(0, 256, (45,), generator=torch.Generator().manual_seed(11))
    runs = []
    for fork in (False, True):
        engine = make(model, layout, [DeviceTier(layout, 40, device="cpu"), HostTier(layout, 64)], LRU(),
                      max_context=128)
        engine.add(prompt)
        engine.step()
        seq = engine.row_seq[0]
        if fork:
            engine.table.fork(seq, 999)  # 46 tokens: the last page holds 6 of 8
            before = read_tokens(engine.table, 0, 999)
        logits = torch.stack([engine.step()[0].clone() for _ in range(4)])
        if fork:
            assert torch.equal(read_tokens(engine.table, 0, 999), before)
            last = engine.table.pages(seq)[-2]  # the copied page (a page was appended after it)
            assert last not in engine.table.pages(999) and engine.plan.pids[0, 5] == last
        runs.append(logits)
    assert torch.equal(runs[0], runs[1])


def test_a_host_running_ahead_reserves_the_pages_its_next_steps_append(tiny):
    """With lookahead 2 each plan keeps device room for the pages the rows append in the next steps
    (lengths counted in pages, a full page included), so a growing row never needs a plan of its own."""
    model, layout = tiny
    P = layout.page_size
    total = 2 * layout.pages_for(7 * P + 16)
    engine = make(model, layout, [DeviceTier(layout, 10, device="cpu"), HostTier(layout, total)], SinkWindow(4, 8),
                  "resident", max_batch=2, lookahead=2)
    for seed in (0, 1):  # both rows end on a page boundary (the device full): their next token opens a page
        engine.add(torch.randint(0, 256, (5 * P,), generator=torch.Generator().manual_seed(seed)))
    planned = []
    schedule = engine.planner.move
    engine.planner.move = lambda reserve, after_compute: planned.append(after_compute) or schedule(reserve, after_compute)
    for _ in range(2 * P):
        engine.step()
    # one plan per step, none forced by a row's growth; the first step's copies wait for the prefill's writes
    assert planned == [True] + [False] * (2 * P - 1)


@pytest.mark.parametrize("scope,mode", [("resident", "continuous"), ("all", "once")])
def test_a_layer_group_is_planned_as_each_of_its_layers_alone(tiny, scope, mode):
    """A query-free scope plans a group of layers in one batch of device ops: the same lists as planning each
    layer alone (tables and policy ranks differ per layer: pages of one layer live on the host)."""
    from kvtier.budget import TokenBudget
    from kvtier.policies import H2O

    model, layout = tiny
    budget = TokenBudget(40, 4, 8, layout.page_size, mode)
    engine = Engine(model, layout, [DeviceTier(layout, 12, device="cpu"), HostTier(layout, 64)], H2O(sinks=4, window=8),
                    scope, prefill=ChunkedPrefill(32), budget=budget, config=EngineConfig(max_batch=2))
    for n, seed in ((70, 0), (45, 1)):
        engine.add(torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)))
    for _ in range(3):
        engine.step()
    engine.begin_decode()
    view = engine.callbacks.view(2)
    table = view.table.clone()  # layer 1: its first device pages read from the host, its priorities reversed
    table[1, :, :3] = torch.where(table[1, :, :3] >= 0, -table[1, :, :3] - 1, table[1, :, :3])
    priority = None if view.priority is None else view.priority.clone()
    if priority is not None:
        priority[1] = -priority[1]
    view = dataclasses.replace(view, table=table, priority=priority)
    group = engine.scope.plan(range(layout.num_layers), view)  # [L, B, K]
    alone = torch.cat([engine.scope.plan(range(layer, layer + 1), view) for layer in range(layout.num_layers)])
    assert torch.equal(group, alone) and (group >= 0).any()
    assert scope == "all" or not torch.equal(group[0], group[1])  # the layers' lists differ


def test_a_step_that_fails_mid_forward_leaves_nothing_to_the_next(tiny):
    """An error inside a decode step (here at layer 1) leaves no planned lists or statistics behind: the next
    step plans again, and layer 0 attends the page holding its newest token."""
    model, layout = tiny
    engine = make(model, layout, [DeviceTier(layout, 32, device="cpu")], LRU(), "resident")
    engine.add(torch.randint(0, 256, (2 * layout.page_size - 1,), generator=torch.Generator().manual_seed(3)))
    attend, failed = engine.attend, []

    def fail_once(layer, query, scaling=None):
        if layer == 1 and not failed:
            failed.append(layer)
            raise RuntimeError("injected")
        return attend(layer, query, scaling)

    engine.attend = fail_once
    engine.kv.attend = fail_once
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    engine.step()
    newest = (int(engine.plan.lens[0]) - 1) // layout.page_size
    assert newest == 2 and newest in engine.feedback._bufs(engine.max_pages, False)["picks"][0, 0].tolist()


def test_idle_rows_of_a_bucket_add_no_keys(tiny):
    """A row that is prefilling (or free) sits in the decode bucket; its key statistics stay untouched."""
    from kvtier.policies import Knorm

    model, layout = tiny
    engine = make(model, layout, [DeviceTier(layout, 32, device="cpu")], Knorm(), "all", max_batch=2)
    engine.add(torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(4)))
    waiting = engine.open(12)
    engine.prefill_chunk(waiting, torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(5)))
    first = int(engine.table.pages(waiting)[0])
    before = engine.keys.count[:, first].clone()
    engine.step()
    assert torch.equal(engine.keys.count[:, first], before) and before.min() == 8


@pytest.mark.parametrize("name, asks", [("h2o", 1), ("aspe", 2)])
def test_one_ranking_per_step_serves_the_plan_and_the_device_table(tiny, name, asks):
    """A decode step asks the policy for its ranking once: the placement plan's ranking also fills the scopes'
    device priority table (twice for ASPE, whose priority a new step changes: its salience history turns). The
    table holds, for every page the budget ranks, what the policy says when the step is planned."""
    from kvtier.budget import TokenBudget
    from kvtier.policies import POLICIES

    model, layout = tiny
    policy = POLICIES[name](sinks=4, window=8)
    budget = TokenBudget(40, 4, 8, layout.page_size)
    engine = Engine(model, layout, [DeviceTier(layout, 12, device="cpu"), HostTier(layout, 64)], policy, "resident",
                    prefill=ChunkedPrefill(32), budget=budget, config=EngineConfig(max_context=160))
    seq, _ = engine.add(torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(3)))
    calls, real = [], policy.ranked
    policy.ranked = lambda info: calls.append(info.step) or real(info)
    try:
        for _ in range(2 * layout.page_size):
            before = len(calls)
            engine.step()
            assert len(calls) - before == asks
            view = budget.view(engine.table.seq_len(seq))
            middle = engine.table.pages(seq)[view.cand_lo:view.cand_hi]  # the pages the budget ranks
            fresh = engine.planner.priority()[:, middle]
            assert np.isfinite(fresh).all()
            assert np.array_equal(engine.buffers.priority[:, middle].numpy(), fresh)
    finally:
        del policy.ranked


def test_attention_statistics_of_a_step_equal_a_loop_over_its_page_lists():
    """``AttentionStats.add_step`` (the captured step's update, by pid) equals summing each listed page's mass by hand:
    shared lists give a page every head's mass, per-kv-head lists head g's own; idle rows and -1 entries add nothing;
    the ring keeps the last ``rows`` steps and the window their sum; a snapshot shown later reads as it was, a pid
    appended after it reads 0."""
    from kvtier.stats import AttentionStats

    rng = np.random.default_rng(3)
    L, N, B, M, cap, rows = 3, 2, 3, 6, 32, 2
    stats = AttentionStats(L, cap, N, rows, {"total", "last", "window"}, "cpu", slots=2)
    pid_table = torch.from_numpy(rng.permutation(cap)[:B * M].reshape(B, M)).int()  # [B, M]
    live = torch.tensor([True, False, True])
    total = np.zeros((cap, L, N))
    steps = []
    for step, G in enumerate([1, N, 1, N]):
        K = 4
        logical = torch.from_numpy(np.stack([[[rng.permutation(M)[:K] for _ in range(G)] for _ in range(B)]
                                             for _ in range(L)])).int()  # [L, B, G, K] distinct pages per list
        logical[0, 0, 0, 1] = -1
        mass = torch.from_numpy(rng.random((L, B, K, N)))  # [L, B, K, N]
        stats.add_step(range(L), logical, pid_table, mass, live)
        row = np.zeros((cap, L, N))
        for layer, b, g, k in np.ndindex(L, B, G, K):
            page = int(logical[layer, b, g, k])
            if page < 0 or not live[b]:
                continue
            heads = range(N) if G == 1 else [g]
            for h in heads:
                row[int(pid_table[b, page]), layer, h] += float(mass[layer, b, k, h])
        total += row
        steps.append(row)
    stats.snapshot(0, cap)
    stats.show(0, step=3)
    seen = stats.read()
    np.testing.assert_allclose(seen["total"], total.transpose(1, 0, 2), rtol=1e-6)
    np.testing.assert_allclose(seen["last"], steps[-1].transpose(1, 0, 2), rtol=1e-6)
    np.testing.assert_allclose(seen["window"], sum(steps[-rows:]).transpose(1, 0, 2), rtol=1e-6)
    fresh = pid_table[0, :2].numpy().astype(np.int64)
    stats.on_append(fresh, step=4)
    stats.snapshot(1, cap)  # taken after the append: the device forgot them too
    stats.show(0, step=3)  # the older snapshot shown again: the fresh pids still read 0
    assert not stats.read()["total"][:, fresh].any()
    np.testing.assert_allclose(np.delete(stats.read()["total"], fresh, 1),
                               np.delete(total.transpose(1, 0, 2), fresh, 1), rtol=1e-6)


def scored_run(model, layout, policy, tiers, prompt: int, steps: int, seed: int, **engine_args):
    """An engine ranked by ``policy``: a random prompt of ``prompt`` tokens in chunks of 16, ``steps`` decode steps,
    every step's feedback taken; ``(engine, the sequence's pids)``."""
    engine = Engine(model, layout, tiers, policy, prefill=ChunkedPrefill(16), **engine_args)
    engine.add(torch.randint(0, 256, (prompt,), generator=torch.Generator().manual_seed(seed)))
    for _ in range(steps):
        engine.step()
    engine.feedback.take(upto=engine.step_idx)
    return engine, engine.table.pages(0)


def all_candidates(policy, pids: np.ndarray):
    """The scorer's view of pages ``pids``, every one a candidate."""
    return policy.store.stats(PageInfo(pids, np.zeros(pids.size, np.int64), np.ones(pids.size, np.int64), 1, 0))


@pytest.mark.parametrize("policy_name", ["knorm", "quest", "expected_attention"])
def test_a_device_scorer_ranks_from_the_feedbacks_snapshot_of_its_scores(tiny, policy_name):
    """A scorer that scores on the device (Knorm, Quest, Expected Attention) is scored by the engine after each step;
    the host ranks from a snapshot under the lookahead bound, which once the engine has waited for every step equals
    the scores of the live statistics; a page appended after the shown step reads the lowest score (not yet scored),
    until a later snapshot is shown."""
    from kvtier.policies import POLICIES

    model, layout = tiny
    policy = POLICIES[policy_name](sinks=4, window=8)
    engine, pids = scored_run(model, layout, policy, [DeviceTier(layout, 64, device="cpu"), HostTier(layout, 64)],
                              prompt=40, steps=5, seed=4, scope=Resident())
    assert len(engine.scores) == 1 and engine.scores[0] in engine.feedback.snapshotted
    got = all_candidates(policy, pids)
    live = policy.scorer.score_device(engine.keys, engine.queries, engine.keys.count.shape[1])[:, pids]  # [L, n]
    assert np.isfinite(got.device_score).all() and live.abs().sum() > 0
    np.testing.assert_allclose(got.device_score, live.double().numpy(), rtol=1e-6)
    policy.on_append(pids[-1:], engine.step_idx + 1)  # as a page appended after the shown step
    fresh = all_candidates(policy, pids)
    assert (fresh.device_score[:, -1] == np.finfo(np.float64).min).all()
    np.testing.assert_allclose(fresh.device_score[:, :-1], got.device_score[:, :-1])


def test_a_scorers_key_statistics_are_those_of_the_pages_keys(tiny):
    """What a scorer reads of the keys (``key_mean``, ``key_sq_mean``, ``key_bounds``; docs/policies.md) equals the
    statistics of the keys each page holds, over its written tokens, after prefill chunks and decode steps."""
    from kvtier.policies import POLICIES

    model, layout = tiny
    policy = POLICIES["quest"](sinks=4, window=8)
    engine, pids = scored_run(model, layout, policy, [DeviceTier(layout, 64, device="cpu")], prompt=37, steps=4, seed=6)
    got = all_candidates(policy, pids)
    P = layout.page_size
    for layer in range(layout.num_layers):
        keys = read_tokens(engine.table, layer, 0)[0]  # [S, N_kv, D]
        pages = [keys[j * P:(j + 1) * P] for j in range(pids.size)]  # the last one partly written
        want = [torch.stack([f(k) for k in pages]) for f in (lambda k: k.mean(0), lambda k: (k * k).mean(0),
                                                              lambda k: k.amin(0), lambda k: k.amax(0))]
        for name, have, exp in zip(["mean", "sq_mean", "min", "max"],
                                   [got.key_mean[layer], got.key_sq_mean[layer], *(b[layer] for b in got.key_bounds)],
                                   want):
            torch.testing.assert_close(have, exp, rtol=1e-5, atol=1e-6, msg=f"layer {layer}: key {name}")


def test_a_sequence_opens_without_waiting_for_the_step_in_flight():
    """A finished sequence's pages are freed once the steps queued before its end have run (its fence): opening the
    next sequence does not wait for them (the host keeps its lead on the GPU); a growth the device has no room for
    does, and takes those pages."""
    from kvtier.layout import KVLayout

    class Fence:  # the queued steps: not run until waited for
        waited = False

        def query(self):
            return self.waited

        def synchronize(self):
            self.waited = True

    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4, dtype=torch.float32)
    engine = Engine(None, layout, [DeviceTier(layout, 8, device="cpu")], LRU(), "all",
                    config=EngineConfig(max_batch=2, max_context=32))
    fence = Fence()
    engine.planner.queued_fence = lambda: fence
    kv = lambda layer, a, b: torch.ones(2, b - a, 1, 8)  # noqa: E731
    first = engine.add_written(12, kv)  # 3 pages
    engine.finish(first)
    free = engine.planner.device_free()
    second = engine.open(24)
    assert not fence.waited and first in engine.table.seqs
    engine.begin_prefill([second], 4 * free)  # the free pages
    assert not fence.waited and first in engine.table.seqs
    for layer in range(2):
        engine.store(layer, *torch.ones(2, 1, 1, 4 * free, 8))
    engine.plan.mode = "idle"
    engine.begin_prefill([second], 4)  # one page more: the finished sequence's
    assert fence.waited and first not in engine.table.seqs and engine.table.num_pages(second) == free + 1
