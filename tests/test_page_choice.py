"""Quest's page choice as one Triton launch (interpreter) against its torch oracle, and in the ``topk`` scope.

Fresh random key bounds and queries each case; candidate masks with holes, pids with -1, ties on purpose
(pages sharing a pid, pids sharing their bounds), k from 1 to past the candidates, per-row counts, query
rows and one kv head's group. The choice must be the oracle's exactly: the same pages in the same slots.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvtier.engine import Engine, EngineConfig
from kvtier.kernels.reference import page_choice_reference
from kvtier.kernels.triton_page_choice import ChoiceWork, page_choice
from kvtier.models import kv_layout_for, tiny_llama
from kvtier.policies import H2O, LRU
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
import kvtier.scopes.topk as topk_module
from kvtier.scopes import TopK
from kvtier.scopes.base import best_of
from kvtier.tiers import DeviceTier, HostTier

DEV = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"  # where the Triton kernel runs
needs_triton = pytest.mark.skipif(DEV == "cuda" and not torch.cuda.is_available(),
                                  reason="Triton needs a GPU or TRITON_INTERPRET=1")


def problem(gen, B, M, H, n_kv, D=64, rows=1, dtype=torch.float32):
    """q ``[B, (rows,) H, D]``, bounds ``[cap, N_kv, D]`` with ties (copied bounds, repeated pids), pids with -1,
    a candidate mask with holes ``[B, M]``."""
    cap = B * M + 8
    kmin = torch.randn(cap, n_kv, D, generator=gen)
    kmax = kmin + torch.rand(cap, n_kv, D, generator=gen)
    dup = torch.randint(0, cap, (cap // 5, 2), generator=gen)  # a fifth of the pids share another's bounds
    kmin[dup[:, 0]], kmax[dup[:, 0]] = kmin[dup[:, 1]], kmax[dup[:, 1]]
    pids = torch.randperm(cap, generator=gen)[:B * M].view(B, M)
    same = torch.rand(B, M, generator=gen) < 0.1  # pages sharing a pid with a neighbour
    pids = torch.where(same, pids.roll(1, 1), pids)
    pids[torch.rand(B, M, generator=gen) < 0.05] = -1
    cand = torch.rand(B, M, generator=gen) < torch.rand(B, 1, generator=gen)  # each row its own density
    q = torch.randn(B, *([rows] if rows > 1 else []), H, D, generator=gen).to(dtype)
    return q, kmin, kmax, pids.int(), cand


CASES = [  # (B, M, H, N_kv, rows, kv_head, dtype)
    (1, 600, 9, 3, 1, None, torch.float32),
    (1, 2100, 8, 2, 1, None, torch.float32),  # eight warps select
    (3, 97, 8, 2, 1, None, torch.bfloat16),
    (4, 40, 9, 3, 2, None, torch.float32),
    (2, 130, 8, 2, 1, 1, torch.float32),
    (5, 33, 9, 3, 3, 2, torch.float16),
]


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=[f"B{c[0]}-M{c[1]}-{c[2]}/{c[3]}-r{c[4]}-h{c[5]}" for c in CASES])
def test_fused_choice_equals_the_reference(case):
    B, M, H, n_kv, rows, kv_head, dtype = case
    gen = torch.Generator().manual_seed(CASES.index(case))
    q, kmin, kmax, pids, cand = (t.to(DEV) for t in problem(gen, B, M, H, n_kv, rows=rows, dtype=dtype))
    n_cand = int((cand & (pids >= 0)).sum(1).max())
    work = ChoiceWork.make(B, M, DEV)  # one scratch for every call
    for k in sorted({1, 2, max(1, n_cand // 2), n_cand, n_cand + 3, M + 5}):
        count = torch.randint(0, k + 2, (B,), generator=gen).to(DEV)
        for c in (None, count):
            got = page_choice(q, kmin, kmax, pids, cand, k, c, kv_head, work)
            want = page_choice_reference(q, kmin, kmax, pids, cand, k, c, kv_head)
            assert torch.equal(got.long(), want.long()), (k, c)


@needs_triton
def test_equal_scores_take_the_lower_page_first():
    """Every page scored alike: the first k candidates in page order (int8 mask), in both."""
    B, M, n_kv, D = 2, 50, 2, 64
    kmin = torch.zeros(1, n_kv, D, device=DEV)
    pids = torch.zeros(B, M, dtype=torch.int32, device=DEV)
    cand = (torch.arange(M, device=DEV) % 3 != 0).expand(B, M).to(torch.int8)
    q = torch.randn(B, 4, D, device=DEV)
    want = torch.arange(M)[cand[0].bool().cpu()][:7]
    for choose in (page_choice, page_choice_reference):
        got = choose(q, kmin, kmin + 1, pids, cand, 7, torch.tensor([7, 3], device=DEV)).cpu()
        assert got[0].tolist() == want.tolist() and got[1].tolist() == want[:3].tolist() + [-1] * 4


def test_best_of_counts_and_order():
    score = torch.tensor([[3.0, 1.0, 3.0, float("-inf"), 2.0, float("nan")]])
    cand = torch.ones(1, 6, dtype=torch.bool)
    assert best_of(score, cand, 2).tolist() == [[0, 2]]
    assert best_of(score, cand, 3, torch.tensor([1])).tolist() == [[0, -1, -1]]
    assert best_of(score, cand, 8).tolist() == [[0, 1, 2, 4, -1, -1, -1, -1]]  # never -inf or NaN


@pytest.fixture(scope="module")
def tiny():
    model = tiny_llama(seed=1)
    return model, kv_layout_for(model.config, page_size=8, dtype=torch.float32)


@needs_triton
@pytest.mark.parametrize("scope,budget", [(dict(pages=4), None),
                                          (dict(per_head=True, query_rows=2), (40, 4, 8)),
                                          (dict(policy_share=0.5), (48, 4, 8))])
def test_topk_chooses_with_the_fused_kernel_as_with_torch(tiny, monkeypatch, scope, budget):
    """An engine on the torch backend: at every choice of every layer and step, the fused kernel on the same
    inputs gives the torch path's page lists."""
    from kvtier.budget import TokenBudget

    model, layout = tiny
    calls = []

    def both(q, key_min, key_max, pids, cand, k, count=None, kv_head=None):
        want = page_choice_reference(q, key_min, key_max, pids, cand, k, count, kv_head)
        on = [t if t is None else t.to(DEV) for t in (q, key_min, key_max, pids, cand, count)]
        got = page_choice(*on[:5], k, on[5], kv_head)
        assert torch.equal(got.long().cpu(), want.long())
        calls.append(int((want >= 0).sum()))
        return want

    monkeypatch.setattr(topk_module, "page_choice_reference", both)
    engine = Engine(model, layout, [DeviceTier(layout, 24, device="cpu"), HostTier(layout, 64)],
                    H2O(sinks=4, window=8) if budget else LRU(), TopK(**scope, unit="page", rank="quest"), prefill=ChunkedPrefill(32),
                    budget=budget and TokenBudget(*budget, layout.page_size, "continuous"),
                    config=EngineConfig(max_batch=2, max_context=160))
    assert not engine.scope.fused
    for n, seed in ((70, 0), (45, 1)):
        engine.add(torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)))
    for _ in range(3):
        engine.step()
    assert calls and sum(calls) > 0


@needs_triton
def test_topk_on_the_triton_backend_binds_the_fused_choice(tiny):
    from kvtier.kernels.registry import make_backend

    _, layout = tiny
    model = tiny_llama(seed=1).to(DEV)
    engine = Engine(model, layout, [DeviceTier(layout, 24, device=DEV)], LRU(), TopK(4, unit="page", rank="quest"),
                    kernel=make_backend("triton", DEV), config=EngineConfig(max_batch=2, max_context=160))
    assert engine.scope.fused and engine.scope.work.images.shape[0] == 2
