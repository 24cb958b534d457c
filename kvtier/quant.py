"""FP8 E4M3 KV pages: values plus one power-of-two scale per (page, K/V, kv head), stored in the page.

A stored page is ``[2, P + 1, N_kv, D]`` float8_e4m3fn: rows ``0..P-1`` of each half hold K (V)
divided by the scale, row ``P`` holds each head's fp32 scale in its first 4 bytes. The scales are
bytes of the page, so every tier (device, host, disk, remote, and any tier that moves pages)
carries them with no code of its own, and the disk/remote checksums cover them. Costs one row in
``P + 1`` of storage; the kernels read 4 bytes of it per head.

Granularity, per (page, K/V, kv head) (KIVI, Liu et al. 2024, keeps per-channel K groups; vLLM
and FlashInfer FP8 use one scale per layer): a page's scale comes from its own values at the
moment they are written, so no calibration pass is needed, an outlier token costs precision only
in its own page, and a page keeps its scale when it moves between tiers or is shared by forks.

Scales are powers of two (as OCP MX's E8M0 scales): E4M3's relative precision is the same at any
scale, so rounding the scale up to ``2^ceil(log2(amax / 448))`` costs at most the lowest binade,
and when a later token of a partly filled page is larger than the page's range, the page's
earlier values are rescaled by ``old / new`` (a power of two: exact, bar values falling below
E4M3's smallest subnormal) and the scale grows. No value ever exceeds 448.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite E4M3 value
MIN_SCALE = 2.0 ** -100  # the scale of an all-zero page (any later value grows it)


def page_values(pages: torch.Tensor) -> torch.Tensor:
    """The value rows of stored pages ``[n, 2, P + 1, N_kv, D]``: a view ``[n, 2, P, N_kv, D]``."""
    return pages[:, :, :-1]


def page_scales(pages: torch.Tensor) -> torch.Tensor:
    """The scales of stored pages ``[n, 2, P + 1, N_kv, D]``: a writable fp32 view ``[n, 2, N_kv]``."""
    return pages[:, :, -1, :, :4].view(torch.float32)[..., 0]


def dequantize(pages: torch.Tensor) -> torch.Tensor:
    """Stored pages ``[n, 2, P + 1, N_kv, D]`` as fp32 ``[n, 2, P, N_kv, D]``."""
    return page_values(pages).float() * page_scales(pages)[:, :, None, :, None]


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two ``s`` with ``amax / s <= 448`` (fp32, same shape; ``MIN_SCALE`` for 0)."""
    x = (amax.float() / FP8_MAX).clamp_min(MIN_SCALE)
    mant, exp = torch.frexp(x)  # x = mant * 2^exp, mant in [0.5, 1)
    return torch.ldexp(torch.ones_like(x), exp - (mant == 0.5).to(exp.dtype))


def quantize_pages(kv: torch.Tensor) -> torch.Tensor:
    """Whole pages ``[n, 2, P, N_kv, D]`` (any float dtype) as stored FP8 pages ``[n, 2, P + 1, N_kv, D]``."""
    n, _, page, n_kv, dim = kv.shape
    out = torch.empty(n, 2, page + 1, n_kv, dim, dtype=FP8, device=kv.device)
    tok = torch.arange(n * page, device=kv.device)  # [n * P]
    write_scaled(out, torch.arange(n, device=kv.device), tok // page, tok % page,
                 kv.transpose(0, 1).reshape(2, n * page, n_kv, dim))
    return out


def write_scaled(pool: torch.Tensor, pages: torch.Tensor, inv: torch.Tensor, offs: torch.Tensor,
                 kv: torch.Tensor) -> None:
    """Quantize tokens ``kv [2, m, N_kv, D]`` into stored pages: token ``i`` goes to row ``offs[i]`` of
    page ``pages[inv[i]]`` of ``pool [S, 2, P + 1, N_kv, D]``.

    ``pages [u]`` (distinct slots), ``inv [m]``, ``offs [m]`` are int64 on the pool's device. A page
    written from row 0 starts afresh (zeros, no scale); a page whose new tokens exceed its range gets
    the larger power-of-two scale and its earlier rows rescaled, exactly. No host sync.
    """
    n_pages = pages.numel()
    values = page_values(pool)
    tok_amax = kv.float().abs().amax(-1).transpose(0, 1)  # [m, 2, N_kv]
    new_amax = torch.zeros(n_pages, *tok_amax.shape[1:], device=pool.device).scatter_reduce_(
        0, inv[:, None, None].expand_as(tok_amax), tok_amax, "amax")  # [u, 2, N_kv]
    fresh = torch.zeros(n_pages, device=pool.device).scatter_reduce_(
        0, inv, (offs == 0).float(), "amax").bool()  # [u] starts at row 0
    old = torch.where(fresh[:, None, None], 0.0, page_scales(pool)[pages])  # [u, 2, N_kv]
    new = torch.maximum(old, pow2_scale(new_amax))  # [u, 2, N_kv]
    ratio = (old / new)[:, :, None, :, None]  # [u, 2, 1, N_kv, 1]: 1 kept, 2^-k grown, 0 fresh
    kept = values[pages].float()  # [u, 2, P, N_kv, D]
    values[pages] = torch.where(ratio > 0, kept * ratio, 0.0).to(FP8)
    row = torch.zeros(n_pages, 2, pool.shape[3], pool.shape[4], dtype=FP8, device=pool.device)  # [u, 2, N_kv, D]
    page_scales(row[:, :, None])[:] = new  # the whole scale row, padding zeroed: same bytes on every tier
    pool[pages, :, -1] = row
    tok_scale = new[inv][:, :, :, None]  # [m, 2, N_kv, 1]
    values[pages[inv], :, offs] = (kv.transpose(0, 1).float() / tok_scale).to(FP8)  # [m, 2, N_kv, D]


def is_scaled_pool(kv_pool: torch.Tensor, page_size: int) -> bool:
    """Whether a pool ``[slots, 2, rows, N_kv, D]`` holds FP8 pages with scale rows (checked: ``rows = P + 1``)."""
    if kv_pool.dtype != FP8:
        return False
    if kv_pool.shape[2] != page_size + 1 or kv_pool.shape[-1] % 4:
        raise ValueError(f"an FP8 pool needs pages [2, page_size + 1, N_kv, D] (values plus a scale row, D a "
                         f"multiple of 4), got {tuple(kv_pool.shape[1:])} for page_size {page_size}")
    return True
