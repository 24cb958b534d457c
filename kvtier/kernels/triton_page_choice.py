"""Quest's page choice for one layer in two Triton launches: bounds of every candidate page, then the top k.

Quest (Tang et al., 2024, arXiv:2406.10774) scores a page by the upper bound of q·k over its keys,
``sum_d max(q_d kmin_d, q_d kmax_d)`` from the page's per-channel key min/max, and attends the k best.
Here a page's score is the max of that bound over the query heads (and query rows) of the row, or of one
kv head's group (``kv_head``); the choice is the one of :func:`kvtier.kernels.reference.page_choice_reference`:
the ``k`` (per row at most ``count``) candidates with the highest scores, equal scores the lower logical page
first, listed in page order, then -1 (:func:`kvtier.scopes.base.best_of`).

The scoring grid is ``(B, cdiv(M, BLOCK_M))``: each program scores a block of a row's pages (the bound reads
``2 N_kv D`` floats per page, the bulk of the work, so every multiprocessor takes part at B=1) and writes the
order-preserving int32 image of each score (non-candidates below every score) into a scratch row. The
selection, one program per row, chooses without a sort: it holds the row's images in registers, finds the
k-th largest image ``t`` by bisection on the integer range (32 steps of one count each), and emits the images
above ``t``, then the ties ``== t`` in page order until k are taken, at their prefix-sum positions. It runs in
one warp for rows of up to ``ONE_WARP_PAGES`` pages, so that its 32 counts need no block-wide barrier. (Run by the
scoring launch's last program, found by an atomic ticket, the selection took 5.4 of a launch's 9.7 us on an H200
at 512 pages, with three block barriers per count. Two launches take 8.9 us: ``bench/RESULTS.md``, "Kernels".)
No host work, no sync, static shapes: both launches are captured with the decode step. The cost grows with the
pages scored (``B M``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

INT_MIN = tl.constexpr(-(2 ** 31))  # the image of a page that is not a candidate
INT_MAX = tl.constexpr(2 ** 31 - 1)
BLOCK_M = 32  # pages per scoring program
ONE_WARP_PAGES = 512  # the longest row that one warp selects from (at 1,024 one warp was slower than four)


@dataclass(frozen=True, eq=False)
class ChoiceWork:
    """Scratch of :func:`page_choice` for up to ``rows`` rows of ``max_pages`` pages: score images ``[rows,
    stride]`` int32 (rows padded to 128 bytes)."""

    images: torch.Tensor

    @staticmethod
    def make(rows: int, max_pages: int, device) -> "ChoiceWork":
        stride = -(-max_pages // 32) * 32
        return ChoiceWork(torch.empty(rows, stride, dtype=torch.int32, device=device))


@triton.jit
def _page_scores_kernel(q_ptr, kmin_ptr, kmax_ptr, pid_ptr, cand_ptr, img_ptr, M, kv_lo, n_scored,
                        s_qb, s_qr, s_qh, s_kp, s_kn, s_pb, s_cb, s_ib,
                        ROWS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_M: tl.constexpr):
    """Program ``(b, blk)``: the images of row ``b``'s pages ``[blk * BLOCK_M, (blk + 1) * BLOCK_M)``."""
    b = tl.program_id(0)
    blk = tl.program_id(1)
    pages = blk * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] logical pages
    in_row = pages < M
    pid = tl.load(pid_ptr + b * s_pb + pages, mask=in_row, other=-1)
    ok = (tl.load(cand_ptr + b * s_cb + pages, mask=in_row, other=0) != 0) & (pid >= 0)
    d = tl.arange(0, BLOCK_D)
    tile = ok[:, None] & (d < D)[None, :]
    at = pid.to(tl.int64)[:, None] * s_kp + d[None, :]  # [BLOCK_M, BLOCK_D]
    score = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for n in range(kv_lo, kv_lo + n_scored):  # kv heads scored
        kmin = tl.load(kmin_ptr + at + n * s_kn, mask=tile, other=0.0)  # [BLOCK_M, BLOCK_D]
        kmax = tl.load(kmax_ptr + at + n * s_kn, mask=tile, other=0.0)
        for j in range(ROWS * GROUP):  # the query heads of kv head n, of every query row
            qv = tl.load(q_ptr + b * s_qb + (j // GROUP) * s_qr + (n * GROUP + j % GROUP) * s_qh + d,
                         mask=d < D, other=0.0).to(tl.float32)[None, :]  # [1, BLOCK_D]
            bound = tl.sum(tl.maximum(qv * kmin, qv * kmax), axis=1)  # [BLOCK_M]
            score = tl.maximum(score, bound)
    score = tl.where(score == 0.0, 0.0, score)  # -0 ranks as +0
    bits = score.to(tl.int32, bitcast=True)
    image = tl.where(bits >= 0, bits, bits ^ INT_MAX)  # order-preserving: a < b <=> image(a) < image(b)
    image = tl.where(ok & (score > float("-inf")), image, INT_MIN)  # NaN or -inf: never taken
    tl.store(img_ptr + b * s_ib + pages, image, mask=in_row)


@triton.jit
def _page_select_kernel(img_ptr, count_ptr, out_ptr, M, K, s_ib, s_ob,
                        BLOCK_SEL: tl.constexpr, BLOCK_K: tl.constexpr, HAS_COUNT: tl.constexpr):
    """Program ``b``: row ``b``'s best ``K`` (at most ``count[b]``) pages from its images, in page order."""
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK_SEL)
    img = tl.load(img_ptr + b * s_ib + offs, mask=offs < M, other=INT_MIN)  # [BLOCK_SEL]
    want = K
    if HAS_COUNT:
        want = tl.minimum(tl.maximum(tl.load(count_ptr + b).to(tl.int32), 0), K)
    kk = tl.minimum(want, tl.sum((img > INT_MIN).to(tl.int32)))  # picks of this row
    lo = tl.full([], INT_MIN + 1, tl.int64)  # the largest t with #(img >= t) >= kk lies in [lo, hi]
    hi = tl.full([], INT_MAX, tl.int64)
    for _ in range(32):
        mid = lo + (hi - lo + 1) // 2
        enough = tl.sum((img >= mid.to(tl.int32)).to(tl.int32)) >= kk
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    t = lo.to(tl.int32)
    above = img > t
    tie = (img == t).to(tl.int32)
    taken = above | ((tie > 0) & (tl.cumsum(tie, 0) - tie < kk - tl.sum(above.to(tl.int32))))  # ties, page order
    pos = tl.cumsum(taken.to(tl.int32), 0) - 1
    tl.store(out_ptr + b * s_ob + pos, offs, mask=taken)
    slots = tl.arange(0, BLOCK_K)
    tl.store(out_ptr + b * s_ob + slots, tl.full([BLOCK_K], -1, tl.int32), mask=(slots >= kk) & (slots < K))


