"""``topk`` by single keys (the default: ``unit="token"``, ``rank="sketch"``): each kv head's keys chosen on the device
from their sketched attention share, attended as key lists by the decode kernel (the kernels: ``test_key_choice.py``,
``test_static_decode.py``)."""

import os

import numpy as np
import pytest
import torch

from kvtier import KVLayout
from kvtier.budget import TokenBudget
from kvtier.engine import Engine, EngineConfig
from kvtier.stats import KeyStats
from kvtier.errors import ConfigError
from kvtier.kernels.registry import make_backend
from kvtier.kernels.base import SCORE_BINS, SCORE_RANGE
from kvtier.kernels.reference import key_choice_reference
from kvtier.models import kv_layout_for, tiny_llama
from kvtier.policies import H2O, SinkWindow
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.scopes import TopK
from kvtier.scopes.base import KeyList, pages_of
from kvtier.tiers import DeviceTier, HostTier

DEV = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"  # the engine runs where the Triton kernel does
N_KV, G, D, PAGE = 2, 3, 8, 4
LAYOUT = KVLayout(num_layers=1, num_kv_heads=N_KV, head_dim=D, page_size=PAGE, dtype="float32")
BIN = (SCORE_RANGE[1] - SCORE_RANGE[0]) / SCORE_BINS  # a score bin's width: keys within one are equal choices


def test_a_full_rank_sketch_chooses_the_keys_with_the_largest_true_share():
    """With r = D the sketch is the keys in another basis, on 8-bit levels: the n keys chosen between the spans are
    those with the largest true weight beside the shown keys (max over the group's query heads, log), up to a score
    bin (the levels' rounding stays inside it here)."""
    n_pages, n = 12, 13
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(n_pages * PAGE, N_KV, D, generator=g) * 2
    stats = KeyStats(LAYOUT, n_pages, "cpu", sketch_rank=D)
    stats.fit_sketch([(np.arange(n_pages), [keys])])
    q = torch.randn(2, N_KV * G, D, generator=g)
    lens = torch.tensor([45, 30], dtype=torch.int32)
    spans = torch.tensor([[3, 40], [2, 26]], dtype=torch.int32)
    pids = torch.arange(n_pages, dtype=torch.int32).expand(2, -1).contiguous()
    out = key_choice_reference(q, stats.query_map[0], stats.sketch[0], pids, torch.zeros(2, n_pages, dtype=torch.int32),
                               lens, spans, n, torch.empty(2, N_KV, 40, dtype=torch.int32))
    logits = torch.einsum("bkgd,skd->bkgs", q.view(2, N_KV, G, D), keys) * D ** -0.5  # [B, N_kv, G, S]
    t = torch.arange(n_pages * PAGE)
    for b in range(2):
        n_keys, (sinks, win) = int(lens[b]), spans[b].tolist()
        shown = torch.cat([logits[b, :, :, :sinks], logits[b, :, :, win:n_keys]], -1).logsumexp(-1, keepdim=True)
        share = (logits[b, :, :, :n_keys] - shown).amax(1).clamp(*SCORE_RANGE)  # [N_kv, S]
        for h in range(N_KV):
            listed = [x for x in out[b, h].tolist() if x >= 0]
            assert listed == sorted(listed) and set(range(sinks)) | set(range(win, n_keys)) <= set(listed)
            chosen = [x for x in listed if sinks <= x < win]
            assert len(chosen) == n and len(listed) == sinks + n + n_keys - win
            rest = [x for x in range(sinks, win) if x not in chosen]
            assert float(share[h, chosen].min()) >= float(share[h, rest].max()) - BIN
    assert not torch.equal(out[:, 0], out[:, 1])  # each kv head its own keys
    assert t.numel() == n_pages * PAGE


def engine(kernel: str, unit: str = "token", page_size: int = 8, budget=TokenBudget(40, 4, 8, 8, "continuous"),
           policy=None, device_pages: int = 12, **scope):
    model = tiny_llama(seed=1).to(DEV)
    layout = kv_layout_for(model.config, page_size=page_size, dtype=torch.float32)
    return Engine(model, layout, [DeviceTier(layout, device_pages, device=DEV), HostTier(layout, 64)],
                  policy or H2O(sinks=4, window=8), TopK(unit=unit, rank="sketch" if unit == "token" else "quest",
                                                         **scope),
                  kernel=make_backend(kernel, DEV), prefill=ChunkedPrefill(32), budget=budget,
                  exact_prefill=True, config=EngineConfig(max_batch=2, max_context=160, graphs=False))


def decode(e: Engine, steps: int) -> list[torch.Tensor]:
    for n, seed in ((70, 0), (45, 1)):
        e.add(torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)))
    return [e.step().clone() for _ in range(steps)]


