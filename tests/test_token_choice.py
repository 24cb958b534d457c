"""``topk unit=token``: the middle's keys chosen one by one from their sketched attention share, the pages that hold
them listed whole with each one's chosen keys as token bits (the kernels' token mask, tested in
``test_static_decode.py``)."""

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvtier import KVLayout
from kvtier.budget import TokenBudget
from kvtier.engine import Engine, EngineConfig
from kvtier.engine.stats import KeyStats
from kvtier.errors import ConfigError
from kvtier.kernels.registry import make_backend
from kvtier.models import kv_layout_for, tiny_llama
from kvtier.policies import H2O
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.scopes import TopK
from kvtier.scopes.base import budget_pick
from kvtier.scopes.topk import sketch_tokens
from kvtier.tiers import DeviceTier, HostTier

DEV = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"  # the engine runs where the Triton kernel does
N_KV, G, D, PAGE = 2, 3, 8, 4
LAYOUT = KVLayout(num_layers=1, num_kv_heads=N_KV, head_dim=D, page_size=PAGE, dtype="float32")


def full_rank_stats(n_pages: int, stored: torch.Tensor, seed: int) -> tuple[KeyStats, torch.Tensor]:
    """Key statistics with a full-rank sketch (r = D: the keys in another basis) of ``stored [M]`` keys per page:
    ``(stats, keys [M, P, N_kv, D])``."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(n_pages, PAGE, N_KV, D, generator=g) * 2
    stats = KeyStats(LAYOUT, n_pages, "cpu", sketch_rank=D)
    full = [m for m in range(n_pages) if stored[m] == PAGE]
    whole = keys[full].reshape(-1, N_KV, D)  # the full pages' keys, page after page
    stats.add(0, torch.tensor(full).repeat_interleave(PAGE), whole)
    stats.fit_sketch([(np.array(full), [whole])])  # the basis; later keys are sketched as they come
    for m in range(n_pages):
        if 0 < stored[m] < PAGE:
            stats.add(0, torch.full((int(stored[m]),), m), keys[m, :int(stored[m])])
    return stats, keys


def true_shares(q: torch.Tensor, keys: torch.Tensor, stored: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """Each key's share of each head's softmax over the stored keys of the live pages ``[B, M, P, H]``."""
    logits = torch.einsum("bhd,mphd->bmph", q, keys.repeat_interleave(G, dim=2)) * D ** -0.5
    ok = (torch.arange(PAGE)[None, :] < stored[:, None])[None, :, :, None] & live[:, :, None, None]
    return torch.softmax(logits.masked_fill(~ok, float("-inf")).flatten(1, 2), 1).view_as(logits)


def test_a_full_rank_sketch_gives_each_keys_true_attention_share():
    stored = torch.tensor([4, 4, 4, 2, 4, 3, 1, 4])
    stats, keys = full_rank_stats(8, stored, seed=3)
    q = torch.randn(2, N_KV * G, D, generator=torch.Generator().manual_seed(4))
    live = torch.arange(8)[None, :] < torch.tensor([[8], [6]])
    got = sketch_tokens(q, stats, 0, torch.arange(8).expand(2, -1), live)
    assert torch.allclose(got, true_shares(q, keys, stored, live), atol=1e-5)


@pytest.mark.parametrize("kv_head", [None, 0, 1])
def test_the_token_choice_takes_the_keys_with_the_largest_share(kv_head):
    """``_shares`` per key, then ``_choose_keys`` against a per-row reference: the ``n`` stored candidate keys with the
    largest share (summed over the heads that share the choice)."""
    n_pages, n = 12, 11
    stored = torch.tensor([4] * 9 + [3, 0, 0])
    stats, keys = full_rank_stats(n_pages, stored, seed=5)
    q = torch.randn(2, 1, N_KV * G, D, generator=torch.Generator().manual_seed(6))  # [B, r, H, D]
    pids = torch.arange(n_pages).expand(2, -1).clone()
    pids[1, 10:] = -1  # row 1 has ten pages
    cand = torch.rand(2, n_pages, PAGE, generator=torch.Generator().manual_seed(7)) < 0.7  # [B, M, P] keys
    scope = TopK(rank="sketch", unit="token", per_head=kv_head is not None, sketch_rank=D)
    scope.engine = SimpleNamespace(keys=stats, layout=LAYOUT)
    view = SimpleNamespace(pids=pids, batch=2)
    chosen = scope._choose_keys(0, scope._shares(0, q, view, per_key=True), view, cand, n, kv_head)  # [B, M, P]
    share = true_shares(q[:, 0], keys, stored, pids >= 0)  # [B, M, P, H]
    heads = slice(None) if kv_head is None else slice(kv_head * G, (kv_head + 1) * G)
    for b in range(2):
        score = share[b, :, :, heads].sum(-1)  # [M, P]
        ok = cand[b] & (pids[b] >= 0)[:, None] & (torch.arange(PAGE)[None, :] < stored[:, None])
        flat = torch.where(ok, score, float("-inf")).flatten()
        want = torch.zeros(n_pages * PAGE, dtype=torch.bool)
        want[flat.topk(min(n, int(ok.sum()))).indices] = True
        assert torch.equal(chosen[b].flatten(), want), b


def test_a_key_budget_may_spend_the_sink_and_window_pages_spare_keys():
    """``budget_pick(per_key=True)``: the candidates are the middle pages' keys and the keys the spans leave out of
    the sink and window pages; the lists hold the sink pages, the middle pages with a chosen key, the window's pages;
    each entry's bits are its sinks or window tokens and its chosen keys. A row the budget holds whole: every page,
    every bit."""
    P, n_pages = 4, 9
    budget = TokenBudget(18, 2, 8, P, "continuous")  # 2 sinks, 2 middle pages (8 keys), a window of 8 tokens
    lens = torch.tensor([34, 16], dtype=torch.int32)  # row 0: win_start 26 (pages 6-8); row 1 fits whole
    view = SimpleNamespace(budget=budget, page_size=P, batch=2, once=False, spans=torch.tensor([[2, 26], [0, 0]]),
                           rows=lambda layer: (torch.zeros(2, n_pages, dtype=torch.int32), lens.long(),
                                               (lens.long() + P - 1) // P),
                           window=lambda layer: 0)
    seen = {}

    def choose(cand, n):  # the keys at tokens 3, 9, 10, 17, 18, 20, 24 and 25
        seen["cand"], seen["n"] = cand.clone(), n
        chosen = torch.zeros_like(cand)
        chosen.view(2, -1)[0, [3, 9, 10, 17, 18, 20, 24, 25]] = True
        return chosen

    lists, bits = budget_pick(0, view, choose, device_only=False, per_key=True)
    tok = torch.arange(n_pages * P).view(n_pages, P)
    assert seen["n"] == 8
    assert torch.equal(seen["cand"][0], (tok >= 2) & (tok < 26))  # sink page after its sinks, the window page before
    assert lists[0].tolist() == [0, 2, 4, 5, -1, -1, -1, -1, -1, 6, 7, 8]  # sink page, 8 middle entries, window
    assert bits[0].tolist() == [0b1011, 0b0110, 0b0110, 0b0001, 0, 0, 0, 0, 0, 0b1111, 0b1111, 0b1111]
    shown = (bits[0, :, None] >> torch.arange(P)) & 1  # [K, P]
    key = lists[0, :, None] * P + torch.arange(P)
    assert int((shown.bool() & (lists[0, :, None] >= 0) & (key < 34)).sum()) == 18  # the budget's tokens
    assert [p for p in lists[1].tolist() if p >= 0] == [0, 1, 2, 3] and (bits[1] == -1).all()


def engine(kernel: str, unit: str = "token", page_size: int = 8, budget=TokenBudget(40, 4, 8, 8, "continuous")):
    model = tiny_llama(seed=1).to(DEV)
    layout = kv_layout_for(model.config, page_size=page_size, dtype=torch.float32)
    return Engine(model, layout, [DeviceTier(layout, 12, device=DEV), HostTier(layout, 64)],
                  H2O(sinks=4, window=8), TopK(rank="sketch", per_head=True, sketch_rank=5, unit=unit),
                  kernel=make_backend(kernel, DEV), prefill=ChunkedPrefill(32), budget=budget,
                  exact_prefill=True, config=EngineConfig(max_batch=2, max_context=160, graphs=False))


def decode(e: Engine, steps: int) -> list[torch.Tensor]:
    for n, seed in ((70, 0), (45, 1)):
        e.add(torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)))
    return [e.step().clone() for _ in range(steps)]


def test_the_engine_attends_the_budget_in_keys_with_pages_off_the_device():
    """Both kernels (torch; Triton through the interpreter) give the same logits with pages on the device and
    the host; each step attends as many keys per row and layer as the page choice of the same budget (40), and
    they are other keys."""
    runs, attended, spare = {}, {}, []
    for kernel, unit in (("torch", "token"), ("triton", "token"), ("torch", "page")):
        e = engine(kernel, unit)
        decode_with = e.kernel.decode

        def watch(*args, spans=None, token_mask=None, page_list=None, **kw):  # bits in place of the spans
            assert spans is None or token_mask is None
            if token_mask is not None:  # a sink page's key after the 4 sinks
                spare.append(bool(((page_list == 0) & (token_mask & ~0xF != 0)).any()))
            return decode_with(*args, spans=spans, token_mask=token_mask, page_list=page_list, **kw)

        e.kernel.decode = watch
        runs[kernel, unit] = decode(e, 6)
        attended[kernel, unit] = e.stats.attended_per_step()
        assert (e.block_table[:, :2] < 0).any()  # some pages are read from the host
    assert any(spare)  # the sink page's spare keys are chosen
    assert len(attended["torch", "token"]) >= 4
    assert attended["torch", "token"] == attended["triton", "token"] == attended["torch", "page"] == \
        pytest.approx([40.0] * len(attended["torch", "page"]))
    for a, b in zip(runs["torch", "token"], runs["triton", "token"]):
        assert torch.allclose(a, b, atol=1e-4)
    assert not all(torch.allclose(a, b, atol=1e-4) for a, b in zip(runs["torch", "token"], runs["torch", "page"]))


def test_a_token_choice_needs_a_sketch_a_budget_and_small_pages():
    with pytest.raises(ConfigError, match="scope.unit.*rank 'sketch'"):
        TopK(rank="quest", unit="token")
    with pytest.raises(ConfigError, match="scope.unit.*unknown"):
        TopK(rank="sketch", unit="sub-page")
    with pytest.raises(ConfigError, match="scope.per_head.*cache.attend_budget"):
        engine("torch", budget=None)
    with pytest.raises(ConfigError, match="scope.unit.*32 keys per page"):
        engine("torch", page_size=64, budget=TokenBudget(256, 4, 64, 64, "continuous"))
