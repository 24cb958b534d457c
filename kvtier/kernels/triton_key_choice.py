"""The choice of single keys by a low-rank sketch: two Triton launches per layer, each over every chunk of keys.

Each kv head of each row chooses its own keys (the unit that reaches the full cache's quality: ``bench/RESULTS.md``,
"Recall"). A key's score is its estimated weight beside the keys the step shows anyway (the sinks and the window),
the largest over its kv group's query heads: ``max_g (s_g(t) - lse_g)``, with approximate logits ``s_g(t) = scale *
(A^T q_g) . y_t`` from the key's sketch ``y_t`` (rank ``r``, 8 bits, and ``A`` the (layer, kv head)'s query map:
:class:`kvtier.stats.KeyStats`; Loki, Singhania et al., 2024, arXiv:2406.02542; ShadowKV, Sun et al., 2024,
arXiv:2410.21465) and ``lse_g`` their log-sum-exp over the shown keys, which every program computes for itself (a
normaliser over every key would need a launch of its own). Scores are cut into
:data:`~kvtier.kernels.base.SCORE_BINS` equal bins over ``SCORE_RANGE``: keys in one bin are equal choices, the lower
position first. A step attends the shown keys and the ``n`` best of the others, listed as key positions for the
decode kernel (:func:`kvtier.kernels.triton_decode.static_decode`'s ``key_list``).

The keys of a row are cut into ``C`` chunks (at most :data:`MAX_CHUNKS`, each ``K`` sub-blocks of :data:`SUB`
keys) and both launches have a grid of ``(B * N_kv, C)`` programs, so that a single row keeps the GPU busy:

1. bins: each program maps its group's queries (the query map), scores the shown keys and its chunk's candidates
   from their sketches (gathered by page), writes each candidate's bin and the chunk's histogram of them;
2. emit: from every chunk's histogram, the threshold bin (the ``n``-th largest: a one-level radix select, no sort);
   each program writes its chunk's keys above it and its ties in position order while the ``n`` last, at their
   places in the list (the keys of the chunks before it counted from their histograms), and its part of the shown
   spans: the sinks, the chosen keys, the window, then -1.

No host work, no sync, static shapes: the launches are captured with the decode step. Contract:
:func:`kvtier.kernels.reference.key_choice_reference`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvtier.kernels.base import DROPPED as DROPPED_SLOT
from kvtier.kernels.base import SCORE_BINS, SCORE_RANGE

DROPPED = tl.constexpr(DROPPED_SLOT)  # block-table value of a page dropped for good
BINS = tl.constexpr(SCORE_BINS)
LOW, HIGH = tl.constexpr(SCORE_RANGE[0]), tl.constexpr(SCORE_RANGE[1])
SUB = 512  # keys a program handles at once
SHOWN = 64  # shown keys a program scores at once (for the normaliser)
MAX_CHUNKS = 32  # chunks of a row: what each program merges of the others' histograms


@dataclass(frozen=True, eq=False)
class KeyChoiceWork:
    """Scratch of :func:`key_choice` for ``rows`` rows of up to ``keys`` keys in ``chunks`` chunks of ``per_chunk``
    sub-blocks: each key's score bin ``[rows, N_kv, keys]`` int16 and each chunk's histogram of them ``[rows, N_kv,
    chunks, BINS]`` int32."""

    bins: torch.Tensor
    hist: torch.Tensor
    per_chunk: int

    @staticmethod
    def make(rows: int, num_kv_heads: int, keys: int, device) -> "KeyChoiceWork":
        blocks = triton.cdiv(keys, SUB)
        per_chunk = triton.cdiv(blocks, MAX_CHUNKS)
        chunks = triton.cdiv(blocks, per_chunk)
        return KeyChoiceWork(torch.empty(rows, num_kv_heads, chunks * per_chunk * SUB, dtype=torch.int16,
                                         device=device),
                             torch.empty(rows, num_kv_heads, chunks, SCORE_BINS, dtype=torch.int32, device=device),
                             per_chunk)

    @property
    def chunks(self) -> int:
        return self.hist.shape[2]


@triton.jit
def _program(N_KV: tl.constexpr):
    """``(b, h, c)``: the row, kv head and chunk of a program of grid ``(B * N_kv, C)``."""
    bh = tl.program_id(0)
    return bh // N_KV, bh % N_KV, tl.program_id(1)


@triton.jit
def _spans(b, lens_ptr, spans_ptr, window):
    """Row ``b``'s ``(n, lo, c_lo, c_hi, n_sink, w_lo, n_win)``: its keys, the first its query sees, the candidates
    ``[c_lo, c_hi)`` (the keys the shown spans leave out), and the shown sinks and window (every key it sees, as
    sinks, when the row fits: ``win_start = 0``)."""
    n = tl.load(lens_ptr + b)
    lo = tl.where(window > 0, tl.maximum(n - window, 0), 0)
    sinks = tl.load(spans_ptr + b * 2)
    win = tl.load(spans_ptr + b * 2 + 1)
    whole = win == 0
    c_lo = tl.maximum(lo, sinks)
    c_hi = tl.where(whole, c_lo, tl.maximum(win, c_lo))
    n_sink = tl.where(whole, n - lo, tl.maximum(tl.minimum(sinks, n) - lo, 0))
    w_lo = tl.maximum(win, lo)
    return n, lo, c_lo, c_hi, n_sink, w_lo, tl.where(whole, 0, n - w_lo)


@triton.jit
def _sketches(t, ok, b, h, pid_ptr, table_ptr, sketch_ptr, s_pb, s_tb, s_sp, s_st, s_sh,
              R: tl.constexpr, BLOCK_R: tl.constexpr, PAGE: tl.constexpr):
    """``(y [T, R] fp32, vis [T])``: the sketches of row ``b``'s keys ``t [T]`` for kv head ``h``, and which of them
    count (``ok`` and stored: a page, not one dropped for good)."""
    r = tl.arange(0, BLOCK_R)
    pid = tl.load(pid_ptr + b * s_pb + t // PAGE, mask=ok, other=-1)
    loc = tl.load(table_ptr + b * s_tb + t // PAGE, mask=ok, other=DROPPED)
    vis = ok & (pid >= 0) & (loc != DROPPED)
    y = tl.load(sketch_ptr + pid.to(tl.int64)[:, None] * s_sp + (t % PAGE)[:, None] * s_st + h * s_sh + r[None, :],
                mask=vis[:, None] & (r < R)[None, :], other=0).to(tl.float32)
    return y, vis


@triton.jit
def _head(x, g, i):
    """Head ``i``'s entry of ``x [G, ...]``: its row ``x[i]``."""
    return tl.sum(tl.where((g == i)[:, None], x, 0.0), axis=0)


