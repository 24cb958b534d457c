"""Triton chunked-prefill paged attention: a chunk of queries against ALL pages of its sequence.

Varlen batches (``qo_indptr``), GQA packed into the rows of one tile (row ``r`` is query
``r // G_PAD`` of the tile and head ``r % G_PAD`` of the kv group), bottom-right-aligned causal
mask, a sliding window (``window_left``: blocks left of every row's window are skipped), LSE out,
and optionally ``page_max`` (max over the sequence's queries, atomically reduced across the query
tiles of a sequence). One program per (query tile, kv head, key split) walks its split's share of the
blocks where the window starts with a mask, the blocks every row of its tile sees whole without one,
then the diagonal blocks with one. A short chunk over a long prefix gives few tiles: its keys are split
(``PrefillConfig.kv_splits``, flash-decoding's split-KV), and :func:`merge_splits` folds the splits'
partial states by their LSE (the decode kernel's splits too).

Also the dtype and page-size helpers shared with :mod:`kvtier.kernels.triton_decode`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import numpy as np
import torch
import triton
import triton.language as tl

from kvtier.errors import ConfigError
from kvtier.kernels.base import AttentionOutput, PagedBatch, to_device
from kvtier.quant import INT8, STEPS_PER_OCTAVE, is_scaled_pool, page_scales

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_INTERPRET = tl.constexpr(INTERPRET)  # the same, readable in kernels
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
NO_WINDOW = 1 << 30  # the kernels' window_left without a window: longer than any sequence
_OCTAVE_STEP = tl.constexpr(1.0 / STEPS_PER_OCTAVE)  # int8 pages' step 2^(e * _OCTAVE_STEP)


def dot_operand_dtype(dtype: torch.dtype) -> tuple:
    """(cast-to-fp32 flag, ``tl.dot`` input precision) for a query dtype.

    The interpreter's bf16 ``tl.dot`` is wrong, so it computes in fp32; fp32 inputs use exact
    ("ieee") products on the GPU rather than tf32.
    """
    return INTERPRET or dtype == torch.float32, "ieee" if dtype == torch.float32 else "tf32"


def check_page_size(page_size: int) -> None:
    """The kernels split key blocks into whole pages: the page size must be a power of two."""
    if page_size < 1 or page_size & (page_size - 1):
        raise ConfigError("layout.page_size", f"the triton kernels need a power-of-two page size, got {page_size}; "
                                              "use kernel=torch or kernel=flashinfer")


def kernel_window(batch: PagedBatch) -> int:
    """The kernels' ``window_left``: the batch's, or :data:`NO_WINDOW`."""
    return batch.window_left if batch.window_left >= 0 else NO_WINDOW


def scale_args(kv_pool: torch.Tensor, page_size: int) -> tuple:
    """The prefill kernel's scale arguments: ``(scales, stride_slot, stride_kv, stride_head, SCALED, INT8)``.

    FP8 pools (:mod:`kvtier.quant`) pass their fp32 scale view ``[slots, 2, N_kv]`` (``SCALED``); int8 pools
    (``INT8``, whose kernels read their scale rows through the page) and pools stored as they are pass
    themselves as an unread placeholder.
    """
    if not is_scaled_pool(kv_pool, page_size) or kv_pool.dtype == INT8:
        return kv_pool, 0, 0, 0, False, kv_pool.dtype == INT8
    scales = page_scales(kv_pool, page_size)  # [slots, 2, N_kv] fp32 view of the scale rows
    return (scales, *scales.stride(), True, False)


@triton.jit
def token_scales(head_scales, slot, ok):
    """Scale of each token's page ``[N]`` (``head_scales``: the kv head's K or V scale of slot 0; 1 where not ok)."""
    return tl.load(head_scales + slot, mask=ok, other=1.0)


@triton.jit
def int8_tile(ptrs, mask, page_rows, page_ok, offs_d, stride_p, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A tile of whole int8 pages as fp32 ``[N, D]``: ``m + 2^(e/4) c`` (:mod:`kvtier.quant`), ``c`` the int8 values
    at ``ptrs [N, D]`` (tokens ``[j P, (j + 1) P)`` of page ``j``); ``e`` and ``m`` read and the steps
    ``2^(e/4)`` taken once per page and channel, from ``page_rows [N / P]`` (row ``P`` of each page, this kv
    head and half: the exponents; the means in rows ``P + 1``, channels ``< D/2``, and ``P + 2``) where
    ``page_ok [N / P]``; 0 where not ``mask``."""
    c = tl.load(ptrs, mask=mask, other=0)  # [N, D]
    rows_mask = page_ok[:, None] & (offs_d < HEAD_DIM)[None, :]  # [N / P, D]
    e = tl.load(page_rows[:, None] + offs_d[None, :], mask=rows_mask, other=0)  # [N / P, D]
    half: tl.constexpr = HEAD_DIM // 2
    mean_at = page_rows[:, None] + ((1 + offs_d // half) * stride_p + 2 * (offs_d % half))[None, :]  # [N / P, D]
    m = tl.load(mean_at.to(tl.pointer_type(tl.bfloat16)), mask=rows_mask, other=0.0).to(tl.float32)
    step = tl.exp2(e.to(tl.float32) * _OCTAVE_STEP)  # [N / P, D]
    c3 = tl.reshape(c, (page_rows.shape[0], PAGE, c.shape[1])).to(tl.float32)  # [N / P, P, D]
    x = tl.reshape(c3 * step[:, None, :] + m[:, None, :], (c.shape[0], c.shape[1]))  # [N, D]
    return tl.where(mask, x, 0.0)


@triton.jit
def fp16_query(q):
    """A query tile ``q [R, D]`` as fp16 dot operands for FP8 keys, and the power of two ``[]`` to multiply
    the logits by.

    E4M3 -> fp16 is exact and one native instruction per two values (E4M3 -> bf16 takes that and one
    more per value), so FP8 keys meet fp16 queries. bf16 -> fp16 keeps bf16's 8 significant bits but
    not its range, so the tile is scaled by ``2^-k`` that puts its largest magnitude in
    ``[2^14, 2^15)``, below fp16's 65504: exact (a power of two, folded into the logits' scale), and
    only values ``2^-28`` below the largest fall into fp16's subnormals, where they keep an absolute
    error under ``2^-39`` of it: far below what the fp32 sum over D loses anyway.
    """
    qf = q.to(tl.float32)
    e = ((tl.max(tl.abs(qf)).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # exponent of the largest magnitude
    k = tl.minimum(tl.maximum(e - 14, -100), 100)  # (an all-zero tile: -100)
    down = ((127 - k) << 23).to(tl.float32, bitcast=True)  # 2^-k
    return (qf * down).to(tl.float16), ((127 + k) << 23).to(tl.float32, bitcast=True)


@triton.jit
def convert_where_loaded(x, dtype: tl.constexpr):
    """A tile ``x`` (FP8) as ``dtype`` (16-bit, or fp32 under the interpreter), converted in the layout it was
    loaded in.

    For the operand of a dot that contracts over the tile's rows (V in ``P @ V``): left alone, Triton
    moves the conversion past the operand's shared-memory load, and reads the transposed 8-bit
    operand one byte per instruction. A non-pure inline-asm identity, which Triton does not move,
    keeps the conversion here: the operand goes through shared memory as 16-bit values, read with
    ``ldmatrix.trans``. The interpreter has no inline asm (and no layouts).
    """
    x = x.to(dtype)
    if not _INTERPRET:
        x = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=2)
    return x


@triton.jit
def query_operand(qt, qk_scale, FP8_HALF: tl.constexpr, DOT_F32: tl.constexpr):
    """The query tile ``qt [G, D]`` as the Q K^T operand, and the logits' scale to go with it: fp16 (scaled
    by :func:`fp16_query`) for FP8 pages with 16-bit queries, fp32 with ``DOT_F32``, else as loaded."""
    if FP8_HALF:
        qt, q_scale = fp16_query(qt)
        qk_scale = qk_scale * q_scale
    elif DOT_F32:
        qt = qt.to(tl.float32)
    return qt, qk_scale


@triton.jit
def value_operand(v, qt, FP8_HALF: tl.constexpr, DOT_F32: tl.constexpr):
    """A loaded V tile ``[N, D]`` as the P V operand: FP8 pages with 16-bit queries in bf16 (fp32 under the
    interpreter; V's scales, on P, span more than fp16's range), converted where loaded; else ``qt``'s dtype."""
    if FP8_HALF:
        v = convert_where_loaded(v, tl.float32 if DOT_F32 else tl.bfloat16)
    else:
        v = v.to(qt.dtype)
    return v


@triton.jit
def online_softmax_step(s, m_i, l_i):
    """Fold a block of logits ``s [R, N]`` (log2 units) into the running row max ``m_i [R]`` and sum
    ``l_i [R]``: ``(p [R, N], alpha [R] to rescale the accumulator by, new max, new sum)``."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [R]
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block with no counted key yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])  # [R, N]
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def finish_rows(acc, m_i, l_i, lse_scale):
    """Output ``acc / l_i`` ``[R, D]`` and the rows' log2 LSE times ``lse_scale`` ``[R]`` (-inf, output 0
    for a row that counted no key)."""
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]  # [R, D]
    return o, tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * lse_scale, float("-inf"))


@dataclass(frozen=True)
class PrefillConfig:
    """Launch shape: ``block_m`` tile rows (queries x padded group), ``block_n`` keys per step, each tile's keys
    in ``kv_splits`` programs (merged by LSE)."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 5  # the page-index load takes a stage: 5 triple-buffers K/V
    kv_splits: int = 1


@dataclass
class PrefillPlan:
    """Query tiles of one step (int32 on the batch's device)."""

    tile_seq: torch.Tensor  # [T] sequence of each tile
    tile_q0: torch.Tensor  # [T] first query of the tile, local to its sequence
    block_q: int  # queries per tile
    group_pad: int  # query heads per kv head, padded to a power of two
    block_n: int
    config: PrefillConfig  # its kv_splits: the programs each tile's keys are split over


# (launch shape, the programs per multiprocessor its grid must give at least), largest tile first: tuned on an
# H200 with Triton 3.6 over chunks of 128 to 8k tokens and prefixes of 0 to 8k (``bench/kernels.py --tune``); the
# 256-row tile only for heads of up to 128 dims (its accumulator takes 128 registers a thread there)
PREFILL_CONFIGS = ((PrefillConfig(block_m=256, block_n=64, num_warps=8, num_stages=3), 2.0), (PrefillConfig(), 0.75),
                   (PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=5), 0.0))


def tile_rows(num_qo_heads: int, num_kv_heads: int, block_m: int) -> tuple[int, int]:
    """``(group_pad, block_q)``: a kv group's query heads padded to a power of two, and the queries a tile of
    ``block_m`` rows holds (row ``r``: query ``r // group_pad``, head ``r % group_pad``)."""
    group_pad = triton.next_power_of_2(num_qo_heads // num_kv_heads)
    return group_pad, max(1, block_m // group_pad)


SPLIT_WAVES = 2.0  # a grid under this many programs per multiprocessor splits its tiles' keys ...
MIN_SPLIT_KEYS = 1024  # ... into splits of at least this many keys
MAX_KV_SPLITS = 8


def num_multiprocessors(device: torch.device) -> int:
    """SM count of a CUDA device (4 under the interpreter, where it only sizes the splits)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def default_prefill_config(tokens: int, num_qo_heads: int, num_kv_heads: int, head_dim: int, device,
                           keys: int = 0) -> PrefillConfig:
    """The launch shape for a call of ``tokens`` queries over at most ``keys`` keys a sequence: the largest query
    tile whose grid (``tokens`` / tile queries x kv heads programs) still fills the multiprocessors as
    :data:`PREFILL_CONFIGS` asks (a short chunk takes small tiles: more programs over its prefix); a grid still
    under :data:`SPLIT_WAVES` programs per multiprocessor splits each tile's keys, a power of two of splits."""
    sms = num_multiprocessors(torch.device(device))
    configs = PREFILL_CONFIGS[head_dim > 128:]
    programs = lambda c: -(-tokens // tile_rows(num_qo_heads, num_kv_heads, c.block_m)[1]) * num_kv_heads  # noqa: E731
    config = next((c for c, waves in configs if programs(c) >= waves * sms), configs[-1][0])
    splits = 1
    while splits < MAX_KV_SPLITS and programs(config) * splits < SPLIT_WAVES * sms and \
            keys >= 2 * splits * MIN_SPLIT_KEYS:
        splits *= 2
    return replace(config, kv_splits=splits)


def plan_prefill(batch: PagedBatch, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 config: PrefillConfig | None = None) -> PrefillPlan:
    """List the query tiles of every sequence (host work on the host ``qo_indptr``, one non-blocking copy);
    ``config`` None: :func:`default_prefill_config`."""
    check_page_size(batch.page_size)
    q_lens = np.diff(batch.host("qo_indptr"))
    keys = int(np.diff(batch.host("kv_indptr")).max(initial=0)) * batch.page_size
    config = config or default_prefill_config(int(q_lens.sum()), num_qo_heads, num_kv_heads, head_dim,
                                              batch.qo_indptr.device, keys)
    group_pad, block_q = tile_rows(num_qo_heads, num_kv_heads, config.block_m)
    seq, q0 = query_tiles(q_lens, block_q)
    return PrefillPlan(*to_device([seq, q0], batch.qo_indptr.device), block_q, group_pad,
                       max(config.block_n, batch.page_size), config)


def query_tiles(q_lens: np.ndarray, block_q: int, grid: int = 0, pad_seq: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The query tiles of sequences of ``q_lens [B]`` queries: ``(sequence [T], first query [T])``, each sequence's
    last tile first (under the causal mask it sees the most keys: the short tiles fill the last wave of
    programs), then tiles of sequence ``pad_seq`` (one with no query) up to ``grid`` tiles."""
    tiles = -(-np.asarray(q_lens) // block_q)  # [B]
    seq = np.repeat(np.arange(tiles.size), tiles)[::-1]  # [n]
    q0 = (np.arange(seq.size)[::-1] - (np.cumsum(tiles) - tiles)[seq]) * block_q  # [n]
    pad = max(grid - seq.size, 0)
    return np.concatenate([seq, np.full(pad, pad_seq)]), np.concatenate([q0, np.zeros(pad, dtype=q0.dtype)])


@triton.jit
def _prefill_block(
    acc, m_i, l_i, qt, k_base, v_base, ks_base, vs_base, kv_indices, page_max, seq_p0, start, kv_len, lo, limit,
    row_ok, head0, stride_slot, stride_p, stride_pm, stride_ss, qk_scale,
    MASKED: tl.constexpr, SCALED: tl.constexpr, INT8: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    WITH_PAGE_MAX: tl.constexpr, PRECISION: tl.constexpr,
):
    """Online-softmax step over keys ``[start, start + BLOCK_N)``; ``lo [M]`` / ``limit [M]`` are each
    row's first and last key (applied with ``MASKED``)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    tok = start + offs_n  # [N]
    if MASKED:
        tok_ok = tok < kv_len
    else:  # a block every row sees whole ends before kv_len: true masks, which the compiler drops from the loads
        tok_ok = tl.full([BLOCK_N], 1, tl.int1)
    slot = tl.load(kv_indices + seq_p0 + tok // PAGE, mask=tok_ok, other=0).to(tl.int64)  # [N]
    kv_off = (slot * stride_slot + (tok % PAGE) * stride_p)[:, None] + offs_d[None, :]  # [N, D]
    if BLOCK_D == HEAD_DIM:
        kv_mask = tok_ok[:, None] & tl.full([1, BLOCK_D], 1, tl.int1)
    else:
        kv_mask = tok_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    pg = start // PAGE + tl.arange(0, BLOCK_N // PAGE)  # [NP] local page (blocks start on a page)
    pg_ok = pg * PAGE < kv_len  # [NP]
    if INT8:  # K and V read back whole from their steps and means, read once per page
        pg_slot = tl.load(kv_indices + seq_p0 + pg, mask=pg_ok, other=0).to(tl.int64)  # [NP]
        scale_rows = pg_slot * stride_slot + PAGE * stride_p  # [NP] offset of each page's scale row
        k = int8_tile(k_base + kv_off, kv_mask, k_base + scale_rows, pg_ok, offs_d, stride_p, PAGE,
                      HEAD_DIM).to(qt.dtype)
    else:
        k = tl.load(k_base + kv_off, mask=kv_mask, other=0.0).to(qt.dtype)  # [N, D]
    s = tl.dot(qt, tl.trans(k), input_precision=PRECISION) * qk_scale  # [M, N] log2 units
    if SCALED:  # FP8 pages: K = values * the page's scale, folded into the logits
        s = s * token_scales(ks_base, slot * stride_ss, tok_ok)[None, :]
    if MASKED:
        s = tl.where(tok_ok[None, :] & (tok[None, :] <= limit[:, None]) & (tok[None, :] >= lo[:, None]), s,
                     float("-inf"))
    if WITH_PAGE_MAX:
        s_rows = tl.where(row_ok[:, None], s, float("-inf"))  # [M, N]
        pm = tl.max(tl.reshape(s_rows, [BLOCK_Q, G_PAD, BLOCK_N // PAGE, PAGE]), axis=3)  # [Q, G, NP]
        pm = tl.max(pm, axis=0)  # [G, NP]
        g = tl.arange(0, G_PAD)
        pm_ptrs = page_max + (seq_p0 + pg)[None, :] * stride_pm + (head0 + g)[:, None]
        tl.atomic_max(pm_ptrs, pm * 0.6931471805599453, mask=(g < GROUP)[:, None] & pg_ok[None, :])
    p, alpha, m_new, l_i = online_softmax_step(s, m_i, l_i)  # p [M, N]
    if INT8:
        v = int8_tile(v_base + kv_off, kv_mask, v_base + scale_rows, pg_ok, offs_d, stride_p, PAGE,
                      HEAD_DIM).to(qt.dtype)
    else:
        v = tl.load(v_base + kv_off, mask=kv_mask, other=0.0).to(qt.dtype)  # [N, D]
    if SCALED:  # V's scale on the probabilities (powers of two: exact)
        p = p * token_scales(vs_base, slot * stride_ss, tok_ok)[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(qt.dtype), v, input_precision=PRECISION)  # [M, D]
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    q, kv, scales, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, tile_seq, tile_q0,
    out, lse, page_max,
    stride_qn, stride_qh, stride_slot, stride_kv, stride_p, stride_kh,
    stride_ss, stride_skv, stride_sh,
    stride_os, stride_on, stride_oh, stride_ls, stride_ln, stride_pm,
    qk_scale, lse_scale, window_left,
    SPLITS: tl.constexpr, CAUSAL: tl.constexpr, SCALED: tl.constexpr, INT8: tl.constexpr, GROUP: tl.constexpr,
    G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, WITH_PAGE_MAX: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
):
    """One (query tile, kv head, split): rows ``[BLOCK_Q * G_PAD]`` of out ``[S, Nq, H, D]`` and lse ``[S, Nq, H]``
    (times ``lse_scale``: natural log with one split, log2 partials for :func:`merge_splits` with more)."""
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    b = tl.load(tile_seq + t)
    i0 = tl.load(tile_q0 + t)
    q_base = tl.load(qo_indptr + b)
    n_q = tl.load(qo_indptr + b + 1) - q_base
    seq_p0 = tl.load(kv_indptr + b)
    n_pages = tl.load(kv_indptr + b + 1) - seq_p0
    kv_len = tl.where(n_pages > 0, (n_pages - 1) * PAGE + tl.load(kv_last_page_len + b), 0)

    rows = tl.arange(0, BLOCK_M)
    qi = i0 + rows // G_PAD  # [M] query index local to the sequence
    g = rows % G_PAD  # [M] head within the kv group
    row_ok = (qi < n_q) & (g < GROUP)
    heads = kvh * GROUP + g  # [M]
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_ptrs = q + (q_base + qi)[:, None] * stride_qn + heads[:, None] * stride_qh + offs_d[None, :]  # [M, D]
    qt = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_F32:
        qt = qt.to(tl.float32)

    i_last = tl.minimum(i0 + BLOCK_Q, n_q) - 1
    if CAUSAL:
        limit = kv_len - n_q + qi  # [M] last key each row may see (bottom-right aligned)
        full_end = tl.maximum(tl.minimum(kv_len, kv_len - n_q + i0 + 1), 0)  # keys every row sees
        hi = tl.maximum(tl.minimum(kv_len, kv_len - n_q + i_last + 1), 0)
    else:
        limit = kv_len + tl.zeros([BLOCK_M], tl.int32)
        full_end = kv_len
        hi = kv_len
    full_end = (full_end // BLOCK_N) * BLOCK_N
    lo = kv_len - n_q + qi - window_left  # [M] first key each row may see (window)
    first = tl.maximum(kv_len - n_q + i0 - window_left, 0) // BLOCK_N * BLOCK_N  # blocks before: no row sees
    lo_last = tl.maximum(kv_len - n_q + i_last - window_left, 0)
    win_end = tl.minimum(tl.maximum((lo_last + BLOCK_N - 1) // BLOCK_N * BLOCK_N, first), hi)  # every row from here
    if SPLITS > 1:  # [first, hi) becomes this split's share of the tile's blocks; the bounds inside it, clamped
        per_split = tl.cdiv(tl.cdiv(hi - first, BLOCK_N), SPLITS) * BLOCK_N
        first = first + split * per_split
        hi = tl.minimum(hi, first + per_split)
        win_end = tl.maximum(tl.minimum(win_end, hi), first)
        full_end = tl.maximum(tl.minimum(full_end, hi), first)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = kv + kvh * stride_kh
    v_base = k_base + stride_kv
    ks_base = scales + kvh * stride_sh
    vs_base = ks_base + stride_skv
    for start in range(first, win_end, BLOCK_N):  # where the window starts: masked
        acc, m_i, l_i = _prefill_block(
            acc, m_i, l_i, qt, k_base, v_base, ks_base, vs_base, kv_indices, page_max, seq_p0, start, kv_len, lo,
            limit, row_ok, kvh * GROUP, stride_slot, stride_p, stride_pm, stride_ss, qk_scale,
            True, SCALED, INT8, GROUP, G_PAD, BLOCK_Q, PAGE, BLOCK_N, BLOCK_D, HEAD_DIM, WITH_PAGE_MAX, PRECISION)
    for start in range(win_end, full_end, BLOCK_N):  # every row sees the whole block
        acc, m_i, l_i = _prefill_block(
            acc, m_i, l_i, qt, k_base, v_base, ks_base, vs_base, kv_indices, page_max, seq_p0, start, kv_len, lo,
            limit, row_ok, kvh * GROUP, stride_slot, stride_p, stride_pm, stride_ss, qk_scale,
            False, SCALED, INT8, GROUP, G_PAD, BLOCK_Q, PAGE, BLOCK_N, BLOCK_D, HEAD_DIM, WITH_PAGE_MAX, PRECISION)
    for start in range(tl.maximum(full_end, win_end), hi, BLOCK_N):  # the causal diagonal: masked
        acc, m_i, l_i = _prefill_block(
            acc, m_i, l_i, qt, k_base, v_base, ks_base, vs_base, kv_indices, page_max, seq_p0, start, kv_len, lo,
            limit, row_ok, kvh * GROUP, stride_slot, stride_p, stride_pm, stride_ss, qk_scale,
            True, SCALED, INT8, GROUP, G_PAD, BLOCK_Q, PAGE, BLOCK_N, BLOCK_D, HEAD_DIM, WITH_PAGE_MAX, PRECISION)

    o, row_lse = finish_rows(acc, m_i, l_i, lse_scale)  # [M, D], [M]
    o_rows = q_base + qi  # [M]
    tl.store(out + split * stride_os + o_rows[:, None] * stride_on + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse + split * stride_ls + o_rows * stride_ln + heads, row_lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_out, part_lse, out, lse,
    stride_ps, stride_pn, stride_ph,
    stride_ls, stride_ln,
    stride_on, stride_oh, stride_lo,
    SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One (row, head): softmax-weighted sum of its ``SPLITS`` partials (log2 LSE), ``CHUNK`` splits per load."""
    row = tl.program_id(0)
    h = tl.program_id(1)
    lse_row = part_lse + row * stride_ln + h
    offs_s = tl.arange(0, BLOCK_S)  # [S]
    offs_d = tl.arange(0, BLOCK_D)  # [D]
    d_ok = offs_d < HEAD_DIM
    m = tl.max(tl.load(lse_row + offs_s * stride_ls, mask=offs_s < SPLITS, other=float("-inf")), axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, SPLITS, CHUNK):
        offs_c = s0 + tl.arange(0, CHUNK)  # [C]
        w = tl.exp2(tl.load(lse_row + offs_c * stride_ls, mask=offs_c < SPLITS, other=float("-inf")) - m_safe)  # [C]
        o_s = tl.load(part_out + offs_c[:, None] * stride_ps + row * stride_pn + h * stride_ph + offs_d[None, :],
                      mask=(w > 0)[:, None] & d_ok[None, :], other=0.0)  # [C, D]; empty splits are not read
        acc += tl.sum(w[:, None] * o_s, axis=0)
        total += tl.sum(w, axis=0)
    has = total > 0
    o = acc / tl.where(has, total, 1.0)  # [D]
    tl.store(out + row * stride_on + h * stride_oh + offs_d, o.to(out.dtype.element_ty), mask=d_ok)
    tl.store(lse + row * stride_lo + h,
             tl.where(has, (m + tl.log2(tl.where(has, total, 1.0))) * 0.6931471805599453, float("-inf")))


def merge_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold the partial states of key splits into ``out [N, H, D]`` and ``lse [N, H]`` (natural log): ``part_out
    [S, N, H, D]`` fp32 and ``part_lse [S, N, H]`` (log2; -inf for a split that counted no key, never read)."""
    splits, rows, heads, dim = part_out.shape
    block_s = triton.next_power_of_2(splits)
    chunk = min(block_s, 16)
    block_d = triton.next_power_of_2(dim)
    _merge_splits_kernel[(rows, heads)](
        part_out, part_lse, out, lse,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        SPLITS=splits, BLOCK_S=block_s, CHUNK=chunk, HEAD_DIM=dim, BLOCK_D=block_d,
        num_warps=max(chunk * block_d // 1024, 1),  # <= 8 partial values per thread and load
    )


MIN_DOT = 16  # tl.dot's smallest tile side on a GPU (the interpreter takes any)
SHARED_MEMORY_BUDGET = 200 << 10  # bytes per block; Hopper allows 227 KiB, Triton's own estimate differs a little


def fit_shared_memory(q_rows: int, block_n: int, num_stages: int, block_d: int, operand_bytes: int,
                      min_block_n: int, kv_bytes: int | None = None) -> tuple[int, int]:
    """``(block_n, num_stages)`` whose query tile ``[q_rows, block_d]`` and pipelined K/V tiles fit in
    shared memory: large heads (D=256) or fp32 operands take fewer stages, then smaller key blocks
    (never below ``min_block_n``). K/V tiles hold ``kv_bytes`` per value (the pool's; default the
    operands'); a pool narrower than the operands (FP8) also takes one converted V tile."""
    kv_bytes = operand_bytes if kv_bytes is None else kv_bytes

    def need(n: int, stages: int) -> int:
        converted = n * block_d * operand_bytes if kv_bytes < operand_bytes else 0
        return q_rows * block_d * operand_bytes + stages * 2 * n * block_d * kv_bytes + converted

    while need(block_n, num_stages) > SHARED_MEMORY_BUDGET:
        if num_stages > 2:
            num_stages -= 1
        elif block_n > min_block_n:
            block_n //= 2
        else:
            break
    return block_n, num_stages


def paged_prefill(q: torch.Tensor, kv_pool: torch.Tensor, batch: PagedBatch, plan: PrefillPlan, sm_scale: float,
                  return_page_max: bool = False) -> AttentionOutput:
    """Chunked-prefill attention of ``q [Nq, H, D]`` over ``kv_pool [slots, 2, P, N_kv, D]`` (8-bit: ``P + R``
    rows, dequantized in the kernel as :mod:`kvtier.quant` stores them).

    Returns out ``[Nq, H, D]`` (q's dtype), lse ``[Nq, H]`` (natural log; -inf for a row that
    attends nothing) and optionally page_max ``[nnz, H]`` (-inf for a page no row sees).
    """
    n_q, heads, dim = q.shape
    n_kv = kv_pool.shape[3]
    if q.stride(-1) != 1 or kv_pool.stride(-1) != 1:
        raise ValueError("q and kv_pool need a contiguous head dimension")
    dot_f32, precision = dot_operand_dtype(q.dtype)
    block_d = triton.next_power_of_2(dim)
    block_n, num_stages = fit_shared_memory(plan.block_q * plan.group_pad, plan.block_n, plan.config.num_stages,
                                            block_d, 4 if dot_f32 else q.element_size(), batch.page_size)
    out = torch.empty(n_q, heads, dim, dtype=q.dtype, device=q.device)  # [Nq, H, D]
    lse = torch.empty(n_q, heads, dtype=torch.float32, device=q.device)  # [Nq, H]
    splits = plan.config.kv_splits
    if splits == 1:
        part_out, part_lse = out.unsqueeze(0), lse.unsqueeze(0)
    else:
        part_out = torch.empty(splits, n_q, heads, dim, dtype=torch.float32, device=q.device)  # [S, Nq, H, D]
        part_lse = torch.empty(splits, n_q, heads, dtype=torch.float32, device=q.device)  # [S, Nq, H] log2
    page_max = (torch.full((batch.kv_indices.numel(), heads), float("-inf"), dtype=torch.float32, device=q.device)
                if return_page_max else None)
    scales, stride_ss, stride_skv, stride_sh, scaled, int8 = scale_args(kv_pool, batch.page_size)
    _prefill_kernel[(plan.tile_seq.numel(), n_kv, splits)](
        q, kv_pool, scales, batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len,
        plan.tile_seq, plan.tile_q0,
        part_out, part_lse, page_max if return_page_max else lse,
        q.stride(0), q.stride(1),
        kv_pool.stride(0), kv_pool.stride(1), kv_pool.stride(2), kv_pool.stride(3),
        stride_ss, stride_skv, stride_sh,
        *part_out.stride()[:3], *part_lse.stride()[:2], heads,
        sm_scale * LOG2E, LN2 if splits == 1 else 1.0, kernel_window(batch),
        SPLITS=splits, CAUSAL=batch.causal, SCALED=scaled, INT8=int8, GROUP=heads // n_kv, G_PAD=plan.group_pad,
        BLOCK_Q=plan.block_q, PAGE=batch.page_size, BLOCK_N=block_n, HEAD_DIM=dim, BLOCK_D=block_d,
        WITH_PAGE_MAX=return_page_max, DOT_F32=dot_f32, PRECISION=precision,
        num_warps=plan.config.num_warps, num_stages=num_stages,
    )
    if splits > 1:
        merge_splits(part_out, part_lse, out, lse)
    return AttentionOutput(out, lse, page_max)
