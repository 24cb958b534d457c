"""8-bit KV pages: values plus what it takes to read them back, stored in extra rows of the page.

A stored page is ``[2, P + R, N_kv, D]`` of the pool's dtype: rows ``0..P-1`` of each half hold K (V), the ``R``
rows after them their scales, so every tier moves and checksums them as page bytes (:data:`SCALE_ROWS`):

- ``float8_e4m3fn`` (R = 1): one power-of-two fp32 scale per (page, K/V, kv head) in row ``P``'s first 4 bytes.
- ``int8`` (R = 3): ``x = m + 2^(e/4) · c``, ``c`` in [-127, 127]; per (page, K/V, kv head, channel) the step
  exponent ``e`` (row ``P``) and the channel's page mean ``m`` (bf16: rows ``P + 1``, ``P + 2`` hold channels
  ``[0, D/2)``, ``[D/2, D)``). Steps about the mean (KIVI, arXiv 2402.02750; SageAttention's K smoothing, arXiv
  2410.02367) keep bf16's perplexity where E4M3's 3 mantissa bits cost +2.8% (bench/fp8_quality.py).

A page's scales come from its own values when written (no calibration; an outlier costs precision in its page
only) and move with it. When a later token exceeds a partly filled page's range the scale grows (E4M3: a power of
two, exact; int8: a quarter octave, earlier values rounded again, at most 3.2 final steps in all); an int8 page's
mean is that of the write that starts it and stays.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
INT8 = torch.int8
FP8_MAX = 448.0  # largest finite E4M3 value
INT8_MAX = 127.0  # largest int8 step count used (symmetric)
STEPS_PER_OCTAVE = 4  # int8 steps are 2^(e / 4), e an int8
MIN_SCALE = 2.0 ** -100  # the scale of an all-zero FP8 page (any later value grows it)
SCALE_ROWS = {FP8: 1, INT8: 3}  # stored dtype -> rows of scales after the values in each half of a page


def is_scaled_pool(kv_pool: torch.Tensor, page_size: int) -> bool:
    """Whether a pool ``[slots, 2, rows, N_kv, D]`` holds 8-bit pages with scale rows (checked: ``rows = P + R``,
    ``D`` a multiple of 4; a ValueError names the shape it needs)."""
    if kv_pool.dtype not in SCALE_ROWS:
        return False
    rows = SCALE_ROWS[kv_pool.dtype]
    if kv_pool.shape[2] != page_size + rows or kv_pool.shape[-1] % 4:
        raise ValueError(f"a {kv_pool.dtype} pool needs pages [2, page_size + {rows}, N_kv, D] (values plus {rows} "
                         f"row(s) of scales, D a multiple of 4), got {tuple(kv_pool.shape[1:])} for page_size "
                         f"{page_size}")
    return True


def page_values(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """The value rows of stored pages ``[n, 2, P + R, N_kv, D]``: a view ``[n, 2, P, N_kv, D]``."""
    return pages[:, :, :page_size]


def page_scales(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """FP8 pages' scales ``[n, 2, N_kv]``: a writable fp32 view of the rows ``P`` of ``[n, 2, P + 1, N_kv, D]``."""
    return pages[:, :, page_size, :, :4].view(torch.float32)[..., 0]


