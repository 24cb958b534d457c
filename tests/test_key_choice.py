"""The choice of single keys by a low-rank sketch: two Triton launches (interpreter) against their torch oracle.

Fresh random sketches, bases and queries each case; pids with -1, pages dropped for good, idle rows, rows the
budget holds whole, a sliding window, keys sharing a sketch (ties on purpose), ``n`` from 0 to past the
candidates. The lists must be the oracle's exactly: the same keys in the same places.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvtier.kernels.base import DROPPED
from kvtier.kernels.reference import key_choice_reference, key_bins_reference

DEV = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"  # where the Triton kernel runs
needs_triton = pytest.mark.skipif(DEV == "cuda" and not torch.cuda.is_available(),
                                  reason="Triton needs a GPU or TRITON_INTERPRET=1")


def problem(gen, B, M, P, H, n_kv, D, r, sketch_dtype=torch.float32):
    """q ``[B, H, D]``, a query map ``[N_kv, D, r]``, a sketch ``[cap, P, N_kv, r]`` where a fifth of the keys copy
    another's (ties), pids ``[B, M]`` (-1 past a row's keys) and a block table with pages dropped between the spans,
    lengths ``[B]`` (an idle row, a short one) and spans ``[B, 2]`` (a row held whole)."""
    cap = B * M + 4
    sketch = torch.randn(cap * P, n_kv, r, generator=gen)
    if sketch_dtype == torch.int8:  # the engine's 8-bit levels
        sketch = (sketch * 40).round().clamp(-127, 127)
    dup = torch.randint(0, cap * P, (cap * P // 5, 2), generator=gen)
    sketch[dup[:, 0]] = sketch[dup[:, 1]]
    sketch = sketch.view(cap, P, n_kv, r).to(sketch_dtype)
    query_map = torch.linalg.qr(torch.randn(n_kv, D, D, generator=gen)).Q[..., :r].contiguous()
    if sketch_dtype == torch.int8:
        query_map = query_map / 40
    pids = torch.randperm(cap, generator=gen)[:B * M].view(B, M).int()
    lens = torch.randint(M * P // 2, M * P + 1, (B,), generator=gen).int()
    lens[0] = 0  # an idle row of the bucket
    sinks = torch.randint(0, 3 * P, (B,), generator=gen)
    win = lens.long() - torch.randint(1, 5 * P, (B,), generator=gen)
    if B > 2:
        lens[2], win[2] = 3 * P + 1, 0  # held whole
    spans = torch.stack([sinks, win.clamp(min=0)], 1).int()
    table = torch.randint(-50, 50, (B, M), generator=gen).int()
    page = torch.arange(M)
    middle = (page >= 3) & (page < win[:, None] // P)  # pages dropped for good lie between the spans
    table[middle & (torch.rand(B, M, generator=gen) < 0.06)] = DROPPED
    pids[page * P >= lens[:, None]] = -1  # no page past a row's keys
    q = torch.randn(B, H, D, generator=gen)
    return q, query_map, sketch, pids, table, lens, spans


CASES = [  # (B, M, P, H, N_kv, D, r, n, window, sketch dtype)
    (4, 40, 16, 9, 3, 64, 32, 97, 0, torch.int8),  # 640 keys a row: one chunk; the engine's 8-bit sketch
    (3, 150, 16, 8, 2, 32, 8, 410, 0, torch.float32),  # 2,400: three chunks
    (3, 70, 4, 6, 2, 16, 4, 5000, 0, torch.float32),  # n past the candidates
    (3, 90, 16, 8, 1, 64, 16, 300, 700, torch.bfloat16),  # a sliding window of 700 keys, MQA
    (3, 30, 16, 4, 2, 16, 16, 0, 0, torch.float32),  # the spans alone
]


def assert_threshold_flips(got: torch.Tensor, want: torch.Tensor, images: torch.Tensor) -> None:
    """``got`` lists what ``want`` lists, but for keys whose (reference) bin is within one of the threshold's (the
    lowest bin ``want`` chose in that row): as many keys, the same spans."""
    assert torch.equal((got >= 0).sum(-1), (want >= 0).sum(-1))
    for b, h in ((b, h) for b in range(got.shape[0]) for h in range(got.shape[1])):
        flipped = set(got[b, h].tolist()) ^ set(want[b, h].tolist())
        if not flipped:
            continue
        chosen = [t for t in want[b, h].tolist() if t >= 0 and images[b, h, t] >= 0]
        threshold = int(images[b, h, chosen].min())
        assert all(abs(int(images[b, h, t]) - threshold) <= 1 for t in flipped), (b, h, sorted(flipped), threshold)


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=[f"B{c[0]}-M{c[1]}-P{c[2]}-{c[3]}/{c[4]}-r{c[6]}-n{c[7]}-w{c[8]}"
                                             for c in CASES])
def test_the_device_key_choice_equals_the_reference(case, monkeypatch, max_chunks=None):
    import kvtier.kernels.triton_key_choice as module

    if max_chunks:  # fewer, longer chunks: each program walks several sub-blocks
        monkeypatch.setattr(module, "MAX_CHUNKS", max_chunks)
    B, M, P, H, n_kv, D, r, n, window, dtype = case
    gen = torch.Generator().manual_seed(sum(case[:8]))
    q, query_map, sketch, pids, table, lens, spans = (x.to(DEV) for x in problem(gen, B, M, P, H, n_kv, D, r, dtype))
    width = int(spans[:, 0].max()) + n + 5 * P + 4 * P
    want = key_choice_reference(q, query_map, sketch, pids, table, lens, spans, n,
                                torch.empty(B, n_kv, width, dtype=torch.int32, device=DEV), window)
    got = module.key_choice(q, query_map, sketch, pids, table, lens, spans, n,
                            torch.full((B, n_kv, width), 7, dtype=torch.int32, device=DEV), window)
    if DEV == "cpu":
        assert torch.equal(got, want)
    else:  # a GPU's exp/log round otherwise than torch's: a key may cross a bin boundary, at the threshold only
        assert_threshold_flips(got, want, key_bins_reference(q, query_map, sketch, pids, table, lens, spans, window))
    assert (want[0] == -1).all()  # the idle row lists nothing
    listed = want[want >= 0]
    live = (pids.long() >= 0) & (table != DROPPED)
    assert bool(live.gather(1, (want.clamp(min=0) // P).flatten(1).long()).view_as(want)[want >= 0].all())
    assert listed.numel() and bool((want[..., 1:] > want[..., :-1])[want[..., 1:] >= 0].all())  # position order


@needs_triton
def test_chunks_of_several_sub_blocks_choose_the_same_keys(monkeypatch):
    test_the_device_key_choice_equals_the_reference(CASES[1], monkeypatch, max_chunks=2)  # 5 sub-blocks: 3 + 2