def page_choice(q: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor, pids: torch.Tensor,
                cand: torch.Tensor, k: int, count: torch.Tensor | None = None, kv_head: int | None = None,
                work: ChoiceWork | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Quest's choice of one layer in two launches: logical pages ``[B, k]`` int32 (page order, -1 none).

    ``q [B, H, D]`` or ``[B, r, H, D]`` (query rows; any float dtype, fp32 math), the layer's key bounds
    ``key_min``/``key_max [capacity, N_kv, D]`` (fp32), ``pids [B, M]`` (-1 none), ``cand [B, M]`` (bool or
    int8), ``count [B]`` (at most that many picks per row; None: ``k``), ``kv_head`` (score by that kv
    head's query heads only; None: every head), ``work`` (scratch for at least B rows of M pages; None: made
    here), ``out [B, k]`` int32 (rows of any stride; None: made here). Contract:
    :func:`kvtier.kernels.reference.page_choice_reference`.
    """
    B, M = pids.shape
    out = torch.empty(B, k, dtype=torch.int32, device=pids.device) if out is None else out  # [B, k]
    if k == 0 or B == 0:
        return out
    q4 = q if q.dim() == 4 else q[:, None]  # [B, r, H, D]
    rows, H, D = q4.shape[1:]
    n_kv = key_min.shape[1]
    assert key_min.stride() == key_max.stride() and key_min.stride(-1) == 1 and q4.stride(-1) == 1
    assert pids.stride(-1) == 1 and cand.stride(-1) == 1 and out.stride(-1) == 1 and out.dtype == torch.int32
    work = work or ChoiceWork.make(B, M, pids.device)
    _page_scores_kernel[(B, triton.cdiv(M, BLOCK_M))](
        q4, key_min, key_max, pids, cand.view(torch.int8) if cand.dtype == torch.bool else cand, work.images,
        M, 0 if kv_head is None else kv_head, n_kv if kv_head is None else 1,
        q4.stride(0), q4.stride(1), q4.stride(2), key_min.stride(0), key_min.stride(1), pids.stride(0),
        cand.stride(0), work.images.stride(0),
        ROWS=rows, GROUP=H // n_kv, D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_M=BLOCK_M, num_warps=4)
    block_sel = triton.next_power_of_2(M)
    _page_select_kernel[(B,)](
        work.images, count if count is not None else out, out, M, k, work.images.stride(0), out.stride(0),
        BLOCK_SEL=block_sel, BLOCK_K=triton.next_power_of_2(k), HAS_COUNT=count is not None,
        num_warps=1 if block_sel <= ONE_WARP_PAGES else 4 if block_sel <= 2048 else 8)
    return out
