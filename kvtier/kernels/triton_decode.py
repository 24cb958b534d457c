"""Triton paged GQA decode attention (flash-decoding) and the ``triton`` backend.

One query row per sequence, which sees the last ``window_left + 1`` keys with a window (blocks
wholly left of it are skipped, the block it starts in is masked), and with a ``head_mask`` only the
pages its kv head is given (per-head page choice over the union of the heads' pages). ``plan`` cuts every sequence's
page list into chunks of ``pages_per_split`` pages; one program per (chunk, kv head) attends the
chunk with all query heads of the kv group packed as rows of one ``tl.dot`` tile (padded to 16
rows), and writes a partial (out, lse). A merge kernel combines the partials of each sequence by
their LSE. When every sequence fits one chunk the split kernel writes the final output directly
and no merge runs.

Pages are NHD ``[slots, 2, P, N_kv, D]``; see :mod:`kvtier.kernels.base` for the batch convention.
Softmax runs in base 2 (``exp2``) with fp32 accumulation; LSE and ``page_max`` are returned in
natural-log units.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from kvtier.errors import ConfigError
from kvtier.kernels.base import AttentionBackend, AttentionOutput, PagedBatch, to_device
from kvtier.kernels.triton_prefill import (LN2, LOG2E, PrefillConfig, check_page_size, dot_operand_dtype, MIN_DOT,
                                           fit_shared_memory, finish_rows, kernel_window, online_softmax_step,
                                           paged_prefill, plan_prefill, query_operand, scale_args, token_scales,
                                           value_operand)


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
    multiprocessor (same time without ``page_max``; with it +3.4% instead of +10.7% at B=64 x 8k, session 5);
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


@dataclass
class DecodePlan:
    """Chunk list of one decode step (int32 on the batch's device) and the partials' buffers."""

    chunk_seq: torch.Tensor  # [C] sequence of each chunk
    chunk_page: torch.Tensor  # [C] first listed page of each chunk (index into kv_indices)
    chunk_split: torch.Tensor  # [C] split index of the chunk within its sequence
    seq_splits: torch.Tensor  # [B] chunks per sequence (>= 1; an empty sequence has one empty chunk)
    pages_per_split: int
    max_splits: int
    block_n: int
    config: DecodeConfig
    part_out: torch.Tensor | None  # [splits, B, H, D] fp32, reused by every layer (one stream); None: 1 split
    part_lse: torch.Tensor | None  # [splits, B, H] fp32 (log2 units)
    listed: tuple[int, int]  # the listed pages the sequences cover: kv_indptr[0], kv_indptr[-1]


def num_multiprocessors(device: torch.device) -> int:
    """SM count of a CUDA device (4 under the interpreter, where it only sizes the splits)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def plan_decode(batch: PagedBatch, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                config: DecodeConfig | None = None, kv_bytes: int = 2) -> DecodePlan:
    """Cut each sequence's pages into splits so that chunks x kv heads fills the GPU.

    Host work on the batch's host ``kv_indptr`` (no sync for a batch from ``PagedBatch.from_host``),
    then one non-blocking copy of the chunk list. ``kv_bytes``: the pool's bytes per value (1 for
    FP8 pages), which picks the default config.
    """
    check_page_size(batch.page_size)
    config = default_decode_config(head_dim, kv_bytes) if config is None else config
    page = batch.page_size
    block_n = max(config.block_n, page, MIN_DOT)
    pages_per_block = block_n // page
    kv_indptr = batch.kv_indptr_host()  # [B+1]
    npages = np.diff(kv_indptr)  # [B]
    if config.pages_per_split is not None:
        per_split = config.pages_per_split
    else:
        target = num_multiprocessors(batch.kv_indptr.device) * config.ctas_per_sm
        per_split = max(-(-int(npages.sum()) * num_kv_heads // target), -(-config.min_split_tokens // page), 1)
        longest = max(int(npages.max()), 1) if npages.size else 1
        per_split = -(-longest // -(-longest // per_split))  # even splits of the longest sequence
    per_split = -(-per_split // pages_per_block) * pages_per_block  # whole loop iterations
    splits = np.maximum(-(-npages // per_split), 1)  # [B]
    seq = np.repeat(np.arange(npages.size), splits)  # [C]
    first = np.cumsum(splits) - splits  # [B] first chunk of each sequence
    split = np.arange(seq.size) - first[seq]  # [C]
    page0 = kv_indptr[:-1][seq] + split * per_split  # [C]
    dev = batch.kv_indptr.device
    max_splits = int(splits.max()) if splits.size else 1
    part_out = part_lse = None
    if max_splits > 1:
        part_out = torch.empty(max_splits, npages.size, num_qo_heads, head_dim, dtype=torch.float32, device=dev)
        part_lse = torch.empty(max_splits, npages.size, num_qo_heads, dtype=torch.float32, device=dev)
    return DecodePlan(*to_device([seq, page0, split, splits], dev), per_split, max_splits, block_n, config,
                      part_out, part_lse, (int(kv_indptr[0]), int(kv_indptr[-1])))


@triton.jit
def warp_token_order(BLOCK_N: tl.constexpr, NUM_WARPS: tl.constexpr, WARP_ORDER: tl.constexpr):
    """Token of each column of a key block ``[N]``: a permutation of ``0..N-1``, the identity unless ``WARP_ORDER``.

    The logits ``[16, N]`` of ``tl.dot`` (mma v2, one 16-row tile) deal their columns to the warps in
    8-column groups, round robin: in column order a 16-token page spans two warps, and its max takes
    a reduction through shared memory. This order gives each warp ``N / NUM_WARPS`` consecutive tokens
    (``WARP_ORDER`` needs ``N % (8 * NUM_WARPS) == 0``), so a page up to that size stays in one warp.
    """
    c = tl.arange(0, BLOCK_N)
    if WARP_ORDER:
        c = (c // 8 % NUM_WARPS) * (BLOCK_N // NUM_WARPS) + c // (8 * NUM_WARPS) * 8 + c % 8
    return c


@triton.jit
def page_maxima(s, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, NUM_WARPS: tl.constexpr,
                WARP_ORDER: tl.constexpr):
    """Max of the logits ``s [G, N]`` (columns in :func:`warp_token_order`) over each page of the block:
    ``[G, N / PAGE]``."""
    if WARP_ORDER:  # back to token order: reshapes and a permute of the layout, no data movement
        s = tl.reshape(tl.permute(tl.reshape(s, [BLOCK_G, BLOCK_N // (8 * NUM_WARPS), NUM_WARPS, 8]), (0, 2, 1, 3)),
                       [BLOCK_G, BLOCK_N])
    return tl.max(tl.reshape(s, [BLOCK_G, BLOCK_N // PAGE, PAGE]), axis=2)


@triton.jit
def _decode_split_kernel(
    q, kv, scales, kv_indptr, kv_indices, kv_last_page_len, head_mask,
    chunk_seq, chunk_page, chunk_split,
    out, lse, page_max,
    stride_qn, stride_qh,
    stride_slot, stride_kv, stride_p, stride_kh,
    stride_ss, stride_skv, stride_sh,
    stride_os, stride_on, stride_oh,
    stride_ls, stride_ln,
    stride_pm, stride_hm,
    qk_scale, lse_scale, pages_per_split, window_left,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_WARPS: tl.constexpr,
    WITH_PAGE_MAX: tl.constexpr, DOT_F32: tl.constexpr, FP8_HALF: tl.constexpr, PRECISION: tl.constexpr,
    SCALED: tl.constexpr, HEAD_MASK: tl.constexpr,
):
    """One (chunk, kv head): out/lse rows ``[GROUP]`` of the chunk's sequence over its pages.

    ``out`` is ``[splits, B, H, D]`` (fp32 partials, or the final ``[1, B, H, D]`` output when
    there is a single split), ``lse`` ``[splits, B, H]`` (log2 units times ``lse_scale``),
    ``page_max [nnz, H]``: every page of the chunk is written, -inf where it holds no token the
    query sees; blocks wholly left of the window (``window_left``) are skipped. With
    ``HEAD_MASK``, ``head_mask [nnz, N_kv]`` (int8) hides the listed pages this kv head is not given.
    Dot operands: fp32 with ``DOT_F32``; with ``FP8_HALF`` (FP8 pages, 16-bit queries) fp16 for Q K^T
    and bf16 for P V (fp32 under the interpreter); else q's dtype.
    """
    WARP_ORDER: tl.constexpr = WITH_PAGE_MAX and BLOCK_N % (8 * NUM_WARPS) == 0
    c = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.load(chunk_seq + c)
    page0 = tl.load(chunk_page + c)
    split = tl.load(chunk_split + c)
    seq_p0 = tl.load(kv_indptr + b)
    n_pages = tl.load(kv_indptr + b + 1) - seq_p0
    kv_len = tl.where(n_pages > 0, (n_pages - 1) * PAGE + tl.load(kv_last_page_len + b), 0)
    t0 = (page0 - seq_p0) * PAGE  # first token of the chunk, local to the sequence
    t_end = tl.minimum(t0 + pages_per_split * PAGE, n_pages * PAGE)  # end of the chunk's pages
    t1 = tl.minimum(t_end, kv_len)  # end of its tokens
    lo = kv_len - 1 - window_left  # first key in the query's window
    first = t0 + tl.maximum(lo - t0, 0) // BLOCK_N * BLOCK_N  # first block holding a key of the window

    offs_g = tl.arange(0, BLOCK_G)  # [G] query head within the group
    offs_d = tl.arange(0, BLOCK_D)  # [D]
    order = warp_token_order(BLOCK_N, NUM_WARPS, WARP_ORDER)  # [N] token of each column
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g  # [G]
    q_ptrs = q + b * stride_qn + heads[:, None] * stride_qh + offs_d[None, :]  # [G, D]
    qt = tl.load(q_ptrs, mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    qt, qk_scale = query_operand(qt, qk_scale, FP8_HALF, DOT_F32)

    if WITH_PAGE_MAX:  # the chunk's pages before its first visited block hold no key of the window
        skip_end = tl.minimum(first, t_end)
        for start in range(t0, skip_end, BLOCK_N):
            pg = start // PAGE + tl.arange(0, BLOCK_N // PAGE)  # [NP] local page
            tl.store(page_max + (seq_p0 + pg)[None, :] * stride_pm + heads[:, None],
                     tl.full([BLOCK_G, BLOCK_N // PAGE], float("-inf"), tl.float32),
                     mask=g_ok[:, None] & (pg * PAGE < skip_end)[None, :])
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    k_base = kv + kvh * stride_kh
    v_base = k_base + stride_kv
    ks_base = scales + kvh * stride_sh  # FP8 pages: the head's K scale of slot 0 (V: + stride_skv)
    for start in range(first, t_end, BLOCK_N):
        tok = start + order  # [N]
        tok_ok = (tok < t1) & (tok >= lo)
        if HEAD_MASK:  # this kv head's pages only
            given = tl.load(head_mask + (seq_p0 + tok // PAGE) * stride_hm + kvh, mask=tok_ok, other=0)
            tok_ok = tok_ok & (given != 0)
        slot = tl.load(kv_indices + seq_p0 + tok // PAGE, mask=tok_ok, other=0).to(tl.int64)  # [N]
        row_off = slot * stride_slot + (tok % PAGE) * stride_p  # [N]
        kv_off = row_off[:, None] + offs_d[None, :]  # [N, D]
        kv_mask = tok_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + kv_off, mask=kv_mask, other=0.0).to(qt.dtype)  # [N, D]
        s = tl.dot(qt, tl.trans(k), input_precision=PRECISION) * qk_scale  # [G, N] log2 units
        if SCALED:  # K = values * the page's scale, folded into the logits
            s = s * token_scales(ks_base, slot * stride_ss, tok_ok)[None, :]
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        if WITH_PAGE_MAX:
            pm = page_maxima(s, BLOCK_G, BLOCK_N, PAGE, NUM_WARPS, WARP_ORDER)  # [G, NP]
            pg = tl.arange(0, BLOCK_N // PAGE)  # [NP] page within the block
            pm_ptrs = page_max + (seq_p0 + start // PAGE) * stride_pm + pg[None, :] * stride_pm + heads[:, None]
            tl.store(pm_ptrs, pm * 0.6931471805599453, mask=g_ok[:, None] & (start + pg * PAGE < t_end)[None, :])
        p, alpha, m_new, l_i = online_softmax_step(s, m_i, l_i)  # p [G, N]
        v = tl.load(v_base + kv_off, mask=kv_mask, other=0.0)  # [N, D]
        v = value_operand(v, qt, FP8_HALF, DOT_F32)
        if SCALED:  # V's scale on the probabilities (powers of two: exact)
            p = p * token_scales(ks_base + stride_skv, slot * stride_ss, tok_ok)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)  # [G, D]
        m_i = m_new

    o, row_lse = finish_rows(acc, m_i, l_i, lse_scale)  # [G, D], [G]
    o_ptrs = out + split * stride_os + b * stride_on + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(out.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    tl.store(lse + split * stride_ls + b * stride_ln + heads, row_lse, mask=g_ok)


@triton.jit
def _merge_splits_kernel(
    part_out, part_lse, seq_splits, out, lse,
    stride_ps, stride_pn, stride_ph,
    stride_ls, stride_ln,
    stride_on, stride_oh, stride_lo,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One (row, head): softmax-weighted sum of the row's partials ``[splits, B, H, D]`` (log2 LSE)."""
    row = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(seq_splits + row)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m = tl.full([], float("-inf"), tl.float32)
    l = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(n):
        lse_s = tl.load(part_lse + s * stride_ls + row * stride_ln + h)
        o_s = tl.load(part_out + s * stride_ps + row * stride_pn + h * stride_ph + offs_d, mask=d_ok, other=0.0)
        m_new = tl.maximum(m, lse_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        w = tl.exp2(lse_s - m_safe)
        acc = acc * alpha + w * o_s  # [D]
        l = l * alpha + w
        m = m_new
    has = l > 0
    o = acc / tl.where(has, l, 1.0)
    tl.store(out + row * stride_on + h * stride_oh + offs_d, o.to(out.dtype.element_ty), mask=d_ok)
    tl.store(lse + row * stride_lo + h, tl.where(has, (m + tl.log2(tl.where(has, l, 1.0))) * 0.6931471805599453,
                                                 float("-inf")))


def paged_decode(q: torch.Tensor, kv_pool: torch.Tensor, batch: PagedBatch, plan: DecodePlan, sm_scale: float,
                 return_page_max: bool = False) -> AttentionOutput:
    """Decode attention for one query row per sequence.

    q ``[B, H, D]``, kv_pool ``[slots, 2, P, N_kv, D]`` (FP8: ``P + 1`` rows, dequantized in the kernel). Returns out ``[B, H, D]`` (q's dtype),
    lse ``[B, H]`` (natural log) and optionally page_max ``[nnz, H]`` (-inf outside the window).
    """
    n_q, heads, dim = q.shape
    n_kv = kv_pool.shape[3]
    group = heads // n_kv
    if q.stride(-1) != 1 or kv_pool.stride(-1) != 1:
        raise ValueError("q and kv_pool need a contiguous head dimension")
    block_d = triton.next_power_of_2(dim)
    block_g = max(16, triton.next_power_of_2(group))
    dot_f32, precision = dot_operand_dtype(q.dtype)
    page_max = None
    if return_page_max:  # the kernel writes every page of every sequence
        nnz = batch.kv_indices.numel()
        page_max = torch.empty(nnz, heads, device=q.device)  # [nnz, H]
        listed_lo, listed_hi = plan.listed
        if listed_lo > 0 or listed_hi < nnz:  # entries no sequence lists (host ints: no sync, and no launch if none)
            page_max[:listed_lo] = float("-inf")
            page_max[listed_hi:] = float("-inf")
    single = plan.max_splits == 1
    out = torch.empty(n_q, heads, dim, dtype=q.dtype, device=q.device)  # [B, H, D]
    lse = torch.empty(n_q, heads, dtype=torch.float32, device=q.device)  # [B, H]
    if single:
        part_out, part_lse = out.unsqueeze(0), lse.unsqueeze(0)  # [1, B, H, D], [1, B, H]
    else:
        part_out, part_lse = plan.part_out, plan.part_lse
    scales, stride_ss, stride_skv, stride_sh, scaled = scale_args(kv_pool, batch.page_size)
    fp8_half = scaled and q.dtype != torch.float32  # FP8 pages, 16-bit queries (fp32 ones: fp32 operands)
    head_mask = None if batch.head_mask is None else batch.head_mask.to(torch.int8)  # [nnz, N_kv]
    grid = (plan.chunk_seq.numel(), n_kv)
    _, stages = fit_shared_memory(block_g, plan.block_n, plan.config.num_stages, block_d,
                                  4 if dot_f32 else q.element_size(), plan.block_n, kv_pool.element_size())
    _decode_split_kernel[grid](
        q, kv_pool, scales, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len,
        batch.kv_indices if head_mask is None else head_mask,
        plan.chunk_seq, plan.chunk_page, plan.chunk_split,
        part_out, part_lse, page_max if return_page_max else part_lse,
        q.stride(0), q.stride(1),
        kv_pool.stride(0), kv_pool.stride(1), kv_pool.stride(2), kv_pool.stride(3),
        stride_ss, stride_skv, stride_sh,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        heads, n_kv,
        sm_scale * LOG2E, LN2 if single else 1.0, plan.pages_per_split, kernel_window(batch),
        GROUP=group, BLOCK_G=block_g, PAGE=batch.page_size, BLOCK_N=plan.block_n,
        HEAD_DIM=dim, BLOCK_D=block_d, NUM_WARPS=plan.config.num_warps,
        WITH_PAGE_MAX=return_page_max, DOT_F32=dot_f32, FP8_HALF=fp8_half, PRECISION=precision, SCALED=scaled,
        HEAD_MASK=head_mask is not None, num_warps=plan.config.num_warps, num_stages=stages,
        maxnreg=plan.config.maxnreg,
    )
    if not single:
        _merge_splits_kernel[(n_q, heads)](
            part_out, part_lse, plan.seq_splits, out, lse,
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1), lse.stride(0),
            HEAD_DIM=dim, BLOCK_D=block_d, num_warps=1 if block_d <= 64 else 2,
        )
    return AttentionOutput(out, lse, page_max)


class TritonBackend(AttentionBackend):
    """Triton paged attention: split-KV decode for one query row per sequence, else chunked prefill."""

    name = "triton"
    supports_head_mask = True  # at decode steps

    def __init__(self, decode_config: DecodeConfig | None = None, prefill_config: PrefillConfig = PrefillConfig()):
        self.decode_config = decode_config  # None: default_decode_config(head_dim, the pool's bytes per value)
        self.prefill_config = prefill_config

    def plan(self, batch: PagedBatch, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             sm_scale: float | None = None) -> None:
        """Prefill: plans the query tiles. Decode: the splits depend on the pool's dtype, which only
        ``run`` sees, so they are planned on the first ``run`` per pool dtype after each ``plan``."""
        super().plan(batch, num_qo_heads, num_kv_heads, head_dim, sm_scale)
        check_page_size(batch.page_size)
        self.is_decode = batch.is_decode()
        if batch.head_mask is not None and not self.is_decode:
            raise ConfigError("kernel", "the Triton prefill kernel does not take a per-head page choice "
                                        "(head_mask): it is for decode steps; use kernel=torch")
        self.decode_plans: dict[int, DecodePlan] = {}  # bytes per value of the pool -> plan
        self.prefill_plan = None if self.is_decode else plan_prefill(batch, num_qo_heads, num_kv_heads,
                                                                     self.prefill_config)

    def run(self, q: torch.Tensor, kv_pool: torch.Tensor, return_page_max: bool = False) -> AttentionOutput:
        if not self.is_decode:
            return paged_prefill(q, kv_pool, self.batch, self.prefill_plan, self.sm_scale, return_page_max)
        kv_bytes = kv_pool.element_size()
        if kv_bytes not in self.decode_plans:
            self.decode_plans[kv_bytes] = plan_decode(self.batch, self.num_qo_heads, self.num_kv_heads, self.head_dim,
                                                      self.decode_config, kv_bytes)
        return paged_decode(q, kv_pool, self.batch, self.decode_plans[kv_bytes], self.sm_scale, return_page_max)