def channel_steps(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """int8 pages' step exponents ``e`` ``[n, 2, N_kv, D]`` (a view of the rows ``P``): the steps are
    :func:`step_of` ``(e)``."""
    return pages[:, :, page_size]


def step_of(e: torch.Tensor) -> torch.Tensor:
    """The int8 step ``2^(e / 4)`` of exponents ``e`` (fp32, same shape)."""
    return torch.exp2(e.float() / STEPS_PER_OCTAVE)


def step_exponent(amax: torch.Tensor) -> torch.Tensor:
    """The smallest int8 exponent ``e`` with ``amax / 2^(e / 4) <= 127`` (int64, same shape; -128 for 0)."""
    e = torch.ceil(STEPS_PER_OCTAVE * torch.log2(amax.float() / INT8_MAX)).clamp(-128, 127)  # -inf -> -128
    e = e + ((amax > INT8_MAX * step_of(e)) & (e < 127)).float()  # log2's rounding, either way
    e = e - ((amax <= INT8_MAX * step_of(e - 1)) & (e > -128)).float()
    return e.long()


def channel_means(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """int8 pages' means ``[n, 2, N_kv, D]`` (bf16, a copy: the rows ``P + 1``, ``P + 2`` are not one view)."""
    return _means(pages[:, :, page_size + 1:page_size + 3])


def _means(rows: torch.Tensor) -> torch.Tensor:
    """The means held by the rows ``P + 1..P + 2`` ``[..., 2, N_kv, D]`` (int8 bytes) as bf16 ``[..., N_kv, D]``."""
    halves = rows.view(torch.bfloat16)  # [..., 2, N_kv, D / 2]
    return torch.cat([halves[..., 0, :, :], halves[..., 1, :, :]], -1)


def dequantize(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Stored pages ``[n, 2, P + R, N_kv, D]`` as fp32 ``[n, 2, P, N_kv, D]``."""
    values = page_values(pages, page_size).float()
    if pages.dtype == FP8:
        return values * page_scales(pages, page_size)[:, :, None, :, None]
    step = step_of(channel_steps(pages, page_size))  # [n, 2, N_kv, D]
    return values * step[:, :, None] + channel_means(pages, page_size).float()[:, :, None]


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two ``s`` with ``amax / s <= 448`` (fp32, same shape; ``MIN_SCALE`` for 0)."""
    x = (amax.float() / FP8_MAX).clamp_min(MIN_SCALE)
    mant, exp = torch.frexp(x)  # x = mant * 2^exp, mant in [0.5, 1)
    return torch.ldexp(torch.ones_like(x), exp - (mant == 0.5).to(exp.dtype))


def quantize_pages(kv: torch.Tensor, dtype: torch.dtype = FP8) -> torch.Tensor:
    """Whole pages ``[n, 2, P, N_kv, D]`` (any float dtype) as stored ``dtype`` pages ``[n, 2, P + R, N_kv, D]``."""
    n, _, page, n_kv, dim = kv.shape
    out = torch.empty(n, 2, page + SCALE_ROWS[dtype], n_kv, dim, dtype=dtype, device=kv.device)
    tok = torch.arange(n * page, device=kv.device)  # [n * P]
    write_scaled(out, page, torch.arange(n, device=kv.device), tok // page, tok % page,
                 kv.transpose(0, 1).reshape(2, n * page, n_kv, dim))
    return out


def write_scaled(pool: torch.Tensor, page_size: int, pages: torch.Tensor, inv: torch.Tensor, offs: torch.Tensor,
                 kv: torch.Tensor) -> None:
    """Quantize tokens ``kv [2, m, N_kv, D]`` into stored pages: token ``i`` goes to row ``offs[i]`` of
    page ``pages[inv[i]]`` of ``pool [S, 2, P + R, N_kv, D]`` (FP8 or int8).

    ``pages [u]`` (distinct slots), ``inv [m]``, ``offs [m]`` are int64 on the pool's device. A page
    written from row 0 starts afresh (zeros, no scale; an int8 page's mean from this write); a page whose
    new tokens exceed its range gets the larger scale (step) and its earlier rows rescaled.
    No host sync.
    """
    fresh = torch.zeros(pages.numel(), device=pool.device).scatter_reduce_(
        0, inv, (offs == 0).float(), "amax").bool()  # [u] starts at row 0
    x = kv.float().transpose(0, 1)  # [m, 2, N_kv, D]
    write = _write_e4m3 if pool.dtype == FP8 else _write_int8
    write(pool, page_size, pages, inv, offs, x, fresh)


def _write_e4m3(pool: torch.Tensor, page_size: int, pages: torch.Tensor, inv: torch.Tensor, offs: torch.Tensor,
                x: torch.Tensor, fresh: torch.Tensor) -> None:
    """Tokens ``x [m, 2, N_kv, D]`` (fp32) into FP8 pages (:func:`write_scaled`; ``fresh [u]``: written from row 0)."""
    values = page_values(pool, page_size)  # [S, 2, P, N_kv, D]
    tok_amax = x.abs().amax(-1)  # [m, 2, N_kv]
    new_amax = torch.zeros(pages.numel(), *tok_amax.shape[1:], device=pool.device).scatter_reduce_(
        0, inv[:, None, None].expand_as(tok_amax), tok_amax, "amax")  # [u, 2, N_kv]
    old = torch.where(fresh[:, None, None], 0.0, page_scales(pool, page_size)[pages])  # [u, 2, N_kv]
    new = torch.maximum(old, pow2_scale(new_amax))  # [u, 2, N_kv]
    ratio = (old / new)[:, :, None, :, None]  # [u, 2, 1, N_kv, 1]: 1 kept, 2^-k grown, 0 fresh
    values[pages] = torch.where(ratio > 0, values[pages].float() * ratio, 0.0).to(FP8)
    row = torch.zeros(pages.numel(), 2, *x.shape[2:], dtype=FP8, device=pool.device)  # [u, 2, N_kv, D]
    page_scales(row[:, :, None], 0)[:] = new  # the whole scale row, padding zeroed: same bytes on every tier
    pool[pages, :, page_size] = row
    values[pages[inv], :, offs] = (x / new[inv][..., None]).to(FP8)  # [m, 2, N_kv, D]


def _write_int8(pool: torch.Tensor, page_size: int, pages: torch.Tensor, inv: torch.Tensor, offs: torch.Tensor,
                x: torch.Tensor, fresh: torch.Tensor) -> None:
    """Tokens ``x [m, 2, N_kv, D]`` (fp32) into int8 pages as steps about each channel's page mean (module
    docstring; :func:`write_scaled`; ``fresh [u]``: written from row 0)."""
    u, dim = pages.numel(), x.shape[-1]
    values = page_values(pool, page_size)  # [S, 2, P, N_kv, D]
    zeros = torch.zeros(u, *x.shape[1:], device=pool.device)  # [u, 2, N_kv, D]
    count = torch.zeros(u, device=pool.device).index_add_(0, inv, torch.ones_like(inv, dtype=torch.float32))  # [u]
    first = zeros.index_add(0, inv, x) / count[:, None, None, None]  # [u, 2, N_kv, D]: this write's mean
    mean = torch.where(fresh[:, None, None, None], first.to(torch.bfloat16),
                       _means(pool[pages, :, page_size + 1:])).float()  # [u, 2, N_kv, D] as stored
    r = x - mean[inv]  # [m, 2, N_kv, D]
    r_amax = zeros.scatter_reduce(0, inv[:, None, None, None].expand_as(r), r.abs(), "amax")  # [u, 2, N_kv, D]
    need = step_exponent(r_amax)  # [u, 2, N_kv, D]
    old = channel_steps(pool, page_size)[pages].long()  # (stale bytes on fresh pages: not used)
    new = torch.where(fresh[:, None, None, None], need, torch.maximum(old, need))  # exponents only grow
    kept = torch.where(fresh[:, None, None, None], 0.0, step_of(old - new))[:, :, None]  # [u, 2, 1, N_kv, D]
    values[pages] = torch.round(values[pages].float() * kept).to(INT8)  # 1 kept, < 1 grown (rounded again)
    rows = torch.zeros(u, 2, 3, *x.shape[2:], dtype=INT8, device=pool.device)  # [u, 2, 3, N_kv, D]
    rows[:, :, 0] = new
    means = rows[:, :, 1:].view(torch.bfloat16)  # [u, 2, 2, N_kv, D / 2]
    means[:, :, 0], means[:, :, 1] = mean[..., :dim // 2], mean[..., dim // 2:]
    pool[pages, :, page_size:] = rows
    values[pages[inv], :, offs] = torch.round(r / step_of(new)[inv]).clamp(-INT8_MAX, INT8_MAX).to(INT8)