def test_the_engine_attends_the_budget_in_keys_with_pages_off_the_device():
    """Both kernels (torch; Triton through the interpreter) give the same logits with pages on the device and
    the host; each step attends as many keys per row and layer as the page choice of the same budget (40), and
    they are other keys; the maps are fitted once, from the prompts' queries and keys, before the first step that chooses."""
    runs, attended, lists = {}, {}, []
    for kernel, unit in (("torch", "token"), ("triton", "token"), ("torch", "page")):
        e = engine(kernel, unit, sketch_rank=5) if unit == "token" else engine(kernel, unit)
        decode_with = e.kernel.decode

        def watch(*args, spans=None, key_list=None, page_list=None, **kw):  # a key list in place of spans and pages
            assert key_list is None or (spans is None and page_list is None)
            if key_list is not None:
                lists.append(key_list.clone())
            return decode_with(*args, spans=spans, key_list=key_list, page_list=page_list, **kw)

        e.kernel.decode = watch
        runs[kernel, unit] = decode(e, 6)
        attended[kernel, unit] = e.stats.attended_per_step()
        assert (e.buffers.block_table[:, :2] < 0).any()  # some pages are read from the host
        if unit == "token":
            assert e.keys.fitted and e.keys.query_map.abs().sum() > 0 and e.keys.query_second.abs().sum() > 0
    chosen = torch.stack(lists)  # [calls, B, N_kv, W]
    assert ((chosen >= 4) & (chosen < 8)).any()  # a sink page's spare keys may be chosen
    assert not torch.equal(chosen[:, :, 0], chosen[:, :, 1])
    assert len(attended["torch", "token"]) >= 4
    assert attended["torch", "token"] == attended["triton", "token"] == attended["torch", "page"] == \
        pytest.approx([40.0] * len(attended["torch", "page"]))
    if DEV == "cpu":  # on a GPU a key may cross a score image's boundary at the threshold (test_key_choice.py)
        for a, b in zip(runs["torch", "token"], runs["triton", "token"]):
            assert torch.allclose(a, b, atol=1e-4)
    assert not all(torch.allclose(a, b, atol=1e-4) for a, b in zip(runs["torch", "token"], runs["torch", "page"]))


def test_without_a_budget_the_key_choice_takes_pages_worth_of_keys():
    """``pages`` without a token budget: the sinks, the page being written and ``pages`` pages' worth of chosen
    keys each step (4 + at most 8 + 2 * 8 here)."""
    e = engine("torch", budget=None, pages=2, sinks=4, sketch_rank=4)
    logits = decode(e, 4)
    assert all(torch.isfinite(x).all() for x in logits)
    assert max(e.stats.attended_per_step()) <= 4 + 8 + 16 and e.keys.fitted


def test_recall_with_and_without_the_recall_cache_gives_the_same_tokens():
    """The recall cache holds copies of the pages the key choice read from the host: the same keys, the same
    logits, some of them read from its slots."""
    out = {}
    for slots in (0, 6):
        e = engine("triton", policy=SinkWindow(sinks=4, window=8), device_pages=18, recall_slots=slots)
        out[slots] = decode(e, 8)
    for a, b in zip(out[0], out[6]):
        assert torch.allclose(a, b, atol=1e-5)
    assert int(e.recall.copied) > 0 and bool((e.recall.page >= 0).any())


def test_pages_of_a_key_list_are_each_rows_pages_once():
    keys = torch.tensor([[[0, 1, 9, -1], [4, 17, -1, -1]], [[-1, -1, -1, -1], [30, 31, 33, -1]]], dtype=torch.int32)
    got = pages_of(KeyList(keys), 6, 8)  # [B, M]
    assert got.tolist() == [[0, 1, 2, -1, -1, -1], [3, 4, -1, -1, -1, -1]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captured steps need a GPU (CUDA graphs)")
def test_captured_and_eager_key_choice_give_the_same_tokens():
    model = tiny_llama(seed=1).cuda()
    layout = kv_layout_for(model.config, page_size=16, dtype=torch.float32)
    tokens = {}
    for graphs in (False, True):
        e = Engine(model, layout, [DeviceTier(layout, 24), HostTier(layout, 64)], SinkWindow(sinks=4, window=32),
                   TopK(recall_slots=8), budget=TokenBudget(96, 4, 32, 16, "continuous"), exact_prefill=True,
                   config=EngineConfig(max_batch=2, max_context=400, graphs=graphs))
        for n, seed in ((300, 0), (250, 1)):
            e.add(torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)))
        tokens[graphs] = torch.stack([e.step().argmax(-1) for _ in range(12)])
        assert (e.captured > 0) == graphs
    assert torch.equal(tokens[False], tokens[True])


def test_a_key_choice_takes_its_own_options():
    with pytest.raises(ConfigError, match="scope.rank.*single keys"):
        TopK(rank="quest", unit="token")
    with pytest.raises(ConfigError, match="scope.unit.*unknown"):
        TopK(unit="sub-page")
    with pytest.raises(ConfigError, match="scope.per_head.*single keys"):
        TopK(per_head=False)
    with pytest.raises(ConfigError, match="scope.landing_slots.*single keys"):
        TopK(recall_slots=4, landing_slots=2)
    with pytest.raises(ConfigError, match="scope.pages.*attend_budget"):
        engine("torch", budget=None)
    with pytest.raises(ConfigError, match="scope.sketch_rank.*head dim"):
        engine("torch", sketch_rank=64)
