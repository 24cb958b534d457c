"""Paged decode attention, one kernel for every caller: static shapes, graph-capturable, tiers read in place.

One query row per sequence. Every input has a shape fixed by the batch bucket, and the launch
needs no host work or sync, so a model step that uses it can be captured once in a CUDA graph and
replayed every token while sequences grow, join and finish (only tensor contents change).

A sequence's page ``p`` lives at ``block_table[b, p]``: ``x >= 0`` is slot ``x`` of the device
pool, ``-STAGED < x < 0`` slot ``-x - 1`` of the pinned host pool, ``x <= -STAGED`` slot
``-x - STAGED`` of the pinned staging pool (disk and remote pages copied there before the step);
host memory is read in place through its mapped (UVA) address (see :mod:`kvtier.mover.copy_kernel`):
a miss costs PCIe bandwidth, not a sync. The sequence attends its listed pages (``page_list[b]``, one
list per sequence or per (sequence, kv head), or all its logical pages), keys ``j < seq_len``, with a
window ``j >= seq_len - 1 - window_left`` (FlashInfer semantics), with a token budget's spans
only the sinks of the sink pages and the window's tokens of the window's pages; or it attends a list of single
keys (``key_list``: positions, a choice finer than the page that moves, each key read through its page's entry).

The grid is static: ``(B * num_splits, N_kv)``. Split ``c`` of sequence ``b`` covers listed
indices ``[c * pps, (c + 1) * pps)`` and walks only the blocks that hold a counted key (a 32k
sequence with a 4k window reads ~4k tokens); all query heads of a kv group are the rows of one
``tl.dot`` tile (padded to 16 rows). :func:`~kvtier.kernels.triton_prefill.merge_splits` combines the
splits by their LSE, or the split kernel writes the output directly when ``num_splits == 1``. Per listed page the kernel can also
write the max (salience) and the log-sum-exp (attention mass) of its scaled logits.

:class:`TritonBackend` runs this kernel for :class:`~kvtier.kernels.base.PagedBatch` decode calls (their
page lists turned into a block table) and :mod:`kvtier.kernels.triton_prefill` for prefill calls.
Softmax runs in base 2 (``exp2``) with fp32 accumulation; LSE and page statistics are returned in
natural-log units.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch
import triton
import triton.language as tl

from kvtier.errors import ConfigError
from kvtier.kernels.base import (DROPPED as DROPPED_SLOT, STAGED as STAGED_SLOTS, AttentionBackend, AttentionOutput,
                                 Capabilities, PagedBatch, check_key_list, check_landing, to_device)
from kvtier.kernels.triton_prefill import (LN2, LOG2E, PrefillConfig, check_page_size, dot_operand_dtype, finish_rows,
                                           MIN_DOT, fit_shared_memory, int8_tile, merge_splits, num_multiprocessors,
                                           online_softmax_step, paged_prefill, plan_prefill, query_operand, value_operand)
from kvtier.quant import INT8, is_scaled_pool

MAX_SPLITS = 128  # most splits per sequence that plan_static_decode chooses
STAGED = tl.constexpr(STAGED_SLOTS)  # block-table values <= -STAGED are slots of the staging pool
DROPPED = tl.constexpr(DROPPED_SLOT)  # the block-table value of a page dropped for good


@dataclass(frozen=True)
class DecodeConfig:
    """Launch shape of the split kernel. ``pages_per_split=None`` lets ``plan`` size the splits."""

    block_n: int = 64  # tokens per loop iteration (a multiple of the page size)
    num_warps: int = 4
    num_stages: int = 3
    ctas_per_sm: int = 4  # target programs per multiprocessor when sizing the splits
    min_split_tokens: int = 256  # shortest split worth a partial write and a merge
    pages_per_split: int | None = None
    maxnreg: int | None = None  # registers per thread the compiler may use (None: its choice)


def default_decode_config(head_dim: int, kv_bytes: int = 2) -> DecodeConfig:
    """Launch shape for ``head_dim`` and pages of ``kv_bytes`` per value (1: FP8), tuned on an H200 with
    Triton 3.6 (``bench/kernels.py --tune``; re-tune when Triton changes).

    16-bit pages: D=128, 64-token steps, 3 stages, registers capped at 128 so that four programs fit a
    multiprocessor (the same time without ``page_max``);
    small heads, 128-token steps (the bytes of 64 tokens at D=128) with 5 stages, since the page-index
    load takes a pipeline stage of its own. FP8 pages: D=128, 128-token steps (the bytes of bf16's 64)
    capped at 128 registers (0.470 against 0.532 ms uncapped at B=64 x 8k); small heads, 64-token steps
    with 3 stages (0.139 against 0.145 ms for the 16-bit shape at B=16 x 32k).
    """
    if head_dim <= 64:
        if kv_bytes == 1:
            return DecodeConfig(block_n=64, num_warps=4, num_stages=3, ctas_per_sm=4)
        return DecodeConfig(block_n=128, num_warps=4, num_stages=5, ctas_per_sm=2)
    return DecodeConfig(block_n=128 if kv_bytes == 1 else 64, maxnreg=128)


@triton.jit
def page_maxima(s, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, WITH_LSE: tl.constexpr):
    """Max and (``WITH_LSE``) log-sum-exp of the logits ``s [G, N]`` (log2 units) over each page of the block:
    ``([G, N / PAGE], [G, N / PAGE])``."""
    pages = tl.reshape(s, [BLOCK_G, BLOCK_N // PAGE, PAGE])
    pm = tl.max(pages, axis=2)
    if WITH_LSE:
        safe = tl.where(pm == float("-inf"), 0.0, pm)
        pl = safe + tl.log2(tl.sum(tl.exp2(pages - safe[:, :, None]), axis=2))  # -inf for a page of no key
    else:
        pl = pm
    return pm, pl


@dataclass(frozen=True, eq=False)
class StaticDecodePlan:
    """Launch shape of one batch bucket, fixed at capture time from shapes only, and the partials' buffers."""

    batch_size: int
    max_pages: int  # block_table width
    max_listed: int  # listed pages the splits cover (page_list width, or max_pages)
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_splits: int  # splits per sequence
    pages_per_split: int  # listed entries per split, a multiple of block_n // entry_tokens
    block_n: int
    config: DecodeConfig
    part_out: torch.Tensor | None = field(repr=False)  # [splits, B, H, D] fp32; None: one split
    part_lse: torch.Tensor | None = field(repr=False)  # [splits, B, H] fp32 (log2 units)
    entry_tokens: int = 0  # keys per listed entry: the page size (page lists), or 1 (key lists)


def plan_static_decode(batch_size: int, max_pages: int, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                       page_size: int, device, max_listed: int | None = None,
                       config: DecodeConfig | None = None, kv_bytes: int = 2, keys: bool = False) -> StaticDecodePlan:
    """Size the splits so that ``B x splits x N_kv`` programs fill the GPU at the bucket's longest context.

    ``max_listed`` is the page_list width (None: every sequence attends all its ``max_pages``
    pages), or with ``keys`` the key_list width; ``kv_bytes`` the pools' bytes per value (1 for FP8 pages), which
    picks the default config. Host work on static numbers only; allocates the partials when there is more than one
    split.
    """
    check_page_size(page_size)
    config = default_decode_config(head_dim, kv_bytes) if config is None else config
    listed = max_pages if max_listed is None else max_listed
    block_n = max(config.block_n, page_size, MIN_DOT)
    entry = 1 if keys else page_size
    pages_per_block = block_n // entry
    if config.pages_per_split is not None:
        per_split = config.pages_per_split
    else:
        target = num_multiprocessors(torch.device(device)) * config.ctas_per_sm
        per_split = max(-(-batch_size * listed * num_kv_heads // target), -(-config.min_split_tokens // entry), 1)
        per_split = max(per_split, -(-listed // MAX_SPLITS))  # a merge reads every split of its row
        per_split = -(-listed // max(-(-listed // per_split), 1))  # even splits of the longest list
    per_split = -(-max(per_split, 1) // pages_per_block) * pages_per_block  # whole loop iterations
    splits = max(-(-listed // per_split), 1)
    part_out = part_lse = None
    if splits > 1:
        part_out = torch.empty(splits, batch_size, num_qo_heads, head_dim, dtype=torch.float32, device=device)
        part_lse = torch.empty(splits, batch_size, num_qo_heads, dtype=torch.float32, device=device)
    return StaticDecodePlan(batch_size, max_pages, listed, num_qo_heads, num_kv_heads, head_dim, page_size, splits,
                            per_split, block_n, config, part_out, part_lse, entry)


@triton.jit
def _listed_range(list_row, i0, i1, first_page, n_pages, HAS_LIST: tl.constexpr, SCAN: tl.constexpr):
    """``[lo, hi)``: the span of listed indices in ``[i0, i1)`` whose entry may hold a counted key.

    An entry (a page, or a key of a key list) counts when ``first_page <= entry < n_pages`` (``first_page``: the
    window's first); ``lo >= hi`` when none does. With a list, one vector scan of the split's entries.
    """
    if HAS_LIST:
        lo = i1
        hi = i0
        for j in range(i0, i1, SCAN):
            idx = j + tl.arange(0, SCAN)  # [SCAN]
            pg = tl.load(list_row + idx, mask=idx < i1, other=-1)
            useful = (pg >= first_page) & (pg < n_pages) & (idx < i1)
            lo = tl.minimum(lo, tl.min(tl.where(useful, idx, i1)))
            hi = tl.maximum(hi, tl.max(tl.where(useful, idx + 1, i0)))
    else:
        lo = tl.maximum(i0, first_page)
        hi = tl.minimum(i1, n_pages)
    return lo, hi


@triton.jit
def _page_rows(dev_kv, host_kv, stage_kv, loc, row, stride_slot, HAS_HOST: tl.constexpr, HAS_STAGE: tl.constexpr):
    """Pointers to offset ``row`` within the pages at block-table values ``loc`` (same shape): a device slot, a
    host slot (its mapped address) or a staging slot."""
    dev_row = dev_kv + (tl.maximum(loc, 0).to(tl.int64) * stride_slot + row)
    rows = dev_row
    if HAS_HOST:  # one load per element: a host page's pointer is its mapped address
        host_row = host_kv + (tl.maximum(-loc - 1, 0).to(tl.int64) * stride_slot + row)
        rows = tl.where(loc >= 0, dev_row, host_row)
    if HAS_STAGE:  # a disk or remote page staged in pinned memory
        stage_row = stage_kv + (tl.maximum(-loc - STAGED, 0).to(tl.int64) * stride_slot + row)
        rows = tl.where(loc <= -STAGED, stage_row, rows)
    return rows


@triton.jit
def _listed_on_host(list_row, bt_row, idx, listed, n_pages):
    """``[n]`` int32: 1 where the listed entry ``idx`` (``listed``: within the list) is a live page at home on the host
    (not staged), else 0."""
    pg = tl.load(list_row + idx, mask=listed, other=-1)  # [n] logical page
    live = (pg >= 0) & (pg < n_pages)
    at = tl.load(bt_row + pg, mask=live, other=0)
    return (live & (at < 0) & (at > -STAGED)).to(tl.int32)


@triton.jit
def _static_split_kernel(
    q, dev_kv, host_kv, stage_kv, block_table, seq_lens, page_list, spans,
    out, lse, page_max, page_lse, land_slots, land_index,
    stride_qn, stride_qh,
    stride_slot, stride_kv, stride_p, stride_kh,
    stride_bt, stride_pl, stride_plh,
    stride_os, stride_on, stride_oh,
    stride_ls, stride_ln,
    stride_pb, stride_pk, stride_ph,
    stride_lsb, stride_lib,
    qk_scale, lse_scale, window_left, n_listed, land_cap,
    SPLITS: tl.constexpr, PPS: tl.constexpr, SCAN: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_HOST: tl.constexpr, HAS_STAGE: tl.constexpr, HAS_LIST: tl.constexpr, HAS_SPANS: tl.constexpr,
    KEYS: tl.constexpr, WITH_PAGE_MAX: tl.constexpr, WITH_PAGE_LSE: tl.constexpr,
    DOT_F32: tl.constexpr, FP8_HALF: tl.constexpr, PRECISION: tl.constexpr, SCALED: tl.constexpr,
    INT8: tl.constexpr, LAND: tl.constexpr,
):
    """One (sequence x split, kv head): rows ``[GROUP]`` of split ``c`` of sequence ``b``.

    FP8 pages (``SCALED``): the head's K (V) scale sits at row ``PAGE`` of the same page, read as fp32
    through the page's own pointer, so host pages bring theirs too; int8 pages (``INT8``): K and V read back
    whole from their steps and means in rows ``PAGE..PAGE + 2`` (:func:`int8_tile`), the same way. Dot operands:
    fp32 with ``DOT_F32``; with ``FP8_HALF`` (FP8 pages, 16-bit queries) fp16 for Q K^T and bf16 for P V; else
    q's dtype.
    ``page_list`` rows are per sequence (``stride_plh = 0``) or per (sequence, kv head); with ``KEYS`` each entry
    is a key's position (a key list), else a logical page. ``spans [B, 2]`` (``HAS_SPANS``): a token budget's
    ``(sinks, win_start)``, see :func:`static_decode`.

    ``out [splits, B, H, D]`` / ``lse [splits, B, H]`` (log2 units times ``lse_scale``): fp32
    partials, or the final output when there is one split. ``page_max [B, n_listed, H]``: every
    listed entry of the split is written, -inf where no key counts; ``page_lse`` (``WITH_PAGE_LSE``, same
    shape) the log-sum-exp of each listed entry's scaled logits.

    ``LAND`` (a per-sequence page list, 16/32-bit pages): the row's ``r``-th listed page at home on the host
    (counted over the whole list) is also written, when every one of its keys was read, to device slot
    ``land_slots[b, r]`` (``r < land_cap``); ``land_index [B, n_listed]`` gets ``r`` there, else -1 (kv head 0
    writes it).
    """
    ENTRY: tl.constexpr = 1 if KEYS else PAGE  # keys per listed entry
    PPB: tl.constexpr = BLOCK_N // ENTRY  # entries per block
    PAGE_STATS: tl.constexpr = WITH_PAGE_MAX or WITH_PAGE_LSE
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    b = pid // SPLITS
    c = pid % SPLITS
    seq_len = tl.load(seq_lens + b)
    n_pages = (seq_len + PAGE - 1) // PAGE
    win_lo = tl.where(window_left >= 0, tl.maximum(seq_len - 1 - window_left, 0), 0)  # first visible key
    i0 = c * PPS  # listed indices of the split: [i0, i1)
    i1 = tl.minimum(i0 + PPS, n_listed)
    list_row = page_list + b * stride_pl + kvh * stride_plh
    if HAS_SPANS:  # a token budget: the sink tokens of the sink pages, the window's tokens of its pages
        sinks = tl.load(spans + b * 2)
        win_start = tl.load(spans + b * 2 + 1)
    else:
        sinks = 0
        win_start = 0
    lo, hi = _listed_range(list_row, i0, i1, win_lo // ENTRY, (seq_len + ENTRY - 1) // ENTRY, HAS_LIST, SCAN)
    blk_lo = (lo // PPB) * PPB  # i0 is a multiple of PPB: blocks stay aligned to the split
    blk_hi = tl.where(lo < hi, blk_lo + tl.cdiv(hi - blk_lo, PPB) * PPB, blk_lo)  # end of the walked blocks

    offs_g = tl.arange(0, BLOCK_G)  # [G] query head within the group
    offs_d = tl.arange(0, BLOCK_D)  # [D]
    order = tl.arange(0, BLOCK_N)  # [N] token of each column within the block
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g  # [G]
    qt = tl.load(q + b * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
                 mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [G, D]
    qt, qk_scale = query_operand(qt, qk_scale, FP8_HALF, DOT_F32)
    pm_row = page_max + b * stride_pb
    pl_row = page_lse + b * stride_pb
    bt_row = block_table + b * stride_bt
    land_row = land_index + b * stride_lib
    if PAGE_STATS or LAND:  # entries of the split outside the walked blocks attend nothing
        for j in range(i0, i1, SCAN):
            idx = j + tl.arange(0, SCAN)  # [SCAN]
            skip = (idx < i1) & ((idx < blk_lo) | (idx >= blk_hi))
            none = tl.full([BLOCK_G, SCAN], float("-inf"), tl.float32)
            where = idx[None, :] * stride_pk + heads[:, None] * stride_ph
            if WITH_PAGE_MAX:
                tl.store(pm_row + where, none, mask=g_ok[:, None] & skip[None, :])
            if WITH_PAGE_LSE:
                tl.store(pl_row + where, none, mask=g_ok[:, None] & skip[None, :])
            if LAND:
                tl.store(land_row + idx, tl.full([SCAN], -1, tl.int32), mask=skip & (kvh == 0))
    from_host_before = tl.full([], 0, tl.int32)  # LAND: the row's listed host pages before the next block
    if LAND:
        for j in range(0, blk_lo, SCAN):
            idx = j + tl.arange(0, SCAN)  # [SCAN]
            from_host_before += tl.sum(_listed_on_host(list_row, bt_row, idx, idx < blk_lo, n_pages))

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    head_off = kvh * stride_kh
    for i in range(blk_lo, blk_hi, PPB):
        li = i + order // ENTRY  # [N] listed index of each column
        pidx = i + tl.arange(0, PPB)  # [PPB] listed index of each entry
        in_split = li < i1
        if HAS_LIST:
            listed = tl.load(list_row + li, mask=in_split, other=-1)  # [N] logical page, or key position
        else:
            listed = li
        if KEYS:
            tok = listed
            pg = tl.where(tok >= 0, tok // PAGE, -1)
        else:
            pg = listed
            tok = pg * PAGE + order % PAGE  # [N] key position in the sequence
        ok = in_split & (tok >= win_lo) & (tok < seq_len)
        if HAS_SPANS:  # the sinks, the window's tokens, and the middle pages whole
            ok = ok & ((tok < sinks) | (tok >= win_start) |
                       ((pg >= (sinks + PAGE - 1) // PAGE) & (pg < win_start // PAGE)))
        loc = tl.load(bt_row + pg, mask=ok, other=0)  # [N]
        if KEYS:  # a key of a page dropped for good is never read
            ok = ok & (loc != DROPPED)
            loc = tl.where(ok, loc, 0)
        k_row = _page_rows(dev_kv, host_kv, stage_kv, loc, (tok % PAGE) * stride_p + head_off, stride_slot,
                           HAS_HOST, HAS_STAGE)  # [N]
        k_ptrs = k_row[:, None] + offs_d[None, :]  # [N, D]
        kv_mask = ok[:, None] & d_ok[None, :]
        if LAND:  # the block's pages at home on the host, read whole: their landing slots
            from_host = _listed_on_host(list_row, bt_row, pidx, pidx < i1, n_pages)  # [PPB]
            rank = from_host_before + tl.cumsum(from_host, 0) - from_host  # [PPB] r of each host page
            from_host_before += tl.sum(from_host)
            whole = tl.min(tl.reshape(ok, [PPB, PAGE]).to(tl.int32), axis=1) > 0  # [PPB] every key read
            lands = (from_host > 0) & whole & (rank < land_cap)
            tl.store(land_row + pidx, tl.where(lands, rank, -1), mask=(pidx < i1) & (kvh == 0))
            to = tl.load(land_slots + b * stride_lsb + rank, mask=lands, other=0)  # [PPB] device slot
            to = tl.reshape(tl.broadcast_to(to[:, None], [PPB, PAGE]), [BLOCK_N])  # [N] each token's page's
            lands = tl.reshape(tl.broadcast_to(lands[:, None], [PPB, PAGE]), [BLOCK_N])  # [N]
            land_ptrs = (dev_kv + (to.to(tl.int64) * stride_slot + (order % PAGE) * stride_p + head_off))[:, None] \
                + offs_d[None, :]  # [N, D]
            land_mask = lands[:, None] & d_ok[None, :]
        if INT8:  # the block's whole pages: their steps and means read once per page
            page_ok = tl.max(tl.reshape(ok, [PPB, PAGE]).to(tl.int32), axis=1) > 0  # [PPB] pages with a counted key
            if HAS_LIST:
                page_pg = tl.load(list_row + pidx, mask=page_ok, other=0)  # [PPB] logical page
            else:
                page_pg = pidx
            page_loc = tl.load(bt_row + page_pg, mask=page_ok, other=0)  # [PPB]
            scale_row = _page_rows(dev_kv, host_kv, stage_kv, page_loc, PAGE * stride_p + head_off, stride_slot,
                                   HAS_HOST, HAS_STAGE)  # [PPB] each page's scale row, this head
            k = int8_tile(k_ptrs, kv_mask, scale_row, page_ok, offs_d, stride_p, PAGE, HEAD_DIM).to(qt.dtype)
        else:
            scale_row = k_row + (PAGE - tok % PAGE) * stride_p  # [N] the page's scale row, this head (FP8 pages)
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [N, D]
            if LAND:
                tl.store(land_ptrs, k, mask=land_mask)
            k = k.to(qt.dtype)
        s = tl.dot(qt, tl.trans(k), input_precision=PRECISION) * qk_scale  # [G, N] log2 units
        if SCALED:  # K = values * the page's scale, folded into the logits
            s = s * tl.load(scale_row.to(tl.pointer_type(tl.float32)), mask=ok, other=1.0)[None, :]
        s = tl.where(ok[None, :], s, float("-inf"))
        if PAGE_STATS:
            pm, pl = page_maxima(s, BLOCK_G, BLOCK_N, ENTRY, WITH_PAGE_LSE)  # [G, PPB]
            where = pidx[None, :] * stride_pk + heads[:, None] * stride_ph
            if WITH_PAGE_MAX:
                tl.store(pm_row + where, pm * 0.6931471805599453, mask=g_ok[:, None] & (pidx < i1)[None, :])
            if WITH_PAGE_LSE:
                tl.store(pl_row + where, pl * 0.6931471805599453, mask=g_ok[:, None] & (pidx < i1)[None, :])
        p, alpha, m_new, l_i = online_softmax_step(s, m_i, l_i)  # p [G, N]
        if INT8:
            v = int8_tile(k_ptrs + stride_kv, kv_mask, scale_row + stride_kv, page_ok, offs_d, stride_p, PAGE,
                          HEAD_DIM).to(qt.dtype)  # [N, D]
        else:
            v = tl.load(k_ptrs + stride_kv, mask=kv_mask, other=0.0)  # [N, D]
            if LAND:
                tl.store(land_ptrs + stride_kv, v, mask=land_mask)
            v = value_operand(v, qt, FP8_HALF, DOT_F32)
        if SCALED:  # V's scale on the probabilities (powers of two: exact)
            p = p * tl.load((scale_row + stride_kv).to(tl.pointer_type(tl.float32)), mask=ok, other=1.0)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)  # [G, D]
        m_i = m_new

    o, row_lse = finish_rows(acc, m_i, l_i, lse_scale)  # [G, D], [G]
    o_ptrs = out + c * stride_os + b * stride_on + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(out.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    tl.store(lse + c * stride_ls + b * stride_ln + heads, row_lse, mask=g_ok)


def static_decode(q: torch.Tensor, dev_pool: torch.Tensor, host_pool: torch.Tensor | None,
                  block_table: torch.Tensor, seq_lens: torch.Tensor, plan: StaticDecodePlan, sm_scale: float,
                  page_list: torch.Tensor | None = None, window_left: int = -1,
                  page_max: torch.Tensor | None = None, page_lse: torch.Tensor | None = None,
                  spans: torch.Tensor | None = None, stage_pool: torch.Tensor | None = None,
                  key_list: torch.Tensor | None = None, land_slots: torch.Tensor | None = None,
                  land_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of ``q [B, H, D]`` over one layer's pools; no host sync, static shapes.

    ``dev_pool [slots, 2, P, N_kv, D]`` (8-bit: ``P + R`` rows, dequantized in the kernel as :mod:`kvtier.quant` stores
    them), ``host_pool`` / ``stage_pool`` ``[hslots, 2, P, N_kv, D]`` (pinned, same strides and dtype) or None;
    ``block_table [B, max_pages]`` int32 (module docstring; entries past a sequence's pages are never read);
    ``seq_lens [B]`` int32 (0: an inactive row, out 0, lse -inf); ``page_list [B, K]`` or ``[B, N_kv, K]`` int32 logical
    pages to attend (-1 and pages past the sequence attend nothing), None for all pages; ``window_left`` (-1: none);
    ``spans [B, 2]`` int32 ``(sinks, win_start)`` of a token budget: a listed page shows the keys ``< sinks`` and
    ``>= win_start``, and all its keys when it lies between the sinks' pages and the window's first page (``(0, 0)``: no
    budget); ``key_list`` (in place of ``page_list``, with a plan made with ``keys=True``) ``[B, (N_kv,) K]`` int32 key
    positions to attend (-1, keys past the sequence and keys of dropped pages attend nothing; 16/32-bit and FP8 pages);
    ``page_max`` / ``page_lse`` optional fp32 ``[B, K or max_pages, H]`` filled with the max / log-sum-exp of each
    listed entry's scaled logits (natural log), -inf where no key counts (per-head lists: entry k of head h's kv group).
    ``land_slots [B, cap]`` (with ``land_index [B, >= K]`` int32, a per-sequence ``page_list`` and a host pool of
    16/32-bit pages): each row's ``r``-th listed page at home on the host (in list order) that was read whole is also
    written to device slot ``land_slots[b, r]`` (``r < cap``), and ``land_index[b, k]`` is its ``r``, else -1: the
    recall cache admits it from there (:mod:`kvtier.scopes.recall`) without reading the host again. Returns out
    ``[B, H, D]`` (q's dtype) and lse ``[B, H]`` (fp32, natural log).
    """
    n_q, heads, dim = q.shape
    page, n_kv = plan.page_size, dev_pool.shape[3]
    scaled = is_scaled_pool(dev_pool, page)  # 8-bit pages: [slots, 2, P + R, N_kv, D]
    int8 = dev_pool.dtype == INT8
    page_list, keys, n_listed = _check_call(q, dev_pool, host_pool, stage_pool, block_table, plan, page_list, key_list,
                                            spans, page_max, page_lse, land_slots, land_index, scaled, int8)
    block_d = triton.next_power_of_2(dim)
    dot_f32, precision = dot_operand_dtype(q.dtype)
    out = torch.empty(n_q, heads, dim, dtype=q.dtype, device=q.device)  # [B, H, D]
    lse = torch.empty(n_q, heads, dtype=torch.float32, device=q.device)  # [B, H]
    single = plan.num_splits == 1
    part_out, part_lse = (out.unsqueeze(0), lse.unsqueeze(0)) if single else (plan.part_out, plan.part_lse)
    pm = page_max if page_max is not None else page_lse if page_lse is not None else lse.unsqueeze(1)  # lse: not read
    plse = page_lse if page_lse is not None else pm  # the two share pm's strides (checked)
    pl = page_list if page_list is not None else block_table
    per_head = pl.dim() == 3
    land = land_slots is not None
    scan = min(triton.next_power_of_2(plan.pages_per_split), 256)  # listed entries per vector scan
    block_g = max(16, triton.next_power_of_2(heads // n_kv))
    _, stages = fit_shared_memory(block_g, plan.block_n, plan.config.num_stages, block_d,
                                  4 if dot_f32 else q.element_size(), plan.block_n, dev_pool.element_size())
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _static_split_kernel[(n_q * plan.num_splits, n_kv)](
            q, dev_pool, host_pool if host_pool is not None else dev_pool,
            stage_pool if stage_pool is not None else dev_pool, block_table, seq_lens, pl,
            spans if spans is not None else seq_lens,
            part_out, part_lse, pm, plse, land_slots if land else seq_lens, land_index if land else seq_lens,
            q.stride(0), q.stride(1),
            dev_pool.stride(0), dev_pool.stride(1), dev_pool.stride(2), dev_pool.stride(3),
            block_table.stride(0), pl.stride(0), pl.stride(1) if per_head else 0,
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            pm.stride(0), pm.stride(1), pm.stride(2),
            land_slots.stride(0) if land else 0, land_index.stride(0) if land else 0,
            sm_scale * LOG2E, LN2 if single else 1.0, window_left, n_listed, land_slots.shape[1] if land else 0,
            SPLITS=plan.num_splits, PPS=plan.pages_per_split, SCAN=scan,
            GROUP=heads // n_kv, BLOCK_G=block_g, PAGE=page, BLOCK_N=plan.block_n, HEAD_DIM=dim, BLOCK_D=block_d,
            HAS_HOST=host_pool is not None, HAS_STAGE=stage_pool is not None, HAS_LIST=page_list is not None,
            HAS_SPANS=spans is not None, KEYS=keys, WITH_PAGE_MAX=page_max is not None,
            WITH_PAGE_LSE=page_lse is not None,
            DOT_F32=dot_f32, FP8_HALF=scaled and not int8 and q.dtype != torch.float32, PRECISION=precision,
            SCALED=scaled and not int8, INT8=int8, LAND=land,
            num_warps=plan.config.num_warps, num_stages=stages, maxnreg=plan.config.maxnreg,
        )
        if not single:
            merge_splits(part_out, part_lse, out, lse)
    return out, lse


def _check_call(q, dev_pool, host_pool, stage_pool, block_table, plan: StaticDecodePlan, page_list, key_list, spans,
                page_max, page_lse, land_slots, land_index, scaled: bool, int8: bool) -> tuple:
    """:func:`static_decode`'s arguments checked against each other and the plan (a ValueError naming the fault);
    ``(lists, keys, n_listed)``: the list the kernel reads (``key_list`` when given, else ``page_list``), its width."""
    n_q, heads, dim = q.shape
    page, n_kv = plan.page_size, dev_pool.shape[3]
    keys, page_list = check_key_list(key_list, page_list, plan.entry_tokens, page, int8, spans, land_slots is not None)
    if not scaled and dev_pool.shape[2] != page:
        raise ValueError(f"pool pages {tuple(dev_pool.shape[1:])} do not match the plan's page size {page}")
    n_listed = plan.max_pages if page_list is None else page_list.shape[-1]
    if (n_q, heads, dim, n_kv) != (plan.batch_size, plan.num_qo_heads, plan.head_dim, plan.num_kv_heads):
        raise ValueError(f"q {tuple(q.shape)} / pool {tuple(dev_pool.shape)} do not match the plan {plan}")
    if tuple(block_table.shape) != (n_q, plan.max_pages) or n_listed > plan.max_listed:
        raise ValueError(f"block_table {tuple(block_table.shape)} or {n_listed} listed pages exceed the plan {plan}")
    if page_list is not None and (page_list.shape[0] != n_q or page_list.dim() == 3 and page_list.shape[1] != n_kv):
        raise ValueError(f"page_list needs [{n_q}, K] or per head [{n_q}, {n_kv}, K], got {tuple(page_list.shape)}")
    for stat in (page_max, page_lse):
        if stat is not None and (tuple(stat.shape) != (n_q, n_listed, heads) or stat.dtype != torch.float32):
            raise ValueError(f"page statistics need fp32 [{n_q}, {n_listed}, {heads}], got {tuple(stat.shape)}")
    if page_max is not None and page_lse is not None and page_max.stride() != page_lse.stride():
        raise ValueError("page_max and page_lse need the same strides")
    if q.stride(-1) != 1 or dev_pool.stride(-1) != 1:
        raise ValueError("q and dev_pool need a contiguous head dimension")
    for other in (host_pool, stage_pool):
        if other is not None and (other.stride() != dev_pool.stride() or other.dtype != dev_pool.dtype):
            raise ValueError("host and staging pools need dev_pool's strides and dtype")
    check_landing(land_slots, land_index, page_list, host_pool, scaled, n_q)
    return page_list, keys, n_listed


def as_block_table(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """A decode batch's page lists as the kernel's ``block_table [B, max_pages]`` (and, for a ``head_mask``,
    per-head page lists ``[B, N_kv, max_pages]``), plus for each listed page its ``(b, entry)`` as a flat index
    into ``[B, max_pages]`` and its place in ``kv_indices`` (``[n]`` each). Host work on the host indptr; one
    copy of the index arrays."""
    indptr = batch.host("kv_indptr")
    npages = np.diff(indptr)  # [B]
    width = max(int(npages.max(initial=0)), 1)
    entry = np.arange(width)[None, :]  # [1, W]
    flat = np.where(entry < npages[:, None], indptr[:-1, None] + entry, 0)  # [B, W] index into kv_indices
    listed = np.flatnonzero((entry < npages[:, None]).reshape(-1))  # [n] flat (b, entry) of each listed page
    gather, where, place = to_device([flat, listed, flat.reshape(-1)[listed]], batch.kv_indices.device, torch.int64)
    table = batch.kv_indices.long()[gather.view(-1, width)].to(torch.int32)  # [B, W]
    per_head = None
    if batch.head_mask is not None:  # [nnz, N_kv] -> per head: the entry, or -1 where the head is not given it
        seen = batch.head_mask[gather.view(-1, width)] & (torch.as_tensor(entry < npages[:, None],
                                                                          device=table.device))[..., None]
        per_head = torch.where(seen, torch.arange(width, device=table.device)[None, :, None], -1)
        per_head = per_head.permute(0, 2, 1).to(torch.int32).contiguous()  # [B, N_kv, W]
    return table, per_head, where, place


class TritonBackend(AttentionBackend):
    """Triton paged attention: :func:`static_decode` for one query row per sequence, else chunked prefill."""

    name = "triton"
    can = Capabilities()  # the engine's decode step whole (a per-head page choice at decode steps only)

    def __init__(self, decode_config: DecodeConfig | None = None, prefill_config: PrefillConfig | None = None):
        self.decode_config = decode_config  # None: default_decode_config(head_dim, the pool's bytes per value)
        self.prefill_config = prefill_config  # None: default_prefill_config(the call's tokens, heads)
        self._prefill_key = None  # (qo_indptr, heads, kv heads, page size) of the last prefill plan

    def plan(self, batch: PagedBatch, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             sm_scale: float | None = None) -> None:
        """Prefill: plans the query tiles. Decode: the block table; the splits depend on the pool's dtype,
        which only ``run`` sees, so they are planned on the first ``run`` per pool dtype."""
        super().plan(batch, num_qo_heads, num_kv_heads, head_dim, sm_scale)
        check_page_size(batch.page_size)
        self.is_decode = batch.is_decode()
        if batch.head_mask is not None and not self.is_decode:
            raise ConfigError("kernel", "the Triton prefill kernel does not take a per-head page choice "
                                        "(head_mask): it is for decode steps; use kernel=torch")
        self.decode_plans: dict[int, StaticDecodePlan] = {}  # bytes per value of the pool -> plan
        key = (batch.qo_indptr, num_qo_heads, num_kv_heads, batch.page_size)  # the tiles depend on these only
        if self.is_decode:
            self.prefill_plan = None
        elif self._prefill_key is None or key[0] is not self._prefill_key[0] or key[1:] != self._prefill_key[1:]:
            self.prefill_plan = plan_prefill(batch, num_qo_heads, num_kv_heads, head_dim, self.prefill_config)
            self._prefill_key = key  # layers of one iteration share their calls' qo_indptr: planned once
        self.table = as_block_table(batch) if self.is_decode else None

    def run(self, q: torch.Tensor, kv_pool: torch.Tensor, return_page_max: bool = False) -> AttentionOutput:
        if not self.is_decode:
            return paged_prefill(q, kv_pool, self.batch, self.prefill_plan, self.sm_scale, return_page_max)
        table, per_head, where, place = self.table
        plan = self.decode_plan(table.shape[1], kv_pool.element_size())
        page_max = torch.empty(q.shape[0], table.shape[1], q.shape[1], device=q.device) if return_page_max else None
        out, lse = static_decode(q, kv_pool, None, table, self.batch.kv_lens().to(torch.int32), plan, self.sm_scale,
                                 page_list=per_head, window_left=self.batch.window_left, page_max=page_max)
        if page_max is not None:  # [nnz, H] in the batch's page order; entries no sequence lists see nothing
            listed = page_max.view(-1, q.shape[1])[where]
            page_max = torch.full((self.batch.kv_indices.numel(), q.shape[1]), float("-inf"), device=q.device)
            page_max[place] = listed
        return AttentionOutput(out, lse, page_max)

    def decode(self, *args, **kwargs):
        """The engine's decode step: :func:`static_decode`."""
        return static_decode(*args, **kwargs)

    def decode_plan(self, max_pages: int, kv_bytes: int) -> StaticDecodePlan:
        if kv_bytes not in self.decode_plans:
            b = self.batch
            self.decode_plans[kv_bytes] = plan_static_decode(
                b.batch_size, max_pages, self.num_qo_heads, self.num_kv_heads, self.head_dim, b.page_size,
                b.kv_indptr.device, config=self.decode_config, kv_bytes=kv_bytes)
        return self.decode_plans[kv_bytes]
