"""The request scheduler on the real SmolLM2 (CPU): budgeted chunked prefill interleaved with decode,
prefix reuse through the radix tree, and preemption (recompute, swap) that resumes to the same greedy
tokens as HF's own uninterrupted generation."""

import numpy as np
import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.engine import Engine, EngineConfig
from kvtier.models import kv_layout_for
from kvtier.policies import LRU, SinkWindow
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.scheduler.lookahead import cached_pages
from kvtier.serve.scheduler import Request, ServeScheduler
from kvtier.tiers import DeviceTier, HostTier

NEW = 6


def hf_greedy(model, prompt, steps):
    """HF's own greedy continuation of ``prompt [S]`` (sdpa attention, its KV cache): ``steps`` token ids."""
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        out = model(prompt[None], use_cache=True)
        ids = [int(out.logits[0, -1].argmax())]
        for _ in range(steps - 1):
            out = model(torch.tensor([[ids[-1]]]), past_key_values=out.past_key_values, use_cache=True)
            ids.append(int(out.logits[0, -1].argmax()))
    return ids


@pytest.fixture(scope="module")
def setup(smollm2):
    model, tok = smollm2
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the cores are shared: one thread keeps a 135M model fast
    layout = kv_layout_for(model.config, page_size=8, dtype=torch.float32)
    shared = ("The light of the sun is compounded of rays differently refrangible, and those rays which are more "
              "refrangible than others are also more reflexible, as appears by")
    endings = [" experiments with prisms and", " the colours of thin plates, and", " the rainbow, whose"]
    prompts = [tok(shared + e, return_tensors="pt").input_ids[0] for e in endings]
    yield model, layout, prompts, [hf_greedy(model, p, NEW) for p in prompts]
    torch.set_num_threads(threads)


def make(model, layout, device_pages, host_pages=0, max_batch=3, max_context=128, lookahead=1):
    """An engine over ``device_pages`` device pages (its scratch page included) and an optional host tier."""
    tiers = [DeviceTier(layout, device_pages, device="cpu")] + ([HostTier(layout, host_pages)] if host_pages else [])
    return Engine(model, layout, tiers, LRU(), prefill=ChunkedPrefill(64),
                  config=EngineConfig(max_batch=max_batch, max_context=max_context, lookahead=lookahead))


def serve(model, layout, prompts, device_pages, host_pages=0, lookahead=1, **kw):
    engine = make(model, layout, device_pages, host_pages, lookahead=lookahead)
    sched = ServeScheduler(engine, token_budget=24, **kw)
    states = [sched.submit(Request(i, p.numpy(), NEW, arrival_s=float(i))) for i, p in enumerate(prompts)]
    sched.ran_ahead = 0  # iterations that ended with their tokens still in flight
    while not sched.idle:
        sched.iterate()
        sched.ran_ahead += sched.inflight is not None
    model.set_attn_implementation("sdpa")
    return sched, [s.output for s in states]


@pytest.mark.parametrize("lookahead", [1, 2])
def test_interleaved_prefill_and_prefix_reuse_match_hf(setup, lookahead):
    """lookahead 2: each iteration is planned before the last one's tokens are read back."""
    model, layout, prompts, want = setup
    sched, got = serve(model, layout, prompts, device_pages=40, lookahead=lookahead)
    assert sched.ahead == (lookahead == 2)
    assert (sched.ran_ahead > 0) == sched.ahead
    assert got == want
    assert sched.stats.recomputes == sched.stats.swaps == 0
    # the shared sentence's full pages were computed once: the later requests matched them
    assert sched.stats.cached_tokens >= 2 * 4 * 8
    assert sched.stats.iterations < sum(len(p) for p in prompts)  # chunks of up to 24 tokens, with decode


