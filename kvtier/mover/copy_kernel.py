"""One-launch page copy between two pools, e.g. pinned host DRAM <-> HBM through mapped (UVA) pointers.

Seed 000's "CXL HDM-D" access: the GPU reads and writes host pages with loads and stores, so a
batch of scattered pages moves in one kernel instead of one cudaMemcpy per page (4 GB/s on an
H200 for 256 pages of 32 KiB) and with no staging copy on the host.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_pages_kernel(src, src_slots, dst, dst_slots, PAGE_ELEMS: tl.constexpr, BLOCK: tl.constexpr):
    page = tl.program_id(0)
    part = tl.program_id(1)
    s = tl.load(src_slots + page).to(tl.int64)
    d = tl.load(dst_slots + page).to(tl.int64)
    offs = part * BLOCK + tl.arange(0, BLOCK)
    mask = (offs < PAGE_ELEMS) & (s >= 0)  # a negative source slot: nothing to copy (no memory traffic)
    x = tl.load(src + s * PAGE_ELEMS + offs, mask=mask)
    tl.store(dst + d * PAGE_ELEMS + offs, x, mask=mask)


def copy_pages(src_pool: torch.Tensor, src_slots: torch.Tensor, dst_pool: torch.Tensor, dst_slots: torch.Tensor,
               device: torch.device | None = None) -> None:
    """``dst_pool[dst_slots] = src_pool[src_slots]`` in one launch; entries whose source slot is negative
    are skipped (a static-shape caller's padding).

    Pools ``[slots, 2, P, N_kv, D]`` (contiguous, same dtype); one may be pinned host memory, read
    or written through its mapped device address. Slots are int tensors ``[n]`` on the launch device.
    """
    n = src_slots.numel()
    if n == 0:
        return
    dev = device or (src_pool.device if src_pool.is_cuda else dst_pool.device)
    page_bytes = src_pool[0].numel() * src_pool.element_size()
    word = torch.int32 if page_bytes % 4 == 0 and src_pool.shape[-1] * src_pool.element_size() % 4 == 0 else torch.int8
    src_w, dst_w = src_pool.view(word), dst_pool.view(word)  # one kernel for every dtype, bf16 and fp8 too
    page_words = src_w[0].numel()
    block = min(8192, triton.next_power_of_2(page_words))
    grid = (n, triton.cdiv(page_words, block))
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        _copy_pages_kernel[grid](src_w, src_slots.to(dev, torch.int32), dst_w, dst_slots.to(dev, torch.int32),
                                 PAGE_ELEMS=page_words, BLOCK=block)


def copy_pool_pages(src_pool: torch.Tensor, src_slots: torch.Tensor, dst_pool: torch.Tensor,
                    dst_slots: torch.Tensor) -> None:
    """``dst_pool[dst_slots] = src_pool[src_slots]`` (negative source slots skipped): the one-launch kernel
    when a pool is on a GPU (host memory read through its mapped address), else a plain indexed copy.
    Graph-capturable."""
    if src_pool.is_cuda or dst_pool.is_cuda:
        copy_pages(src_pool, src_slots, dst_pool, dst_slots)
    else:
        keep = src_slots >= 0
        dst_pool[dst_slots[keep].long()] = src_pool[src_slots[keep].long()]
