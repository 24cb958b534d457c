"""TransferEngine: batched page moves between tiers, asynchronous on a side CUDA stream.

One call moves a batch of (layer, pid) pages: one gather from the source pool, one bulk copy,
one scatter into the destination pool (not one copy per page). The BlockTable is updated at
submit time; a reader must :meth:`wait` on the pages first (on the GPU the compute stream
waits on the copy's event, the host does not block). Source slots are released only once the
copy has completed, so they cannot be reused while still being read.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from typing import TYPE_CHECKING

from kvtier.errors import ConfigError
from kvtier.tiers.copy_kernel import copy_pages

if TYPE_CHECKING:
    from kvtier.table import BlockTable


@dataclass
class _Pending:
    event: "torch.cuda.Event | None"
    layer: int
    pids: np.ndarray
    release: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (tier, slots) to free when done


class TransferEngine:
    """Moves pages between the tiers of a :class:`BlockTable` and counts bytes per link."""

    METHODS = ("auto", "kernel", "generic")

    def __init__(self, table: BlockTable, use_side_stream: bool | None = None, method: str = "auto",
                 event_factory=None):
        """``method``: ``kernel`` copies between addressable pools (HBM, pinned DRAM through UVA) in one
        Triton launch; ``generic`` uses the tiers' read/write (gather, one bulk copy, scatter);
        ``auto`` takes ``kernel`` where both pools are addressable and one is on a GPU.
        ``event_factory`` (tests): builds completion events with ``record()/query()/synchronize()``
        for an asynchronous engine without CUDA, to check ordering on the CPU."""
        if method not in self.METHODS:
            raise ConfigError("transfer.method", f"unknown method {method!r}; use one of {list(self.METHODS)}")
        self.table = table
        self.method = method
        cuda = any(t.device.type == "cuda" for t in table.tiers)
        self.asynchronous = event_factory is not None or (cuda if use_side_stream is None else use_side_stream and cuda)
        self.stream = torch.cuda.Stream() if self.asynchronous and cuda else None
        self._new_event = event_factory or torch.cuda.Event
        self.bytes_moved: Counter[str] = Counter()
        self.pages_moved: Counter[str] = Counter()
        self._pending: list[_Pending] = []
        self.stalls = 0  # host-side waits for a copy (CPU event path)

    def migrate(self, layer: int, pids, dst: int) -> None:
        """Move ``pids`` of ``layer`` into ``tiers[dst]`` (pages already there are skipped)."""
        pids = np.asarray(pids, dtype=np.int64)
        src_tiers, src_slots = self.table.locate(layer, pids)
        move = src_tiers != dst
        pids, src_tiers, src_slots = pids[move], src_tiers[move], src_slots[move]
        if pids.size == 0:
            return
        self._wait_pids(layer, pids)  # a page moves once its previous move has landed
        dst_tier = self.table.tiers[dst]
        if dst_tier.num_free(layer) < pids.size:
            self.synchronize()  # slots vacated by earlier moves are released once those land
        dst_slots = dst_tier.alloc(layer, pids.size)  # [n]; raises TierFullError before any copy
        pending = _Pending(None, layer, pids)
        stream_ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())  # pages written by compute first
        with stream_ctx:
            for t in np.unique(src_tiers):
                sel = np.flatnonzero(src_tiers == t)
                src_tier = self.table.tiers[t]
                slots = torch.from_numpy(src_slots[sel])
                src_pool, dst_pool = src_tier.pool(layer), dst_tier.pool(layer)
                if self.use_kernel(src_pool, dst_pool):
                    copy_pages(src_pool, slots, dst_pool, dst_slots[sel])
                else:
                    pages = src_tier.read(layer, slots)  # [n, 2, P, N_kv, D]
                    dst_tier.write(layer, dst_slots[sel], pages)
                link = f"{src_tier.name}->{dst_tier.name}"
                self.bytes_moved[link] += sel.size * self.table.layout.page_bytes
                self.pages_moved[link] += sel.size
                pending.release.append((int(t), slots))
        self.table.relocate(layer, pids, dst, dst_slots.numpy())
        if self.asynchronous:
            pending.event = self._new_event()
            pending.event.record(self.stream)
            self._pending.append(pending)
        else:
            self._release(pending)

    def use_kernel(self, src_pool, dst_pool) -> bool:
        if self.method == "generic" or src_pool is None or dst_pool is None:
            return False
        return self.method == "kernel" or src_pool.is_cuda or dst_pool.is_cuda

    def in_flight(self, layer: int, pids) -> np.ndarray:
        """Mask ``[n]``: which of ``pids`` have a copy not yet completed."""
        pids = np.asarray(pids, dtype=np.int64)
        mask = np.zeros(pids.size, dtype=bool)
        for p in self._pending:
            if p.layer == layer and not p.event.query():
                mask |= np.isin(pids, p.pids)
        return mask

    def wait(self, layer: int | None = None, pids=None) -> None:
        """Order the current stream after every in-flight copy touching these pages (all if None)."""
        self.poll()
        for p in self._pending:
            if (layer is None or p.layer == layer) and (pids is None or np.isin(p.pids, pids).any()):
                if self.stream is not None:
                    torch.cuda.current_stream().wait_event(p.event)  # the GPU waits, the host runs on
                else:
                    p.event.synchronize()
                    self.stalls += 1
        self.poll()

    def synchronize(self) -> None:
        """Block the host until every copy has landed, then release source slots."""
        if self.stream is not None:
            self.stream.synchronize()
        for p in self._pending:
            p.event.synchronize()
        self.poll()

    def poll(self) -> None:
        """Release source slots of completed copies."""
        still = []
        for p in self._pending:
            if p.event.query():
                self._release(p)
            else:
                still.append(p)
        self._pending = still

    def _wait_pids(self, layer: int, pids: np.ndarray) -> None:
        for p in self._pending:
            if p.layer == layer and np.isin(p.pids, pids).any():
                p.event.synchronize()
        self.poll()

    def _release(self, p: _Pending) -> None:
        for t, slots in p.release:
            self.table.tiers[t].free(p.layer, slots)

