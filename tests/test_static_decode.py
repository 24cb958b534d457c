"""Static-shape decode over a device pool and a host pool: kernel (interpreter) vs torch reference vs oracles.

Every case draws fresh random pages for all ``max_pages`` of every sequence (so a key past the
sequence or outside the window would change the result), places each page at random on the
device or the host pool (block-table entries past a sequence point out of range), and checks
out, lse and page_max against a float64 token-by-token oracle and, without a window, against
:func:`paged_attention_reference` over a combined pool.
"""

from __future__ import annotations

import os


import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kvtier.kernels.base import PagedBatch  # noqa: E402
from kvtier.kernels.reference import paged_attention_reference  # noqa: E402
from kvtier.kernels.triton_decode import DecodeConfig  # noqa: E402
from kvtier.kernels.reference import static_decode_reference  # noqa: E402
import kvtier.kernels.triton_decode as static_module  # noqa: E402
from kvtier.kernels.triton_decode import (MAX_SPLITS, _listed_range, plan_static_decode,  # noqa: E402
                                         static_decode)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="Triton needs a GPU or TRITON_INTERPRET=1")


def device():
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def host(pool: torch.Tensor | None) -> torch.Tensor | None:
    """The host pool as the kernel gets it: pinned host memory, read through its mapped address on a GPU."""
    return pool if pool is None or device() == "cpu" else pool.pin_memory()


def random_case(seq_lens, max_pages, page, n_kv, group, dim, dtype, host_frac, gen, with_host=True):
    """Random q, keys/values of every page, their placement in a device and a host pool, and the block table.

    Returns ``(q [B, H, D], keys [B, max_pages * P, N_kv, D], values, dev_pool, host_pool, block_table)``.
    """
    batch = len(seq_lens)
    keys = torch.randn(batch, max_pages * page, n_kv, dim, generator=gen).to(dtype)
    values = torch.randn(batch, max_pages * page, n_kv, dim, generator=gen).to(dtype)
    on_host = (torch.rand(batch, max_pages, generator=gen) < host_frac) & with_host  # [B, max_pages]
    n_host = int(on_host.sum())
    n_dev = batch * max_pages - n_host
    dev_pool = torch.randn(n_dev + 3, 2, page, n_kv, dim, generator=gen).to(dtype)  # spare slots of noise
    host_pool = torch.randn(n_host + 2, 2, page, n_kv, dim, generator=gen).to(dtype) if with_host else None
    dev_slots, host_slots = torch.randperm(n_dev + 3, generator=gen), torch.randperm(n_host + 2, generator=gen)
    block_table = torch.empty(batch, max_pages, dtype=torch.int32)
    n_d = n_h = 0
    for b in range(batch):
        for p in range(max_pages):
            kv = torch.stack([keys[b, p * page:(p + 1) * page], values[b, p * page:(p + 1) * page]])  # [2, P, N, D]
            if on_host[b, p]:
                host_pool[host_slots[n_h]] = kv
                block_table[b, p] = -int(host_slots[n_h]) - 1
                n_h += 1
            else:
                dev_pool[dev_slots[n_d]] = kv
                block_table[b, p] = int(dev_slots[n_d])
                n_d += 1
    q = torch.randn(batch, n_kv * group, dim, generator=gen).to(dtype)
    return q, keys, values, dev_pool, host_pool, block_table


def dense_oracle(q, keys, values, seq_lens, listed, window_left, page, sm_scale):
    """Float64 attention token by token over the counted keys: out [B, H, D], lse [B, H], page_max [B, K, H]."""
    batch, heads, dim = q.shape
    group = heads // keys.shape[2]
    out = torch.zeros(batch, heads, dim, dtype=torch.float64)
    lse = torch.full((batch, heads), -math.inf, dtype=torch.float64)
    page_max = torch.full((batch, len(listed[0]), heads), -math.inf, dtype=torch.float64)
    for b, n in enumerate(seq_lens):
        lo = max(n - 1 - window_left, 0) if window_left >= 0 else 0
        toks = [(i, t) for i, p in enumerate(listed[b]) if p >= 0 for t in range(p * page, (p + 1) * page)
                if lo <= t < n]
        if not toks:
            continue
        rows = torch.tensor([t for _, t in toks])
        owner = torch.tensor([i for i, _ in toks])
        k = keys[b, rows].double().repeat_interleave(group, dim=1)  # [S, H, D]
        v = values[b, rows].double().repeat_interleave(group, dim=1)
        logits = torch.einsum("hd,shd->hs", q[b].double(), k) * sm_scale  # [H, S]
        lse[b] = torch.logsumexp(logits, -1)
        out[b] = torch.einsum("hs,shd->hd", torch.softmax(logits, -1), v)
        for i in owner.unique().tolist():
            page_max[b, i] = logits[:, owner == i].amax(-1)
    return out, lse, page_max