@triton.jit
def _key_bins_kernel(q_ptr, map_ptr, sketch_ptr, pid_ptr, table_ptr, lens_ptr, spans_ptr, bin_ptr, hist_ptr,
                     window, scale, s_qb, s_qh, s_bh, s_bd, s_sp, s_st, s_sh, s_pb, s_tb, s_ib, s_ih, s_hb, s_hh, s_hc,
                     N_KV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                     BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, PAGE: tl.constexpr,
                     SUB: tl.constexpr, K: tl.constexpr, SHOWN: tl.constexpr):
    """Program ``(b * N_kv + h, c)``: each candidate of chunk ``c`` as its score's bin (-1: not a candidate) and the
    chunk's histogram of them. The score: ``max_g (s_g - lse_g)``, ``lse_g`` over the shown keys (each program
    computes it from their sketches: no program waits for another)."""
    b, h, c = _program(N_KV)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    r = tl.arange(0, BLOCK_R)
    qg = tl.load(q_ptr + b * s_qb + (h * GROUP + g)[:, None] * s_qh + d[None, :],
                 mask=(g < GROUP)[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)  # [G, D]
    u = tl.load(map_ptr + h * s_bh + d[:, None] * s_bd + r[None, :], mask=(d < D)[:, None] & (r < R)[None, :],
                other=0.0)  # [D, R]
    qr = tl.dot(qg, u, input_precision="ieee") * scale  # [G, R] the queries through the map, scaled
    n, lo, c_lo, c_hi, n_sink, w_lo, n_win = _spans(b, lens_ptr, spans_ptr, window)
    t0 = c * K * SUB + tl.arange(0, SUB)  # [SUB] the chunk's first keys: loaded before the shown keys' pass
    y0, vis0 = _sketches(t0, (t0 >= c_lo) & (t0 < c_hi), b, h, pid_ptr, table_ptr, sketch_ptr, s_pb, s_tb, s_sp,
                         s_st, s_sh, R, BLOCK_R, PAGE)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    shown = tl.where(c_hi > c_lo, n_sink + n_win, 0)  # no candidates: nothing to score
    for e0 in range(0, shown, SHOWN):
        e = e0 + tl.arange(0, SHOWN)  # [SHOWN] entries of the shown spans
        y, vis = _sketches(tl.where(e < n_sink, lo + e, w_lo + e - n_sink), e < shown, b, h, pid_ptr, table_ptr,
                           sketch_ptr, s_pb, s_tb, s_sp, s_st, s_sh, R, BLOCK_R, PAGE)
        s = tl.where(vis[None, :], tl.dot(qr, tl.trans(y), input_precision="ieee"), float("-inf"))  # [G, SHOWN]
        m_new = tl.maximum(m, tl.max(s, axis=1))  # [G]
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        total = total * tl.exp(m - safe) + tl.sum(tl.exp(s - safe[:, None]), axis=1)
        m = m_new
    lse = tl.where(m == float("-inf"), 0.0, m + tl.log(total))  # [G]; 0 where a head is shown no key
    hist = tl.zeros([BINS], tl.int32)
    for k in tl.static_range(K):
        t = (c * K + k) * SUB + tl.arange(0, SUB)  # [SUB] key positions
        if k == 0:
            y, vis = y0, vis0
        else:
            y, vis = _sketches(t, (t >= c_lo) & (t < c_hi), b, h, pid_ptr, table_ptr, sketch_ptr, s_pb, s_tb, s_sp,
                               s_st, s_sh, R, BLOCK_R, PAGE)  # [SUB, R], [SUB]
        score = tl.full([SUB], float("-inf"), tl.float32)  # the largest share over the group, log
        for i in tl.static_range(GROUP):
            s = tl.sum(y * _head(qr, g, i)[None, :], axis=1)  # [SUB] head i's logits
            score = tl.maximum(score, s - tl.sum(tl.where(g == i, lse, 0.0)))
        cand = vis & (score > float("-inf"))  # NaN: never
        level = tl.minimum(tl.maximum(score, LOW), HIGH)
        bins = tl.minimum(((level - LOW) * (BINS / (HIGH - LOW))).to(tl.int32), BINS - 1)
        tl.store(bin_ptr + b * s_ib + h * s_ih + t, tl.where(cand, bins, -1).to(tl.int16))
        hist += tl.histogram(bins, BINS, mask=cand)
    tl.store(hist_ptr + b * s_hb + h * s_hh + c * s_hc + tl.arange(0, BINS), hist)


@triton.jit
def _key_emit_kernel(bin_ptr, hist_ptr, lens_ptr, spans_ptr, out_ptr, n_keys, width, chunks, window,
                     s_ib, s_ih, s_hb, s_hh, s_hc, s_ob, s_oh,
                     N_KV: tl.constexpr, BLOCK_C: tl.constexpr, SUB: tl.constexpr, K: tl.constexpr,
                     SPAN: tl.constexpr):
    """Program ``(b * N_kv + h, c)``: the threshold bin (the ``n``-th largest) from every chunk's histogram; chunk
    ``c``'s keys above it, and its ties in position order while the ``n`` last, at their places in the list (after
    the shown sinks and the keys of the chunks before, counted from their histograms); and list entries ``[c SPAN,
    (c + 1) SPAN)`` of the shown spans (the sinks, then the window after the chosen keys, then -1)."""
    b, h, c = _program(N_KV)
    cc = tl.arange(0, BLOCK_C)
    j = tl.arange(0, BINS)
    hist = tl.load(hist_ptr + b * s_hb + h * s_hh + cc[:, None] * s_hc + j[None, :], mask=(cc < chunks)[:, None],
                   other=0)  # [C, BINS]
    every = tl.sum(hist, axis=0)  # [BINS]
    kk = tl.minimum(n_keys, tl.sum(every))  # keys chosen
    need = tl.maximum(kk, 1)
    ge = tl.cumsum(every, 0, reverse=True)  # [BINS] candidates in a bin >= j
    threshold = tl.max(tl.where(ge >= need, j, -1))  # the bin of the n-th largest
    need -= tl.sum(tl.where(j > threshold, every, 0))  # ties of the threshold to take, lowest positions first
    before = (cc < c)[:, None]  # [C, 1] the chunks before this one
    taken = tl.sum(tl.sum(tl.where(before & (j > threshold)[None, :], hist, 0), axis=1))  # above the threshold
    tied = tl.sum(tl.sum(tl.where(before & (j == threshold)[None, :], hist, 0), axis=1))
    taken += tl.minimum(tied, need)
    _, lo, _, _, n_sink, w_lo, n_win = _spans(b, lens_ptr, spans_ptr, window)
    out = out_ptr + b * s_ob + h * s_oh
    for k in range(K):
        t = (c * K + k) * SUB + tl.arange(0, SUB)
        bins = tl.load(bin_ptr + b * s_ib + h * s_ih + t).to(tl.int32)
        tie = (bins == threshold).to(tl.int32)
        take = ((bins > threshold) | ((tie > 0) & (tied + tl.cumsum(tie, 0) - tie < need))) & (kk > 0)
        place = n_sink + taken + tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(out + place, t, mask=take & (place < width))
        taken += tl.sum(take.to(tl.int32))
        tied += tl.sum(tie)
    end = tl.minimum((c + 1) * SPAN, width)
    for e0 in range(c * SPAN, end, SUB):
        e = e0 + tl.arange(0, SUB)
        shown = tl.where(e < n_sink, lo + e, tl.where(e < n_sink + kk + n_win, w_lo + e - n_sink - kk, -1))
        tl.store(out + e, shown, mask=((e < n_sink) | (e >= n_sink + kk)) & (e < end))


def key_choice(q: torch.Tensor, query_map: torch.Tensor, sketch: torch.Tensor, pids: torch.Tensor, table: torch.Tensor,
               lens: torch.Tensor, spans: torch.Tensor, n: int, out: torch.Tensor, window: int = 0,
               scale: float | None = None, work: KeyChoiceWork | None = None) -> torch.Tensor:
    """Each kv head's keys for the decode query ``q [B, H, D]`` (any float dtype, fp32 math) into ``out [B, N_kv,
    W]`` int32: the keys the spans show and the ``n`` best of the others, in position order, then -1.

    ``query_map [N_kv, D, r]`` fp32 and ``sketch [capacity, P, N_kv, r]`` (int8 or any float dtype: each stored
    key's sketch) of the layer; ``pids [B, M]`` (-1 none) and ``table [B, M]`` (the block table: ``DROPPED`` pages are not seen);
    ``lens [B]`` keys per row, the newest included (0: an idle row, all -1); ``spans [B, 2]`` ``(sinks, win_start)``:
    the keys ``< sinks`` and ``>= win_start`` are shown, ``win_start = 0`` every key; ``window``: a sliding layer's
    keys per query (0: global); ``scale``: the logits' (``D^-0.5``); ``work``: scratch for at least B rows of ``M
    P`` keys. Contract: :func:`kvtier.kernels.reference.key_choice_reference`."""
    B, H, D = q.shape
    n_kv, r = query_map.shape[0], query_map.shape[-1]
    P, M = sketch.shape[1], pids.shape[1]
    work = work or KeyChoiceWork.make(B, n_kv, M * P, q.device)
    assert q.stride(-1) == 1 and query_map.is_contiguous() and sketch.stride(-1) == 1 and out.stride(-1) == 1
    assert pids.stride(-1) == 1 and table.stride(-1) == 1 and spans.is_contiguous() and out.dtype == torch.int32
    assert work.bins.shape[-1] >= M * P
    if B == 0:
        return out
    scale = D ** -0.5 if scale is None else scale
    C, K, width, group = work.chunks, work.per_chunk, out.shape[-1], H // n_kv
    grid = (B * n_kv, C)
    bins = (work.bins.stride(0), work.bins.stride(1))
    hist = (work.hist.stride(0), work.hist.stride(1), work.hist.stride(2))
    _key_bins_kernel[grid](
        q, query_map, sketch, pids, table, lens, spans, work.bins, work.hist, window, scale,
        q.stride(0), q.stride(1), query_map.stride(0), query_map.stride(1), sketch.stride(0), sketch.stride(1),
        sketch.stride(2), pids.stride(0), table.stride(0), *bins, *hist,
        N_KV=n_kv, GROUP=group, D=D, R=r, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=triton.next_power_of_2(D), BLOCK_R=max(16, triton.next_power_of_2(r)), PAGE=P, SUB=SUB, K=K,
        SHOWN=SHOWN, num_warps=4)
    _key_emit_kernel[grid](
        work.bins, work.hist, lens, spans, out, n, width, C, window, *bins, *hist, out.stride(0), out.stride(1),
        N_KV=n_kv, BLOCK_C=max(2, triton.next_power_of_2(C)), SUB=SUB, K=K, SPAN=triton.cdiv(width, C), num_warps=4)
    return out
