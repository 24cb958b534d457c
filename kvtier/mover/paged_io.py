"""The K/V write (16/32-bit and 8-bit pages), for prefill chunks and decode rows, and token-level reads."""

from __future__ import annotations

import numpy as np
import torch

from kvtier.kernels.base import to_device
from kvtier.quant import dequantize, write_scaled
from kvtier.table import BlockTable


def write_tokens(table: BlockTable, layer: int, seq: int, kv: torch.Tensor, start: int) -> None:
    """Store ``kv [2, n, N_kv, D]`` as tokens ``start .. start+n-1`` of ``seq`` (pages already appended).

    Addressable tiers are written in place per token; other tiers by read-modify-write of whole
    pages (a page whose first token is written starts from zeros). 8-bit layouts quantize on the way
    in (:func:`kvtier.quant.write_scaled`: each page's scales grow with its values).
    """
    n = kv.shape[1]
    P = table.layout.page_size
    pos = np.arange(start, start + n)  # [n]
    pids = table.pages(seq)[pos // P]  # [n]
    tiers, slots = table.locate(layer, pids)
    offs = pos % P  # [n] offset in the page
    for t in np.unique(tiers):
        sel = np.flatnonzero(tiers == t)
        tier = table.tiers[t]
        pool = tier.pool(layer)
        chunk = kv if sel.size == n else kv[:, to_device([sel], kv.device, torch.int64)[0]]  # [2, m, N_kv, D]
        uniq, inv = np.unique(slots[sel], return_inverse=True)
        if pool is not None:
            store_rows(table.layout, pool, *to_device([uniq, inv, offs[sel]], pool.device, torch.int64), *chunk)
            continue
        u = torch.from_numpy(uniq)
        fresh = np.zeros(uniq.size, dtype=bool)  # a write from offset 0 starts a page: nothing to keep
        fresh[inv[offs[sel] == 0]] = True
        pages = torch.zeros((uniq.size, *table.layout.page_shape), dtype=table.layout.kv_dtype)  # [u, 2, P(+1), N_kv, D]
        if not fresh.all():
            old = np.flatnonzero(~fresh)
            pages[torch.from_numpy(old)] = tier.read(layer, u[old]).to(pages.device)
        store_rows(table.layout, pages, *to_device([np.arange(uniq.size), inv, offs[sel]], "cpu", torch.int64),
                   *chunk)
        tier.write(layer, u, pages)


def store_rows(layout, pool: torch.Tensor, p: torch.Tensor, i: torch.Tensor, o: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor) -> None:
    """Token ``t`` of ``keys, values [m, N_kv, D]`` into row ``o[t]`` of slot ``p[i[t]]`` of ``pool``: ``p [u]``
    distinct slots, ``i [m]``, ``o [m]`` int64 on the pool's device; no host work. Unscaled pages take two row
    copies into the pool seen as rows of ``N_kv * D`` (an indexed put over the page dims ran at ~0.2 TB/s on an
    H100, the row copies at ~0.45)."""
    if layout.scaled:
        write_scaled(pool, layout.page_size, p, i, o, torch.stack([keys, values]).to(pool.device))
        return
    m, P = keys.shape[0], pool.shape[2]
    rows = pool.view(-1, pool.shape[-2] * pool.shape[-1])  # [S * 2 * P, N_kv * D]: row (slot, K or V, offset)
    at = p[i] * (2 * P) + o  # [m] the keys' rows; the values' are P further
    rows.index_copy_(0, at, keys.reshape(m, -1).to(pool.device, pool.dtype))
    rows.index_copy_(0, at + P, values.reshape(m, -1).to(pool.device, pool.dtype))


def read_tokens(table: BlockTable, layer: int, seq: int, device=None) -> torch.Tensor:
    """All tokens of ``seq`` in ``layer``: ``[2, S, N_kv, D]`` in the model's dtype (a swapped-out request, tests);
    the tokens of pages dropped for good (left of a sliding window) read as zeros."""
    pids = table.pages(seq)
    tiers, slots = table.locate(layer, pids)
    L = table.layout
    dev = device or table.tiers[0].device
    pages = torch.zeros((pids.size, *L.page_shape), dtype=L.kv_dtype, device=dev)  # [n, 2, P(+1), N_kv, D]
    for t in np.unique(tiers[tiers >= 0]):
        sel = np.flatnonzero(tiers == t)
        pages[torch.from_numpy(sel).to(dev)] = table.tiers[t].read(layer, torch.from_numpy(slots[sel])).to(dev)
    if L.scaled:
        pages = dequantize(pages, L.page_size).to(L.dtype)  # [n, 2, P, N_kv, D]
    S = table.seq_len(seq)
    return pages.transpose(0, 1).reshape(2, -1, L.num_kv_heads, L.head_dim)[:, :S]  # [2, S, N_kv, D]


def write_decode(pool: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, page_size: int, scaled: bool) -> None:
    """Each row's new K/V ``[B, N_kv, 1, D]`` into its page ``table [B, M]`` at ``positions [B]`` of the device
    ``pool`` (``scaled``: 8-bit pages, quantized against their scales); static shapes, no host work."""
    slot = table.gather(1, (positions // page_size)[:, None])[:, 0].long()  # [B] device slots
    kv = torch.stack([key[:, :, 0], value[:, :, 0]], 1)  # [B, 2, N_kv, D]
    if scaled:
        write_scaled(pool, page_size, slot, torch.arange(slot.numel(), device=slot.device),
                     positions.long() % page_size, kv.transpose(0, 1))
    else:
        pool[slot, :, positions % page_size] = kv.to(pool.dtype)
