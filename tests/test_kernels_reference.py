"""The torch reference backend against plain dense softmax attention, LSE merging, page salience.

``random_paged_batch`` (also used by the Triton tests) scatters fresh random contiguous K/V into
randomly permuted page slots, so every check compares the paged path with an independent dense
computation in float64 on the contiguous tensors.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvtier.kernels.base import PagedBatch, page_salience
from kvtier.kernels.merge import merge_many, merge_states
from kvtier.kernels.reference import TorchBackend, paged_attention_reference


def random_paged_batch(kv_lens, q_lens, page_size, num_kv_heads, head_dim, num_qo_heads, dtype=torch.float32,
                       causal=False, spare_slots=5, generator=None, window_left=-1):
    """Random q, paged pool and batch. Returns ``(q [Nq, H, D], pool, batch, keys, values)``.

    ``keys[b]`` / ``values[b]`` are sequence b's contiguous ``[S_b, N_kv, D]`` tensors that were
    scattered into the pool's ``[slots, 2, P, N_kv, D]`` pages (slots in random order, with spare
    random-filled slots that no sequence lists).
    """
    g = generator
    npages = [-(-n // page_size) for n in kv_lens]
    nnz = sum(npages)
    slots = nnz + spare_slots
    pool = torch.randn(slots, 2, page_size, num_kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(slots, generator=g)[:nnz]  # [nnz]
    keys, values = [], []
    offset = 0
    for n, np_ in zip(kv_lens, npages):
        k = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)  # [S, N_kv, D]
        v = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        for p in range(np_):
            rows = slice(p * page_size, min((p + 1) * page_size, n))
            fill = rows.stop - rows.start
            pool[perm[offset + p], 0, :fill] = k[rows]
            pool[perm[offset + p], 1, :fill] = v[rows]
        keys.append(k)
        values.append(v)
        offset += np_
    q = torch.randn(sum(q_lens), num_qo_heads, head_dim, generator=g).to(dtype)  # [Nq, H, D]
    kv_indptr = torch.tensor([0] + npages).cumsum(0).int()  # [B+1]
    last = torch.tensor([n - (np_ - 1) * page_size if np_ else 0 for n, np_ in zip(kv_lens, npages)]).int()
    batch = PagedBatch(torch.tensor([0] + list(q_lens)).cumsum(0).int(), kv_indptr, perm.int(), last, page_size,
                       causal, window_left=window_left)
    return q, pool, batch, keys, values


def dense_attention(q, keys, values, q_lens, page_size, sm_scale, causal, window_left=-1, head_masks=None):
    """Per sequence, float64 softmax attention on contiguous K/V (bottom-right aligned; a window of
    ``window_left + 1`` keys per query when ``window_left >= 0``; ``head_masks``: per sequence
    ``[n_pages, N_kv]`` bool, the pages each kv head sees).

    Returns out ``[Nq, H, D]``, lse ``[Nq, H]`` and a list of per-sequence
    ``(probs [H, n, S], page_max [n_pages, H])``.
    """
    outs, lses, extras = [], [], []
    q0 = 0
    for b, (k, v, n) in enumerate(zip(keys, values, q_lens)):
        qb = q[q0:q0 + n].double()  # [n, H, D]
        q0 += n
        heads, s_len = qb.shape[1], k.shape[0]
        group = heads // k.shape[1]
        kh = k.double().repeat_interleave(group, dim=1)  # [S, H, D]
        vh = v.double().repeat_interleave(group, dim=1)
        logits = torch.einsum("nhd,shd->hns", qb, kh) * sm_scale  # [H, n, S]
        pos = (s_len - n + torch.arange(n))[:, None]  # [n, 1] position of each query
        key = torch.arange(s_len)[None, :]  # [1, S]
        allowed = (key <= pos if causal else torch.ones(n, s_len, dtype=torch.bool)) & (
            key >= pos - window_left if window_left >= 0 else True)  # [n, S]
        logits = logits.masked_fill(~allowed, -math.inf)
        if head_masks is not None:
            seen = head_masks[b].repeat_interleave(page_size, 0)[:s_len].T.repeat_interleave(group, 0)  # [H, S]
            logits = logits.masked_fill(~seen[:, None, :], -math.inf)
        lse = torch.logsumexp(logits, -1)  # [H, n]
        probs = torch.nan_to_num(torch.softmax(logits, -1))  # [H, n, S]; rows with no key -> 0
        outs.append(torch.einsum("hns,shd->nhd", probs, vh))
        lses.append(lse.T)
        n_pages = -(-s_len // page_size)
        padded = torch.full((heads, n, n_pages * page_size), -math.inf, dtype=torch.float64)
        padded[..., :s_len] = logits
        extras.append((probs, padded.view(heads, n, n_pages, page_size).amax(dim=(1, 3)).T))
    return torch.cat(outs), torch.cat(lses), extras


def rel_err(x, ref):
    x, ref = x.double(), ref.double()
    assert not torch.isnan(x).any()
    return ((x - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_reference_matches_dense(causal, group):
    gen = torch.Generator().manual_seed(100 + group + 10 * causal)
    kv_lens, q_lens = [37, 16, 50], [5, 16, 1]
    q, pool, batch, keys, values = random_paged_batch(kv_lens, q_lens, 8, 2, 16, 2 * group, causal=causal,
                                                      generator=gen)
    scale = 16 ** -0.5
    res = paged_attention_reference(q, pool, batch, scale, return_page_max=True)
    out, lse, extras = dense_attention(q, keys, values, q_lens, 8, scale, causal)
    assert res.out.shape == q.shape and res.lse.shape == q.shape[:2]
    assert rel_err(res.out, out) < 1e-5
    assert torch.allclose(res.lse.double(), lse, atol=1e-4)
    assert torch.allclose(res.page_max.double(), torch.cat([e[1] for e in extras]), atol=1e-4)


def random_head_mask(batch, num_kv_heads, generator):
    """A random per-head page choice ``[nnz, N_kv]`` (each sequence's last page seen by every head)
    and its per-sequence split."""
    mask = torch.rand(batch.kv_indices.numel(), num_kv_heads, generator=generator) < 0.5
    indptr = batch.kv_indptr.long()
    mask[indptr[1:][indptr[1:] > indptr[:-1]] - 1] = True
    return mask, [mask[indptr[b]:indptr[b + 1]] for b in range(batch.batch_size)]


@pytest.mark.parametrize("causal,q_lens", [(False, [1, 1, 1]), (True, [5, 16, 1])])
def test_reference_head_mask_matches_dense(causal, q_lens):
    """Per-head page choice: kv head h (and its query heads) sees only the listed pages given to it."""
    gen = torch.Generator().manual_seed(300 + causal)
    kv_lens = [37, 16, 50]
    q, pool, batch, keys, values = random_paged_batch(kv_lens, q_lens, 8, 2, 16, 6, causal=causal, generator=gen)
    batch.head_mask, per_seq = random_head_mask(batch, 2, gen)
    assert not batch.head_mask.all()
    res = paged_attention_reference(q, pool, batch, 0.25, return_page_max=True)
    out, lse, extras = dense_attention(q, keys, values, q_lens, 8, 0.25, causal, head_masks=per_seq)
    assert rel_err(res.out, out) < 1e-5 and torch.allclose(res.lse.double(), lse, atol=1e-4)
    page_max = torch.cat([e[1] for e in extras])  # [nnz, H]
    assert torch.equal(torch.isfinite(res.page_max), torch.isfinite(page_max))  # -inf: pages a head is not given
    unmasked = dense_attention(q, keys, values, q_lens, 8, 0.25, causal)[0]
    assert rel_err(unmasked, out) > 0.1  # the mask really changes the result


@pytest.mark.parametrize("causal,window_left,q_lens", [
    (True, 9, [5, 16, 1]),  # prefill chunks and a decode row, window inside a page
    (True, 0, [3, 1, 2]),  # a window of one key: each query sees itself only
    (False, 12, [1, 1, 1]),  # decode rows without the causal flag (the salience pass)
])
def test_reference_sliding_window_matches_dense(causal, window_left, q_lens):
    gen = torch.Generator().manual_seed(200 + window_left)
    kv_lens = [37, 16, 50]
    q, pool, batch, keys, values = random_paged_batch(kv_lens, q_lens, 8, 2, 16, 6, causal=causal, generator=gen,
                                                      window_left=window_left)
    res = paged_attention_reference(q, pool, batch, 0.25, return_page_max=True)
    out, lse, extras = dense_attention(q, keys, values, q_lens, 8, 0.25, causal, window_left)
    assert rel_err(res.out, out) < 1e-5 and torch.allclose(res.lse.double(), lse, atol=1e-4)
    page_max = torch.cat([e[1] for e in extras])  # [nnz, H]
    assert torch.equal(torch.isfinite(res.page_max), torch.isfinite(page_max))  # -inf: pages left of every window
    assert torch.isneginf(res.page_max[0]).all()  # page 0 of sequence 0 is outside every window
    fin = torch.isfinite(page_max)
    assert torch.allclose(res.page_max[fin].double(), page_max[fin], atol=1e-4)
    no_window = dense_attention(q, keys, values, q_lens, 8, 0.25, causal)[0]
    assert rel_err(no_window, out) > 0.1  # the window really changes the result


def test_reference_row_without_keys_is_zero_with_minus_inf_lse():
    gen = torch.Generator().manual_seed(7)
    q, pool, batch, keys, values = random_paged_batch([3, 0], [5, 2], 4, 1, 8, 2, causal=True, generator=gen)
    res = paged_attention_reference(q, pool, batch, 8 ** -0.5)
    # sequence 0: 5 queries over 3 keys, bottom-right aligned: the first two rows see nothing
    assert torch.isneginf(res.lse[:2]).all() and torch.isfinite(res.lse[2:5]).all()
    assert (res.out[:2] == 0).all() and (res.out[5:] == 0).all() and torch.isneginf(res.lse[5:]).all()


def test_merge_states_is_exact_over_disjoint_pages():
    gen = torch.Generator().manual_seed(3)
    q, pool, batch, keys, values = random_paged_batch([40, 24], [1, 1], 8, 2, 16, 4, generator=gen)
    backend = TorchBackend()
    backend.plan(batch, 4, 2, 16)
    full = backend.run(q, pool)
    # the first two pages of each sequence vs the rest
    head = PagedBatch(batch.qo_indptr, torch.tensor([0, 2, 4]).int(), batch.kv_indices[[0, 1, 5, 6]],
                      torch.tensor([8, 8]).int(), 8)
    tail = PagedBatch(batch.qo_indptr, torch.tensor([0, 3, 4]).int(), batch.kv_indices[[2, 3, 4, 7]],
                      batch.kv_last_page_len, 8)
    a = paged_attention_reference(q, pool, head, backend.sm_scale)
    b = paged_attention_reference(q, pool, tail, backend.sm_scale)
    out, lse = merge_states(a.out, a.lse, b.out, b.lse)
    assert rel_err(out, full.out) < 1e-6
    assert torch.allclose(lse, full.lse, atol=1e-5)
    empty = torch.full_like(a.lse, -math.inf)
    out_e, lse_e = merge_many([(a.out, a.lse), (torch.randn_like(a.out), empty)])
    assert torch.equal(out_e, a.out) and torch.equal(lse_e, a.lse)


def test_page_salience_matches_eager_probabilities():
    gen = torch.Generator().manual_seed(11)
    kv_lens, group, n_kv, page = [29, 64, 9], 3, 2, 8
    q, pool, batch, keys, values = random_paged_batch(kv_lens, [1, 1, 1], page, n_kv, 16, n_kv * group,
                                                      generator=gen)
    res = paged_attention_reference(q, pool, batch, 0.25, return_page_max=True)
    sal = page_salience(res.page_max, res.lse, batch, n_kv)  # [nnz, N_kv]
    *_, extras = dense_attention(q, keys, values, [1, 1, 1], page, 0.25, False)
    expect = []
    for (probs, _), s_len in zip(extras, kv_lens):
        n_pages = -(-s_len // page)
        padded = torch.zeros(n_kv * group, n_pages * page, dtype=torch.float64)
        padded[:, :s_len] = probs[:, 0]
        per_head = padded.view(n_kv * group, n_pages, page).amax(-1)  # [H, n_pages]
        expect.append(per_head.view(n_kv, group, n_pages).amax(1).T)  # [n_pages, N_kv]
    assert torch.allclose(sal.double(), torch.cat(expect), atol=1e-5)
    with pytest.raises(ValueError):
        page_salience(res.page_max, res.lse, PagedBatch(torch.tensor([0, 2, 3, 4]).int(), batch.kv_indptr,
                                                        batch.kv_indices, batch.kv_last_page_len, page), n_kv)
