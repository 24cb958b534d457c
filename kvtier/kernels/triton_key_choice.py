"""The choice of single keys by a low-rank sketch: four Triton launches per layer, each over every chunk of keys.

Each kv head of each row chooses its own keys (the unit that reaches the full cache's quality: ``bench/RESULTS.md``,
"Recall"). A key's score is its estimated share of the attention of its kv group's query heads, the largest over
the group: ``max_g (s_g(t) - lse_g)``, with approximate logits ``s_g(t) = scale * (U^T q_g) . y_t`` from the key's
sketch ``y_t = U^T k_t`` (rank ``r``, ``U`` the (layer, kv head)'s top principal directions of the keys: Loki,
Singhania et al., 2024, arXiv:2406.02542; ShadowKV, Sun et al., 2024, arXiv:2410.21465) and ``lse_g`` their
log-sum-exp over every key the query sees. A step attends the budget's shown keys (the sinks and the window) and
the ``n`` best of the others, listed as key positions for the decode kernel
(:func:`kvtier.kernels.triton_decode.static_decode`'s ``key_list``).

The keys of a row are cut into ``C`` chunks (at most :data:`MAX_CHUNKS`, each ``K`` sub-blocks of :data:`SUB`
keys) and every launch has a grid of ``(B * N_kv, C)`` programs, so that a single row keeps the GPU busy:

1. logits: each program projects its group's queries on the basis and scores its chunk's keys from their sketches
   (gathered by page); it writes the logits and each head's partial log-sum-exp;
2. images: each program merges the partials into each head's log-sum-exp, turns each candidate's score into a
   16-bit order-preserving image (the score's top 16 bits: equal images are equal choices, ties the lower
   position first) and writes its chunk's histogram of their top bytes;
3. digit: from every chunk's histogram, the top byte of the ``n``-th largest image; each program then writes its
   chunk's histogram of the low bytes of the images with that top byte (a two-level radix select: no sort);
4. emit: from both levels, the threshold image; each program writes its chunk's keys above it and its ties in
   position order while the ``n`` last, at their places in the list (the keys of the chunks before it counted from
   their histograms), and its part of the shown spans: the sinks, the chosen keys, the window, then -1.

No host work, no sync, static shapes: the launches are captured with the decode step. Contract:
:func:`kvtier.kernels.reference.key_choice_reference`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvtier.kernels.base import DROPPED as DROPPED_SLOT

DROPPED = tl.constexpr(DROPPED_SLOT)  # block-table value of a page dropped for good
SUB = 512  # keys a program handles at once
MAX_CHUNKS = 32  # chunks of a row: what each program merges of the others' histograms


@dataclass(frozen=True, eq=False)
class KeyChoiceWork:
    """Scratch of :func:`key_choice` for ``rows`` rows of up to ``keys`` keys in ``chunks`` chunks of ``per_chunk``
    sub-blocks: logits ``[rows, N_kv, G, keys]`` fp32, partial maxima and sums ``[rows, N_kv, chunks, G]`` fp32,
    images ``[rows, N_kv, keys]`` int32 and the two levels' histograms ``[rows, N_kv, chunks, 256]`` int32."""

    logits: torch.Tensor
    part_max: torch.Tensor
    part_sum: torch.Tensor
    images: torch.Tensor
    hist1: torch.Tensor
    hist2: torch.Tensor
    per_chunk: int

    @staticmethod
    def make(rows: int, num_kv_heads: int, group: int, keys: int, device) -> "KeyChoiceWork":
        blocks = triton.cdiv(keys, SUB)
        per_chunk = triton.cdiv(blocks, MAX_CHUNKS)
        chunks = triton.cdiv(blocks, per_chunk)
        keys = chunks * per_chunk * SUB
        f32 = dict(dtype=torch.float32, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        return KeyChoiceWork(torch.empty(rows, num_kv_heads, group, keys, **f32),
                             torch.empty(rows, num_kv_heads, chunks, group, **f32),
                             torch.empty(rows, num_kv_heads, chunks, group, **f32),
                             torch.empty(rows, num_kv_heads, keys, **i32),
                             torch.empty(rows, num_kv_heads, chunks, 256, **i32),
                             torch.empty(rows, num_kv_heads, chunks, 256, **i32), per_chunk)

    @property
    def chunks(self) -> int:
        return self.hist1.shape[2]


@triton.jit
def _key_logits_kernel(q_ptr, basis_ptr, sketch_ptr, pid_ptr, table_ptr, lens_ptr, logit_ptr, pmax_ptr, psum_ptr,
                       window, scale, s_qb, s_qh, s_bh, s_bd, s_sp, s_st, s_sh, s_pb, s_tb,
                       s_lb, s_lh, s_lg, s_mb, s_mh, s_mc,
                       N_KV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                       BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, PAGE: tl.constexpr,
                       SUB: tl.constexpr, K: tl.constexpr):
    """Program ``(b * N_kv + h, c)``: the approximate logits ``[G, K SUB]`` of chunk ``c``'s keys of row ``b`` for
    kv head ``h``'s query heads (-inf where not seen: past the row, left of its window, in a dropped page), and each
    head's max and sum of exp over them."""
    bh = tl.program_id(0)
    c = tl.program_id(1)
    b = bh // N_KV
    h = bh % N_KV
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    r = tl.arange(0, BLOCK_R)
    qg = tl.load(q_ptr + b * s_qb + (h * GROUP + g)[:, None] * s_qh + d[None, :],
                 mask=(g < GROUP)[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)  # [G, D]
    u = tl.load(basis_ptr + h * s_bh + d[:, None] * s_bd + r[None, :], mask=(d < D)[:, None] & (r < R)[None, :],
                other=0.0)  # [D, R]
    qr = tl.sum(qg[:, :, None] * u[None, :, :], axis=1)  # [G, R] the queries in the sketch's basis
    n = tl.load(lens_ptr + b)
    lo = tl.where(window > 0, tl.maximum(n - window, 0), 0)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    for k in range(K):
        t = (c * K + k) * SUB + tl.arange(0, SUB)  # [SUB] key positions
        in_row = (t >= lo) & (t < n)
        pid = tl.load(pid_ptr + b * s_pb + t // PAGE, mask=in_row, other=-1)
        loc = tl.load(table_ptr + b * s_tb + t // PAGE, mask=in_row, other=DROPPED)
        vis = in_row & (pid >= 0) & (loc != DROPPED)
        y = tl.load(sketch_ptr + pid.to(tl.int64)[:, None] * s_sp + (t % PAGE)[:, None] * s_st + h * s_sh
                    + r[None, :], mask=vis[:, None] & (r < R)[None, :], other=0.0).to(tl.float32)  # [SUB, R]
        s = tl.dot(qr, tl.trans(y), input_precision="ieee") * scale  # [G, SUB]
        s = tl.where(vis[None, :], s, float("-inf"))
        tl.store(logit_ptr + b * s_lb + h * s_lh + g[:, None] * s_lg + t[None, :], s, mask=(g < GROUP)[:, None])
        m_new = tl.maximum(m, tl.max(s, axis=1))  # [G]
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        total = total * tl.exp(m - safe) + tl.sum(tl.exp(s - safe[:, None]), axis=1)
        m = m_new
    tl.store(pmax_ptr + b * s_mb + h * s_mh + c * s_mc + g, m, mask=g < GROUP)
    tl.store(psum_ptr + b * s_mb + h * s_mh + c * s_mc + g, total, mask=g < GROUP)


@triton.jit
def _image16(score):
    """The top 16 bits of ``score``'s order-preserving int32 image, in ``[0, 65535]`` (-0 ranks as +0)."""
    bits = tl.where(score == 0.0, 0.0, score).to(tl.int32, bitcast=True)
    image = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # a < b <=> image(a) < image(b)
    return (image >> 16) + 32768


@triton.jit
def _spans(b, lens_ptr, spans_ptr, window):
    """Row ``b``'s ``(lo, c_lo, c_hi, n_sink, w_lo, n_win)``: the first key its query sees, the candidates ``[c_lo,
    c_hi)`` (the keys the shown spans leave out), and the shown sinks and window (every key it sees, as sinks, when
    the row fits: ``win_start = 0``)."""
    n = tl.load(lens_ptr + b)
    lo = tl.where(window > 0, tl.maximum(n - window, 0), 0)
    sinks = tl.load(spans_ptr + b * 2)
    win = tl.load(spans_ptr + b * 2 + 1)
    whole = win == 0
    c_lo = tl.maximum(lo, sinks)
    c_hi = tl.where(whole, c_lo, tl.maximum(win, c_lo))
    n_sink = tl.where(whole, n - lo, tl.maximum(tl.minimum(sinks, n) - lo, 0))
    w_lo = tl.maximum(win, lo)
    return lo, c_lo, c_hi, n_sink, w_lo, tl.where(whole, 0, n - w_lo)


@triton.jit
def _key_images_kernel(logit_ptr, pmax_ptr, psum_ptr, img_ptr, hist_ptr, lens_ptr, spans_ptr, window, chunks,
                       s_lb, s_lh, s_lg, s_mb, s_mh, s_mc, s_ib, s_ih, s_hb, s_hh, s_hc,
                       N_KV: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr,
                       SUB: tl.constexpr, K: tl.constexpr):
    """Program ``(b * N_kv + h, c)``: each candidate's score in chunk ``c`` (``max_g (s_g - lse_g)``, the heads'
    log-sum-exp merged from every chunk's partials) as a 16-bit image (-1: not a candidate), and the chunk's
    histogram of their top bytes."""
    bh = tl.program_id(0)
    c = tl.program_id(1)
    b = bh // N_KV
    h = bh % N_KV
    g = tl.arange(0, BLOCK_G)
    cc = tl.arange(0, BLOCK_C)
    part = b * s_mb + h * s_mh + cc[:, None] * s_mc + g[None, :]
    ok = (cc < chunks)[:, None] & (g < GROUP)[None, :]
    pm = tl.load(pmax_ptr + part, mask=ok, other=float("-inf"))  # [C, G]
    ps = tl.load(psum_ptr + part, mask=ok, other=0.0)
    m = tl.max(pm, axis=0)  # [G]
    safe = tl.where(m == float("-inf"), 0.0, m)
    lse = safe + tl.log(tl.sum(ps * tl.exp(pm - safe[None, :]), axis=0))  # [G]; -inf where a head sees no key
    lse = tl.where(g < GROUP, lse, float("inf"))  # padding heads: never the largest share
    _, c_lo, c_hi, _, _, _ = _spans(b, lens_ptr, spans_ptr, window)
    hist = tl.zeros([256], tl.int32)
    for k in range(K):
        t = (c * K + k) * SUB + tl.arange(0, SUB)
        s = tl.load(logit_ptr + b * s_lb + h * s_lh + g[:, None] * s_lg + t[None, :],
                    mask=(g < GROUP)[:, None] & (t < c_hi)[None, :], other=float("-inf"))  # [G, SUB]
        score = tl.max(s - lse[:, None], axis=0)  # [SUB] the largest share over the group, log
        cand = (t >= c_lo) & (t < c_hi) & (score > float("-inf"))  # NaN: never
        img = tl.where(cand, _image16(score), -1)
        tl.store(img_ptr + b * s_ib + h * s_ih + t, img)
        hist += tl.histogram((img >> 8) & 255, 256, mask=cand)
    tl.store(hist_ptr + b * s_hb + h * s_hh + c * s_hc + tl.arange(0, 256), hist)


@triton.jit
def _level(hist_ptr, b, h, s_hb, s_hh, s_hc, chunks, BLOCK_C: tl.constexpr):
    """Every chunk's histogram of one level ``[C, 256]`` (zeros past ``chunks``)."""
    cc = tl.arange(0, BLOCK_C)
    at = hist_ptr + b * s_hb + h * s_hh + cc[:, None] * s_hc + tl.arange(0, 256)[None, :]
    return tl.load(at, mask=(cc < chunks)[:, None], other=0)


@triton.jit
def _digit(hist, need):
    """From a level's histogram ``[256]`` of the images still in play: ``(digit, above)``, the digit of the
    ``need``-th largest of them and how many have a larger digit."""
    ge = tl.cumsum(hist, 0, reverse=True)  # [256] images with a digit >= j
    j = tl.arange(0, 256)
    digit = tl.max(tl.where(ge >= need, j, -1))
    return digit, tl.sum(tl.where(j > digit, hist, 0))


@triton.jit
def _key_digit_kernel(img_ptr, hist1_ptr, hist2_ptr, n_keys, chunks, s_ib, s_ih, s_hb, s_hh, s_hc,
                      N_KV: tl.constexpr, BLOCK_C: tl.constexpr, SUB: tl.constexpr, K: tl.constexpr):
    """Program ``(b * N_kv + h, c)``: the top byte of the ``n``-th largest image (from every chunk's histogram),
    and chunk ``c``'s histogram of the low bytes of the images with that top byte."""
    bh = tl.program_id(0)
    c = tl.program_id(1)
    b = bh // N_KV
    h = bh % N_KV
    hist1 = tl.sum(_level(hist1_ptr, b, h, s_hb, s_hh, s_hc, chunks, BLOCK_C), axis=0)  # [256]
    hi, _ = _digit(hist1, tl.maximum(tl.minimum(n_keys, tl.sum(hist1)), 1))
    hist = tl.zeros([256], tl.int32)
    for k in range(K):
        t = (c * K + k) * SUB + tl.arange(0, SUB)
        img = tl.load(img_ptr + b * s_ib + h * s_ih + t)
        hist += tl.histogram(img & 255, 256, mask=(img >= 0) & ((img >> 8) == hi))
    tl.store(hist2_ptr + b * s_hb + h * s_hh + c * s_hc + tl.arange(0, 256), hist)


@triton.jit
def _key_emit_kernel(img_ptr, hist1_ptr, hist2_ptr, lens_ptr, spans_ptr, out_ptr, n_keys, width, chunks, window,
                     s_ib, s_ih, s_hb, s_hh, s_hc, s_ob, s_oh,
                     N_KV: tl.constexpr, BLOCK_C: tl.constexpr, SUB: tl.constexpr, K: tl.constexpr,
                     SPAN: tl.constexpr):
    """Program ``(b * N_kv + h, c)``: the threshold image (the ``n``-th largest) from both levels' histograms;
    chunk ``c``'s keys above it, and its ties in position order while the ``n`` last, at their places in the list
    (after the shown sinks and the keys of the chunks before); and list entries ``[c SPAN, (c + 1) SPAN)`` of the
    shown spans (the sinks, then the window after the chosen keys, then -1)."""
    bh = tl.program_id(0)
    c = tl.program_id(1)
    b = bh // N_KV
    h = bh % N_KV
    hist1 = _level(hist1_ptr, b, h, s_hb, s_hh, s_hc, chunks, BLOCK_C)  # [C, 256]
    hist2 = _level(hist2_ptr, b, h, s_hb, s_hh, s_hc, chunks, BLOCK_C)
    kk = tl.minimum(n_keys, tl.sum(tl.sum(hist1, axis=1)))  # keys chosen
    need = tl.maximum(kk, 1)
    hi, above = _digit(tl.sum(hist1, axis=0), need)
    lo8, above2 = _digit(tl.sum(hist2, axis=0), need - above)
    need = need - above - above2  # ties of the threshold to take, lowest positions first
    threshold = hi * 256 + lo8
    j = tl.arange(0, 256)
    before = (tl.arange(0, BLOCK_C) < c)[:, None]  # [C, 1] the chunks before this one
    taken = tl.sum(tl.sum(tl.where(before & (j > hi)[None, :], hist1, 0), axis=1)) + \
        tl.sum(tl.sum(tl.where(before & (j > lo8)[None, :], hist2, 0), axis=1))  # above the threshold
    tied = tl.sum(tl.sum(tl.where(before & (j == lo8)[None, :], hist2, 0), axis=1))
    taken += tl.minimum(tied, need)
    lo, _, _, n_sink, w_lo, n_win = _spans(b, lens_ptr, spans_ptr, window)
    out = out_ptr + b * s_ob + h * s_oh
    for k in range(K):
        t = (c * K + k) * SUB + tl.arange(0, SUB)
        img = tl.load(img_ptr + b * s_ib + h * s_ih + t)
        tie = ((img == threshold) & (img >= 0)).to(tl.int32)
        take = ((img > threshold) | ((tie > 0) & (tied + tl.cumsum(tie, 0) - tie < need))) & (kk > 0)
        place = n_sink + taken + tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(out + place, t, mask=take & (place < width))
        taken += tl.sum(take.to(tl.int32))
        tied += tl.sum(tie)
    end = tl.minimum((c + 1) * SPAN, width)
    for e0 in range(c * SPAN, end, SUB):
        e = e0 + tl.arange(0, SUB)
        shown = tl.where(e < n_sink, lo + e, tl.where(e < n_sink + kk + n_win, w_lo + e - n_sink - kk, -1))
        tl.store(out + e, shown, mask=((e < n_sink) | (e >= n_sink + kk)) & (e < end))


def key_choice(q: torch.Tensor, basis: torch.Tensor, sketch: torch.Tensor, pids: torch.Tensor, table: torch.Tensor,
               lens: torch.Tensor, spans: torch.Tensor, n: int, out: torch.Tensor, window: int = 0,
               scale: float | None = None, work: KeyChoiceWork | None = None) -> torch.Tensor:
    """Each kv head's keys for the decode query ``q [B, H, D]`` (any float dtype, fp32 math) into ``out [B, N_kv,
    W]`` int32: the keys the spans show and the ``n`` best of the others, in position order, then -1.

    ``basis [N_kv, D, r]`` fp32 and ``sketch [capacity, P, N_kv, r]`` (bf16 or fp32: each stored key on the basis) of
    the layer; ``pids [B, M]`` (-1 none) and ``table [B, M]`` (the block table: ``DROPPED`` pages are not seen);
    ``lens [B]`` keys per row, the newest included (0: an idle row, all -1); ``spans [B, 2]`` ``(sinks, win_start)``:
    the keys ``< sinks`` and ``>= win_start`` are shown, ``win_start = 0`` every key; ``window``: a sliding layer's
    keys per query (0: global); ``scale``: the logits' (``D^-0.5``); ``work``: scratch for at least B rows of ``M
    P`` keys. Contract: :func:`kvtier.kernels.reference.key_choice_reference`."""
    B, H, D = q.shape
    n_kv, r = basis.shape[0], basis.shape[-1]
    P, M = sketch.shape[1], pids.shape[1]
    group = H // n_kv
    work = work or KeyChoiceWork.make(B, n_kv, group, M * P, q.device)
    assert q.stride(-1) == 1 and basis.is_contiguous() and sketch.stride(-1) == 1 and out.stride(-1) == 1
    assert pids.stride(-1) == 1 and table.stride(-1) == 1 and spans.is_contiguous() and out.dtype == torch.int32
    assert work.images.shape[-1] >= M * P and work.logits.shape[2] == group
    if B == 0:
        return out
    scale = D ** -0.5 if scale is None else scale
    C, K, width = work.chunks, work.per_chunk, out.shape[-1]
    grid = (B * n_kv, C)
    block_g, block_c = max(16, triton.next_power_of_2(group)), max(2, triton.next_power_of_2(C))
    logits = (work.logits.stride(0), work.logits.stride(1), work.logits.stride(2))
    parts = (work.part_max.stride(0), work.part_max.stride(1), work.part_max.stride(2))
    images = (work.images.stride(0), work.images.stride(1))
    hists = (work.hist1.stride(0), work.hist1.stride(1), work.hist1.stride(2))
    _key_logits_kernel[grid](
        q, basis, sketch, pids, table, lens, work.logits, work.part_max, work.part_sum, window, scale,
        q.stride(0), q.stride(1), basis.stride(0), basis.stride(1), sketch.stride(0), sketch.stride(1),
        sketch.stride(2), pids.stride(0), table.stride(0), *logits, *parts,
        N_KV=n_kv, GROUP=group, D=D, R=r, BLOCK_G=block_g, BLOCK_D=triton.next_power_of_2(D),
        BLOCK_R=max(16, triton.next_power_of_2(r)), PAGE=P, SUB=SUB, K=K, num_warps=4)
    _key_images_kernel[grid](
        work.logits, work.part_max, work.part_sum, work.images, work.hist1, lens, spans, window, C, *logits, *parts,
        *images, *hists, N_KV=n_kv, GROUP=group, BLOCK_G=block_g, BLOCK_C=block_c, SUB=SUB, K=K, num_warps=4)
    _key_digit_kernel[grid](
        work.images, work.hist1, work.hist2, n, C, *images, *hists, N_KV=n_kv, BLOCK_C=block_c, SUB=SUB, K=K,
        num_warps=4)
    _key_emit_kernel[grid](
        work.images, work.hist1, work.hist2, lens, spans, out, n, width, C, window, *images, *hists,
        out.stride(0), out.stride(1), N_KV=n_kv, BLOCK_C=block_c, SUB=SUB, K=K, SPAN=triton.cdiv(width, C),
        num_warps=4)
    return out