@pytest.mark.parametrize("mode,lookahead", [("recompute", 1), ("swap", 1), ("recompute", 2), ("swap", 2)])
def test_preempted_requests_resume_to_the_same_tokens(setup, mode, lookahead):
    model, layout, prompts, want = setup
    kw = dict(preempt="recompute") if mode == "recompute" else dict(swap_tokens=512, prefix_cache=False)
    sched, got = serve(model, layout, prompts, device_pages=10 if mode == "recompute" else 13, lookahead=lookahead,
                       **kw)
    assert got == want
    n = sched.stats.recomputes if mode == "recompute" else sched.stats.swaps
    assert n > 0 and sum(s.preemptions for s in sched.done) == sched.stats.recomputes + sched.stats.swaps


@pytest.mark.parametrize("lookahead", [1, 2])
def test_tiered_engine_holds_the_batch_without_preemption(setup, lookahead):
    """The same HBM plus host DRAM: pages go down a tier instead of requests being preempted (and with the next
    iteration planned before the last one's tokens are read, pages moving between them)."""
    model, layout, prompts, want = setup
    sched, got = serve(model, layout, prompts, device_pages=9, host_pages=40, lookahead=lookahead)
    assert got == want
    assert sched.stats.recomputes == sched.stats.swaps == 0
    assert max(occ["host"] for _, occ, _ in sched.stats.occupancy) > 0


def test_bad_settings(setup):
    model, layout, prompts, _ = setup
    engine = make(model, layout, 16, max_batch=2, max_context=64)
    with pytest.raises(ConfigError, match="token_budget"):
        ServeScheduler(engine, token_budget=2)
    with pytest.raises(ConfigError, match="preempt"):
        ServeScheduler(engine, preempt="swap-always")
    with pytest.raises(ConfigError, match="max_batch"):
        ServeScheduler(make(model, layout, 4, max_batch=2, max_context=64))
    sched = ServeScheduler(engine, token_budget=16)
    with pytest.raises(ConfigError, match="max_context"):
        sched.submit(Request(0, np.zeros(60, dtype=np.int64), 10))
    small = ServeScheduler(make(model, layout, 6, max_batch=2, max_context=64), token_budget=16)
    with pytest.raises(ConfigError, match="max_context=40"):  # what the tiers hold (6 pages but the scratch one)
        small.submit(Request(1, np.zeros(45, dtype=np.int64), 2))
    model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("room", [True, False])
def test_a_prompt_at_an_idle_engine_finds_room_made_ahead(setup, room):
    """Requests one after another on a tiered engine leave their pages to the prefix tree, which outgrows the
    device: its pages go down a tier (they held the device for good once: 'no device room for the page being
    written'). Each step keeps a budget's chunk of device slots free (the tree's pages going first), so no prompt
    waits for copies to make its room; without that room (``prompt_room`` 0) the later prompts do wait."""
    model, layout, prompts, _ = setup
    tiers = [DeviceTier(layout, 14, device="cpu"), HostTier(layout, 120)]
    engine = Engine(model, layout, tiers, SinkWindow(sinks=4, window=16), "resident", prefill=ChunkedPrefill(16),
                    config=EngineConfig(max_batch=3, max_context=128))
    sched = ServeScheduler(engine, token_budget=24)
    assert engine.planner.prompt_room == min(layout.pages_for(24) + 1, 14 // 4)
    if not room:
        engine.keep_room(0)
    waits = []
    wait_room = engine.planner.wait_room
    engine.planner.wait_room = lambda: waits.append(engine.step_idx) or wait_room()
    for i, p in enumerate(prompts + [p.flip(0) for p in prompts]):  # the flipped prompts share nothing
        sched.submit(Request(i, p.numpy(), NEW, arrival_s=float(i)))
        while not sched.idle:
            sched.iterate()
    model.set_attn_implementation("sdpa")
    assert [len(s.output) for s in sched.done] == [NEW] * 6
    cached = cached_pages(engine.table, np.zeros(0, dtype=np.int64))  # no request runs: every held page
    assert cached.size > 14 and (engine.table.tier_of[:, cached] == 1).any()
    assert (not waits) == room
    with pytest.raises(ConfigError, match="keep_room"):
        make(model, layout, 16).keep_room(2)  # one tier: nowhere to move pages to
