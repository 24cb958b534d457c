"""``bench.topk_hits``'s replay of the recall cache's picks: the shipped rule replayed gives the engine's own hit
rate (two sequences, tiny Llama, fp32, CPU), and Belady's rule and the cache that never evicts bound it."""

import numpy as np
import pytest
import torch

from bench.topk_hits import PickTrace, _lru, _opt, _unbounded
from kvtier.engine import Engine, EngineConfig
from kvtier.models import kv_layout_for, tiny_llama
from kvtier.policies import SinkWindow
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.scopes import TopK
from kvtier.tiers import DeviceTier, HostTier


@pytest.mark.parametrize("slots", [3, 6])  # 3: fewer slots than picks, so a step's own picks are not evicted
def test_the_shipped_rule_replayed_gives_the_engines_hit_rate(slots):
    model = tiny_llama(seed=1)
    layout = kv_layout_for(model.config, page_size=8, dtype=torch.float32)
    tiers = [DeviceTier(layout, 30), HostTier(layout, 128)]
    engine = Engine(model, layout, tiers, SinkWindow(sinks=4, window=16), TopK(4, recall_slots=slots, unit="page", rank="quest"),
                    prefill=ChunkedPrefill(64), config=EngineConfig(max_batch=2, max_context=256))
    trace = PickTrace(engine)
    gen = torch.Generator().manual_seed(3)
    for n in (150, 190):
        engine.add(torch.randint(0, 256, (n,), generator=gen))
    for _ in range(40):
        engine.step()
    attended, on_device = engine.buffers.counts.tolist()
    rates = trace.hit_rates(slots, windows=4)
    assert rates["lru_hit_rate"] == on_device / attended < rates["opt_hit_rate"] <= rates["unbounded_hit_rate"] < 1
    assert any(len(keys) and keys.max() >= engine.buffers.block_table.shape[-1] for trace_ in trace.steps.values()
               for keys, _ in trace_)  # the second row's pages are keyed apart from the first's
    assert len(rates["lru_by_window"]) == 4


def test_belady_keeps_the_page_picked_again_soonest():
    trace = [(np.array([1]), 0), (np.array([2]), 0), (np.array([1]), 0), (np.array([2]), 0)]
    assert _lru(trace, 1).tolist() == [0, 0, 0, 0]  # each miss evicts the page the next step wants
    assert _opt(trace, 1).tolist() == [0, 0, 1, 0]  # page 1 kept through step 1 (2 is not admitted)
    assert _unbounded(trace).tolist() == [0, 0, 1, 1]