def paged_batch_reference(q, dev_pool, host_pool, block_table, seq_lens, listed, page, sm_scale):
    """paged_attention_reference over ``cat(dev_pool, host_pool)`` with each sequence's counted listed pages.

    Returns out, lse and page_max ``[B, K, H]`` (-inf for entries that attend nothing). No window.
    """
    pool = dev_pool if host_pool is None else torch.cat([dev_pool, host_pool])
    kv_indptr, kv_indices, last, entries = [0], [], [], []
    for b, n in enumerate(seq_lens):
        n_pages = -(-n // page)
        counted = [(i, p) for i, p in enumerate(listed[b]) if 0 <= p < n_pages]
        for i, p in counted:
            x = int(block_table[b, p])
            kv_indices.append(x if x >= 0 else dev_pool.shape[0] - x - 1)
            entries.append((b, i))
        kv_indptr.append(len(kv_indices))
        last.append((n - (n_pages - 1) * page if counted[-1][1] == n_pages - 1 else page) if counted else 0)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    batch = PagedBatch(i32(list(range(len(seq_lens) + 1))), i32(kv_indptr), i32(kv_indices), i32(last), page)
    ref = paged_attention_reference(q, pool, batch, sm_scale, return_page_max=True)
    page_max = torch.full((len(seq_lens), len(listed[0]), q.shape[1]), -math.inf)
    for row, (b, i) in enumerate(entries):
        page_max[b, i] = ref.page_max[row]
    return ref.out, ref.lse, page_max


def assert_close(res, expect, dtype, what):
    out, lse, page_max = res
    e_out, e_lse, e_pm = (x.cpu().double() for x in expect)
    assert not torch.isnan(out).any(), what
    scale = e_out.abs().max().clamp(min=1e-6)
    assert (out.cpu().double() - e_out).abs().max() / scale < TOL[dtype], what
    for got, want, name in ((lse, e_lse, "lse"), (page_max, e_pm, "page_max")):
        fin = torch.isfinite(want)
        assert torch.equal(torch.isfinite(got.cpu()), fin) and torch.isneginf(got.cpu()[~fin]).all(), (what, name)
        assert torch.allclose(got.cpu().double()[fin], want[fin], atol=20 * TOL[dtype]), (what, name)


def run_case(seq_lens, max_pages, page, n_kv, group, dim, dtype, host_frac, lists, window_left, config, seed,
             with_host=True):
    gen = torch.Generator().manual_seed(seed)
    q, keys, values, dev_pool, host_pool, block_table = random_case(seq_lens, max_pages, page, n_kv, group, dim,
                                                                     dtype, host_frac, gen, with_host)
    listed = lists if lists is not None else [list(range(max_pages))] * len(seq_lens)
    page_list = torch.tensor(lists, dtype=torch.int32) if lists is not None else None
    sm_scale = dim ** -0.5
    heads = n_kv * group
    plan = plan_static_decode(len(seq_lens), max_pages, heads, n_kv, dim, page, device(),
                              None if lists is None else len(lists[0]), config)
    to = lambda x: None if x is None else x.to(device())  # noqa: E731
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    past = torch.arange(max_pages) >= -(-lens[:, None] // page)  # [B, max_pages] pages past each sequence
    block_table[past] = torch.where(torch.rand(past.shape, generator=gen) < 0.5, 10 ** 6, -10 ** 6)[past].int()
    pm = torch.empty(len(seq_lens), len(listed[0]), heads, device=device())
    out, lse = static_decode(to(q), to(dev_pool), host(host_pool), to(block_table), to(lens), plan, sm_scale,
                             to(page_list), window_left, pm)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == q.shape[:2]
    pm_ref = torch.empty(len(seq_lens), len(listed[0]), heads)
    ref = static_decode_reference(q, dev_pool, host_pool, block_table, lens, plan, sm_scale, page_list,
                                  window_left, pm_ref)
    oracle = dense_oracle(q, keys, values, seq_lens, listed, window_left, page, sm_scale)
    assert_close((out, lse, pm), oracle, dtype, "kernel vs oracle")
    assert_close((*ref, pm_ref), oracle, dtype, "reference vs oracle")
    if window_left < 0:
        assert_close((out, lse, pm), paged_batch_reference(q, dev_pool, host_pool, block_table, seq_lens, listed,
                                                           page, sm_scale), dtype, "kernel vs paged reference")
    for b, n in enumerate(seq_lens):
        if n == 0:
            assert torch.isneginf(lse[b]).all() and (out[b] == 0).all()
    return plan


@pytest.mark.parametrize("seq_lens,max_pages,page,n_kv,group,dim,dtype,host_frac,lists,window,config", [
    # GQA 4, mixed placement, an inactive row, partial last pages; 3 splits of 2 pages + merge
    ([37, 0, 50, 16], 4, 16, 2, 4, 64, torch.float32, 0.5, None, -1, DecodeConfig(block_n=16, pages_per_split=2)),
    # group 3, fp16, a padded page list (a page past the sequence, -1 padding), one split, D=128, P=8
    ([21, 40, 9], 6, 8, 1, 3, 128, torch.float16, 0.3, [[0, 2, 3, -1], [1, 2, 4, 5], [0, 1, 2, 3]], -1,
     DecodeConfig(block_n=16)),
    # MHA, every page on the host, a window smaller than the context (cuts mid-page), splits
    ([45, 30, 3], 6, 8, 2, 1, 64, torch.float32, 1.0, None, 13, DecodeConfig(block_n=16, pages_per_split=2)),
    # MQA (4 heads on 1 kv head), page list + a window larger than the context
    ([40, 0, 33], 3, 16, 1, 4, 64, torch.float32, 0.5, [[0, 2, -1], [0, 1, 2], [1, 2, -1]], 100,
     DecodeConfig(block_n=16, pages_per_split=1)),
    # fp16, a window with a page list across splits of 2-page blocks (skipped blocks before the window)
    ([64, 57], 8, 8, 1, 4, 64, torch.float16, 0.5, [[0, 1, 2, 4, 5, 6, 7, -1], [0, 2, 3, 4, 5, 6, 7, -1]], 9,
     DecodeConfig(block_n=16, pages_per_split=4)),
    # a page list narrower than a block: the last block of a row ends at the list's width, not in the next row
    ([40, 48], 6, 8, 1, 2, 64, torch.float32, 0.5, [[0, 1, 2], [3, 4, 5]], -1, DecodeConfig(block_n=16)),
    # 20 one-page splits: the merge reads its partials in two chunks
    ([300, 150], 20, 16, 1, 2, 64, torch.float32, 0.5, None, -1, DecodeConfig(block_n=16, pages_per_split=1)),
    # the default launch config (128-token blocks of 8 pages) and planner, a window
    ([150, 0, 77], 10, 16, 2, 4, 64, torch.float16, 0.5, None, 60, None),
    # columns in warp token order (block_n a multiple of 8 x num_warps): one 8-token page per warp, a list, a window
    ([64, 57], 8, 8, 1, 4, 64, torch.float32, 0.5, [[0, 1, 2, 4, 5, 6, 7, -1], [0, 2, 3, 4, 5, 6, 7, -1]], 9,
     DecodeConfig(block_n=32, pages_per_split=4)),
    # head_dim 256
    ([20, 9], 2, 16, 1, 3, 256, torch.float32, 0.5, None, -1, DecodeConfig(block_n=16)),
])
def test_static_decode_matches_references(seq_lens, max_pages, page, n_kv, group, dim, dtype, host_frac, lists,
                                          window, config):
    run_case(seq_lens, max_pages, page, n_kv, group, dim, dtype, host_frac, lists, window, config,
             seed=sum(seq_lens) + dim + group)


def test_without_a_host_pool():
    plan = run_case([30, 17], 3, 16, 2, 4, 64, torch.float32, 0.0, None, -1, DecodeConfig(block_n=16), seed=3,
                    with_host=False)
    assert plan.num_splits == 1 and plan.part_out is None


def test_planner_sized_splits_match():
    plan = run_case([100, 5], 8, 16, 1, 4, 64, torch.float32, 0.5, None, -1,
                    DecodeConfig(block_n=32, min_split_tokens=32), seed=4)
    assert plan.num_splits > 1


def test_same_tensors_updated_in_place_give_both_results():
    """The CUDA-graph pattern: one plan and the same input tensors, contents rewritten between calls."""
    gen = torch.Generator().manual_seed(7)
    page, dim, heads, n_kv = 8, 64, 4, 2
    plan = plan_static_decode(2, 4, heads, n_kv, dim, page, device(),
                              config=DecodeConfig(block_n=16, pages_per_split=2))
    q, keys, values, dev_pool, host_pool, block_table = random_case([32, 32], 4, page, n_kv, 2, dim, torch.float32,
                                                                    0.5, gen)
    d = device()
    q_d, dev_d, host_d, bt_d = q.to(d), dev_pool.to(d), host(host_pool), block_table.to(d)
    lens = torch.tensor([10, 0], dtype=torch.int32, device=d)
    pm = torch.empty(2, 4, heads, device=d)
    results = []
    for new_lens, flip in (([10, 0], False), ([27, 19], True)):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        if flip:  # the sequences swap pages: the same block table tensor, new contents
            bt_d.copy_(block_table.flip(0))
        out, lse = static_decode(q_d, dev_d, host_d, bt_d, lens, plan, dim ** -0.5, page_max=pm)
        k, v = (keys.flip(0), values.flip(0)) if flip else (keys, values)
        expect = dense_oracle(q, k, v, new_lens, [list(range(4))] * 2, -1, page, dim ** -0.5)
        assert_close((out, lse, pm), expect, torch.float32, str(new_lens))
        results.append(out.clone())
    assert not torch.equal(results[0][0], results[1][0])


def test_a_call_reads_no_tensor_value_on_the_host(monkeypatch):
    """No .item()/.tolist()/.cpu()/bool(): nothing that would sync the stream or break CUDA-graph capture."""
    gen = torch.Generator().manual_seed(8)
    q, _, _, dev_pool, host_pool, block_table = random_case([20, 3], 4, 8, 1, 4, 32, torch.float32, 0.5, gen)
    plan = plan_static_decode(2, 4, 4, 1, 32, 8, device(), max_listed=3,
                              config=DecodeConfig(block_n=8, pages_per_split=2))
    args = [x.to(device()) for x in (q, dev_pool, block_table, torch.tensor([20, 3], dtype=torch.int32))]
    args.insert(2, host(host_pool))
    page_list = torch.tensor([[0, 2, -1], [0, 1, 2]], dtype=torch.int32, device=device())
    pm = torch.empty(2, 3, 4, device=device())

    def host_read(*args, **kwargs):
        raise AssertionError("static_decode read a tensor value on the host")

    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
            patch.setattr(torch.Tensor, name, host_read)
        out, lse = static_decode(*args, plan, 0.1, page_list, 5, pm)
    assert plan.num_splits == 2 and torch.isfinite(lse).all()


@triton.jit
def _range_probe(page_list, seq_lens, lo_out, hi_out, window_left, n_listed, SPLITS: tl.constexpr,
                 PPS: tl.constexpr, PAGE: tl.constexpr, HAS_LIST: tl.constexpr, SCAN: tl.constexpr):
    c = tl.program_id(0)
    n = tl.load(seq_lens)
    i0 = c * PPS
    lo, hi = _listed_range(page_list, i0, tl.minimum(i0 + PPS, n_listed), tl.maximum(n - 1 - window_left, 0) // PAGE,
                           (n + PAGE - 1) // PAGE, HAS_LIST, SCAN)
    tl.store(lo_out + c, lo)
    tl.store(hi_out + c, hi)


@pytest.mark.parametrize("has_list", [False, True])
def test_window_skips_whole_blocks(has_list):
    """A 32k-token sequence with a 4k window walks ~4k tokens of pages (summed over its splits), not 32k."""
    page, splits, pps = 16, 16, 160
    n_listed = splits * pps  # 2560 listed entries, 2048 real pages and padding
    seq_len, window = 32 * 1024 - 5, 4096
    page_list = torch.cat([torch.arange(2048), torch.full((n_listed - 2048,), -1)]).int().to(device())
    lo, hi = (torch.empty(splits, dtype=torch.int32, device=device()) for _ in range(2))
    _range_probe[(splits,)](page_list, torch.tensor([seq_len], dtype=torch.int32, device=device()), lo, hi, window,
                            n_listed, SPLITS=splits, PPS=pps, PAGE=page, HAS_LIST=has_list, SCAN=64)
    walked = (hi - lo).clamp(min=0)
    first = (seq_len - 1 - window) // page
    assert walked.sum().item() == -(-seq_len // page) - first  # exactly the pages of the window
    assert lo[walked > 0].min().item() == first and hi[walked > 0].max().item() == 2048


def test_plan_fills_the_gpu_and_covers_the_list(monkeypatch):
    config = DecodeConfig(block_n=64, ctas_per_sm=4, min_split_tokens=256)
    one = plan_static_decode(1, 2048, 32, 8, 128, 16, "cpu", config=config)  # 4 SMs x 4 programs under the CPU
    assert one.num_splits * 8 >= 16 and one.pages_per_split % 4 == 0
    assert one.num_splits * one.pages_per_split >= 2048 > (one.num_splits - 1) * one.pages_per_split
    assert one.part_out.shape == (one.num_splits, 1, 32, 128) and one.part_lse.shape == (one.num_splits, 1, 32)
    many = plan_static_decode(64, 2048, 32, 8, 128, 16, "cpu", config=config)
    assert many.num_splits == 1 and many.part_out is None
    listed = plan_static_decode(2, 100, 8, 2, 64, 8, "cpu", max_listed=10, config=DecodeConfig(block_n=16))
    assert listed.max_listed == 10 and listed.num_splits * listed.pages_per_split >= 10
    short = plan_static_decode(1, 4, 8, 2, 64, 16, "cpu", config=config)  # min_split_tokens keeps one split
    assert short.num_splits == 1
    monkeypatch.setattr(static_module, "num_multiprocessors", lambda device: 132)  # an H200
    h200 = plan_static_decode(1, 2048, 32, 8, 128, 16, "cpu", config=config)  # 32k tokens, 8 kv heads
    assert (h200.num_splits, h200.pages_per_split) == (64, 32)  # 512 programs for 528 slots; 512 tokens each
    mqa = plan_static_decode(1, 8192, 8, 1, 128, 16, "cpu", config=DecodeConfig(min_split_tokens=16))
    assert mqa.num_splits == MAX_SPLITS


def test_a_wider_page_list_than_planned_is_refused():
    plan = plan_static_decode(1, 8, 4, 1, 32, 16, "cpu", max_listed=2, config=DecodeConfig(block_n=16))
    q = torch.zeros(1, 4, 32)
    pool = torch.zeros(2, 2, 16, 1, 32)
    bt, lens = torch.zeros(1, 8, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="listed pages exceed"):
        static_decode(q, pool, None, bt, lens, plan, 1.0)  # all 8 pages, planned for 2


def span_oracle(q, keys, values, seq_lens, lists, spans, window_left, page, sm_scale, key_list=False):
    """Float64 token by token, per kv head's own list, with a token budget's spans (or, ``key_list``, lists of key
    positions: entry i is key ``lists[..., i]``): out, lse, page_max and page_lse ``[B, K, H]``."""
    batch, heads, dim = q.shape
    n_kv = keys.shape[2]
    group = heads // n_kv
    K = lists.shape[-1]
    out = torch.zeros(batch, heads, dim, dtype=torch.float64)
    lse = torch.full((batch, heads), -math.inf, dtype=torch.float64)
    pmax = torch.full((batch, K, heads), -math.inf, dtype=torch.float64)
    plse = torch.full((batch, K, heads), -math.inf, dtype=torch.float64)
    for b, n in enumerate(seq_lens):
        sinks, win = spans[b] if spans is not None else (0, 0)
        lo = max(n - 1 - window_left, 0) if window_left >= 0 else 0
        for g in range(n_kv):
            row = lists[b, g if lists.shape[1] > 1 else 0].tolist()
            toks = []
            for i, p in enumerate(row):
                shown = ([p] if p >= 0 else []) if key_list else range(p * page, (p + 1) * page) if p >= 0 else ()
                for t in shown:
                    visible = key_list or t < sinks or t >= win or -(-sinks // page) <= p < win // page
                    if lo <= t < n and visible:
                        toks.append((i, t))
            if not toks:
                continue
            rows = torch.tensor([t for _, t in toks])
            owner = torch.tensor([i for i, _ in toks])
            hs = slice(g * group, (g + 1) * group)
            logits = torch.einsum("hd,sd->hs", q[b, hs].double(), keys[b, rows, g].double()) * sm_scale  # [G, S]
            lse[b, hs] = torch.logsumexp(logits, -1)
            out[b, hs] = torch.softmax(logits, -1) @ values[b, rows, g].double()
            for i in owner.unique().tolist():
                pmax[b, i, hs] = logits[:, owner == i].amax(-1)
                plse[b, i, hs] = torch.logsumexp(logits[:, owner == i], -1)
    return out, lse, pmax, plse


@pytest.mark.parametrize("per_head,window,tokens", [(False, -1, False), (True, -1, False), (True, 30, False),
                                                    (True, -1, True), (False, 30, True)])
def test_spans_per_head_lists_page_lse_and_a_staging_pool(per_head, window, tokens):
    """A token budget's spans (sinks cut mid-page, the window's first page cut), per-kv-head page lists,
    per-page LSE, pages in a third (staging) pool, and key lists (``tokens``: random keys in random order, -1 and
    keys past the row included, no spans): kernel and reference against a float64 oracle."""
    gen = torch.Generator().manual_seed(11 + window)
    seq_lens, max_pages, page, n_kv, group, dim = [70, 53, 20], 9, 8, 2, 2, 32
    q, keys, values, dev_pool, host_pool, table = random_case(seq_lens, max_pages, page, n_kv, group, dim,
                                                              torch.float32, 0.4, gen)
    stage_pool = torch.randn(5, *dev_pool.shape[1:], generator=gen)
    for b, p, s in ((0, 2, 1), (1, 3, 4), (2, 0, 0)):  # move three pages to the staging pool
        stage_pool[s] = torch.stack([keys[b, p * page:(p + 1) * page], values[b, p * page:(p + 1) * page]])
        table[b, p] = -(1 << 30) - s
    K = 37 if tokens else 5
    lists = torch.full((len(seq_lens), n_kv if per_head else 1, K), -1, dtype=torch.int32)
    for b, n in enumerate(seq_lens):
        for h in range(lists.shape[1]):
            picked = torch.randperm(n + 3 if tokens else -(-n // page), generator=gen)[:K]  # keys: some past n
            lists[b, h, :picked.numel()] = picked.int()
    spans = None if tokens else torch.tensor([[4, 61], [3, 5], [0, 0]], dtype=torch.int32)  # row 1: window in the
    heads = n_kv * group  # sink page; 2: none
    plan = plan_static_decode(len(seq_lens), max_pages, heads, n_kv, dim, page, device(), K,
                              DecodeConfig(block_n=16, pages_per_split=2 * (page if tokens else 1)), keys=tokens)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    listed = lists if per_head else lists[:, 0].contiguous()
    page_list, key_list = (None, listed) if tokens else (listed, None)
    to = lambda x: None if x is None else x.to(device())  # noqa: E731
    pm, pl = (torch.empty(len(seq_lens), K, heads, device=device()) for _ in range(2))
    out, lse = static_decode(to(q), to(dev_pool), host(host_pool), to(table), to(lens), plan, dim ** -0.5,
                             to(page_list), window, pm, pl, to(spans), host(stage_pool), to(key_list))
    pm_r, pl_r = torch.empty(len(seq_lens), K, heads), torch.empty(len(seq_lens), K, heads)
    ref = static_decode_reference(q, dev_pool, host_pool, table, lens, plan, dim ** -0.5, page_list, window,
                                  pm_r, pl_r, spans, stage_pool, key_list)
    o_out, o_lse, o_pm, o_pl = span_oracle(q, keys, values, seq_lens, lists, None if tokens else spans.tolist(),
                                           window, page, dim ** -0.5, tokens)
    for got in ((out, lse, pm), (*ref, pm_r)):
        assert_close(got, (o_out, o_lse, o_pm), torch.float32, "page_max")
    for got in (pl, pl_r):
        assert_close((out, lse, got), (o_out, o_lse, o_pl), torch.float32, "page_lse")


def landing_oracle(lists, table, seq_lens, page, window_left, cap, spans=None):
    """Entry by entry: the row's r-th listed page at home on the host (live pages only) lands in slot r when every
    one of its keys is shown (window, spans) and r < cap: ``land_index [B, K]`` (r or -1)."""
    out = torch.full(lists.shape, -1, dtype=torch.int32)
    for b, n in enumerate(seq_lens):
        lo = max(n - 1 - window_left, 0) if window_left >= 0 else 0
        r = 0
        for i, p in enumerate(lists[b].tolist()):
            if not 0 <= p < -(-n // page) or not -(1 << 30) < int(table[b, p]) < 0:
                continue
            shown = []
            for t in range(p * page, (p + 1) * page):
                visible = lo <= t < n
                if spans is not None:
                    sinks, win = spans[b].tolist()
                    visible &= t < sinks or t >= win or -(-sinks // page) <= p < win // page
                shown.append(visible)
            if all(shown) and r < cap:
                out[b, i] = r
            r += 1
    return out


@pytest.mark.parametrize("dtype,window,budget,config", [
    (torch.float32, -1, "", DecodeConfig(block_n=16, pages_per_split=2)),  # splits of one 2-page block
    (torch.float16, 45, "", DecodeConfig(block_n=32, pages_per_split=4)),  # a window cutting a page; skipped blocks
    (torch.float32, -1, "spans", None),  # sinks and window cut pages; the default launch shape
])
def test_pages_read_whole_from_the_host_land_in_their_slots(dtype, window, budget, config):
    """The decode lands each row's r-th listed host page that it read whole in the row's landing slot r (r below
    the slots' count; a page cut by the window, the spans, the token bits or the sequence's end does not land):
    kernel and reference write the entry-by-entry oracle's ``land_index``, the slots hold those pages' K and V,
    no other device slot changes, and the attention is the same as without landing."""
    gen = torch.Generator().manual_seed(17 + window)
    seq_lens, max_pages, page, n_kv, group, dim, K, cap = [75, 0, 58, 120], 16, 8, 2, 2, 32, 9, 4
    q, keys, values, dev_pool, host_pool, table = random_case(seq_lens, max_pages, page, n_kv, group, dim, dtype, 0.6,
                                                              gen)
    B = len(seq_lens)
    lists = torch.full((B, K), -1, dtype=torch.int32)
    for b, n in enumerate(seq_lens):
        pages = torch.randperm(max(-(-n // page), 1), generator=gen)[:K - 1]
        lists[b, :pages.numel()] = pages.sort().values.int()  # a -1 left in every row
    lists[3, -1] = 15  # past the sequence's pages
    spans = torch.tensor([[5, 60], [0, 0], [3, 50], [9, 100]], dtype=torch.int32) if budget == "spans" else None
    spare = dev_pool.shape[0]
    dev_pool = torch.cat([dev_pool, torch.randn(B * cap, *dev_pool.shape[1:], generator=gen).to(dtype)])
    land_slots = (spare + torch.randperm(B * cap, generator=gen)).view(B, cap)  # [B, cap] each row's landing slots
    heads = n_kv * group
    plan = plan_static_decode(B, max_pages, heads, n_kv, dim, page, device(), K, config)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    want = landing_oracle(lists, table, seq_lens, page, window, cap, spans)
    assert (want >= 0).sum() >= 4 and ((want < 0) & (lists >= 0)).sum() >= 4  # pages that land, pages that do not
    to = lambda x: None if x is None else x.to(device())  # noqa: E731
    args = (to(table), to(lens), plan, dim ** -0.5, to(lists), window, None, None, to(spans))
    plain = static_decode(to(q), to(dev_pool), host(host_pool), *args)
    for decode, pool_of in ((static_decode, to), (static_decode_reference, lambda x: x)):
        pool, index = pool_of(dev_pool.clone()), torch.full((B, K + 2), 7, dtype=torch.int32, device=device())
        got = decode(to(q), pool, host(host_pool), *args, land_slots=to(land_slots), land_index=index)
        assert torch.equal(index[:, :K].cpu(), want) and (index[:, K:] == 7).all(), decode.__name__
        for b, i in (want >= 0).nonzero().tolist():
            p, slot = int(lists[b, i]), int(land_slots[b, want[b, i]])
            kv = torch.stack([keys[b, p * page:(p + 1) * page], values[b, p * page:(p + 1) * page]])
            assert torch.equal(pool[slot].cpu(), kv), (decode.__name__, b, i)
        landed = torch.zeros(pool.shape[0], dtype=torch.bool)
        landed[land_slots.gather(1, want.clamp(min=0).long())[want >= 0]] = True
        assert torch.equal(pool[~landed.to(pool.device)].cpu(), dev_pool[~landed]), decode.__name__
        assert (got[0].cpu() - plain[0].cpu()).abs().max() <= TOL[dtype] * plain[0].abs().max().cpu(), decode.__name__


@pytest.mark.parametrize("per_head", [False, True])
def test_the_reference_reads_a_static_width_list_as_its_listed_part(per_head):
    """A list padded to a static width with -1 (as the engine's ``resident`` lists, ``max_pages`` wide): the
    reference, which leaves the padding out, gives the kernel's output, LSE, page statistics and landing slots on
    the unpadded list, and -inf and -1 on the padding (spans and landing on)."""
    gen = torch.Generator().manual_seed(5)
    seq_lens, max_pages, page, n_kv, group, dim, K, pad, cap = [75, 0, 58, 120], 16, 8, 2, 2, 32, 6, 7, 2
    q, _, _, dev_pool, host_pool, table = random_case(seq_lens, max_pages, page, n_kv, group, dim, torch.float32,
                                                      0.6, gen)
    B, h = len(seq_lens), n_kv if per_head else 1
    lists = torch.stack([torch.randperm(max_pages, generator=gen)[:K].sort().values for _ in range(B * h)]).int()
    lists[::3, -2:] = -1  # some rows end early
    spans = torch.tensor([[5, 60], [0, 0], [3, 50], [9, 100]], dtype=torch.int32)
    dev_pool = torch.cat([dev_pool, torch.zeros(B * cap, *dev_pool.shape[1:])])
    land = (dev_pool.shape[0] - B * cap + torch.arange(B * cap)).view(B, cap)
    to = lambda x: None if x is None else x.to(device())  # noqa: E731
    runs = []
    for decode, width in ((static_decode, K), (static_decode_reference, K + pad)):
        widen = lambda x: torch.cat([x, torch.full((x.shape[0], width - K), -1, dtype=x.dtype)], 1)  # noqa: E731
        stats = [torch.zeros(B, width * h, n_kv * group, device=device()) for _ in range(2)]
        index = torch.zeros(B, width, dtype=torch.int32, device=device())
        pool = to(dev_pool.clone())
        plan = plan_static_decode(B, max_pages, n_kv * group, n_kv, dim, page, device(), width * h)
        out, lse = decode(to(q), pool, host(host_pool), to(table), to(torch.tensor(seq_lens, dtype=torch.int32)),
                          plan, dim ** -0.5, to(widen(lists).view(B, -1)), -1, *stats, to(spans), None, None,
                          *((to(land), index) if not per_head else (None, None)))
        runs.append([x.cpu() for x in (out, lse, *(s.view(B, h, width, -1) for s in stats), index, pool)])
    (out, lse, page_max, page_lse, index, pool), (out2, lse2, page_max2, page_lse2, index2, pool2) = runs
    close = lambda a, b: torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # noqa: E731
    close(out2, out), close(lse2, lse), close(pool2, pool)
    for a, b in ((page_max, page_max2), (page_lse, page_lse2)):
        close(b[:, :, :K], a)
        assert (b[:, :, K:] == float("-inf")).all()
    if not per_head:
        assert torch.equal(index2[:, :K], index) and (index2[:, K:] == -1).all() and (index >= 0).any()


def test_landing_needs_a_row_list_a_host_pool_and_both_tensors():
    plan = plan_static_decode(1, 4, 2, 1, 32, 16, "cpu", max_listed=2, config=DecodeConfig(block_n=16))
    q, pool = torch.zeros(1, 2, 32), torch.zeros(3, 2, 16, 1, 32)
    bt, lens, lists = torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32), torch.zeros(1, 2).int()
    slots, index = torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 2, dtype=torch.int32)
    for decode in (static_decode, static_decode_reference):
        with pytest.raises(ValueError, match="together"):
            decode(q, pool, pool, bt, lens, plan, 1.0, lists, land_slots=slots)
        with pytest.raises(ValueError, match="per-sequence page_list"):
            decode(q, pool, None, bt, lens, plan, 1.0, lists, land_slots=slots, land_index=index)
        with pytest.raises(ValueError, match="int32 land_index"):
            decode(q, pool, pool, bt, lens, plan, 1.0, lists, land_slots=slots, land_index=index.long())


def test_a_key_list_needs_its_own_plan_and_no_spans_landing_or_int8():
    plan = plan_static_decode(1, 4, 2, 1, 32, 16, "cpu", max_listed=2, config=DecodeConfig(block_n=16))
    keyed = plan_static_decode(1, 4, 2, 1, 32, 16, "cpu", max_listed=2, config=DecodeConfig(block_n=16), keys=True)
    q, pool = torch.zeros(1, 2, 32), torch.zeros(3, 2, 16, 1, 32)
    bt, lens, keys = torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32), torch.zeros(1, 2).int()
    for decode in (static_decode, static_decode_reference):
        with pytest.raises(ValueError, match="plan made for key lists"):
            decode(q, pool, None, bt, lens, plan, 1.0, key_list=keys)
        with pytest.raises(ValueError, match="pass key_list"):
            decode(q, pool, None, bt, lens, keyed, 1.0, keys)
        with pytest.raises(ValueError, match="takes the place of page_list"):
            decode(q, pool, None, bt, lens, keyed, 1.0, keys, key_list=keys)
        with pytest.raises(ValueError, match="spans"):
            decode(q, pool, None, bt, lens, keyed, 1.0, key_list=keys, spans=torch.zeros(1, 2, dtype=torch.int32))
        with pytest.raises(ValueError, match="lands whole pages"):
            decode(q, pool, pool, bt, lens, keyed, 1.0, key_list=keys, land_slots=torch.zeros(1, 2).long(),
                   land_index=torch.zeros(1, 2, dtype=torch.int32))
        with pytest.raises(ValueError, match="int8 pages"):
            decode(q, torch.zeros(3, 2, 19, 1, 32, dtype=torch.int8), None, bt, lens, keyed, 1.0, key_list=keys)
