"""TransferEngine: batched page moves between tiers, asynchronous on a side CUDA stream.

One call moves a batch of (layer, pid) pages: one gather from the source pool, one bulk copy,
one scatter into the destination pool (not one copy per page). The BlockTable is updated at
submit time; a reader must :meth:`wait` on the pages first (on the GPU the compute stream
waits on the copy's event, the host does not block). Source slots are released only once the
copy has completed, so they cannot be reused while still being read.

The engine (:mod:`kvtier.engine`) moves only settled pages (no queued kernel writes them), so a copy
need not wait for queued compute (``after_compute=False``); it takes each fenced move when it plans the
next step (:meth:`take_moved`): that step reads the new place, ordered after the copy on the GPU (the
same placement on a CPU and a GPU, whatever the copy's timing), and a source slot is released only once
a *fence* event has completed, one that follows every queued step that may still read the old place.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from typing import TYPE_CHECKING

from kvtier.errors import ConfigError
from kvtier.kernels.base import to_device
from kvtier.tiers.copy_kernel import copy_pages

if TYPE_CHECKING:
    from kvtier.table import BlockTable


@dataclass
class _Pending:
    event: "torch.cuda.Event | None"
    layer: int
    pids: np.ndarray
    release: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (tier, slots) to free when done
    fenced: bool = False  # release waits for ``fence`` too
    fence: "torch.cuda.Event | None" = None
    reported: bool = False  # handed out by take_moved


class TransferEngine:
    """Moves pages between the tiers of a :class:`BlockTable` and counts bytes per link."""

    METHODS = ("auto", "kernel", "generic")

    def __init__(self, table: BlockTable, method: str = "auto", event_factory=None):
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
        self.asynchronous = event_factory is not None or cuda
        self.stream = torch.cuda.Stream() if self.asynchronous and cuda else None
        self._new_event = event_factory or torch.cuda.Event
        self.bytes_moved: Counter[str] = Counter()
        self.pages_moved: Counter[str] = Counter()
        self._pending: list[_Pending] = []
        self._landed: list[_Pending] = []  # landed fenced moves not yet taken by the reader
        self.stalls = 0  # host-side waits for a copy (CPU event path)

    def migrate(self, layer: int, pids, dst: int, after_compute: bool = True, fenced: bool = False) -> None:
        """Move ``pids`` of ``layer`` into ``tiers[dst]`` (pages already there are skipped).

        ``after_compute``: the copy waits for all queued compute (pages written by it first);
        ``fenced``: see the module docstring.
        """
        self.migrate_many([(layer, pids, dst)], after_compute, fenced)

    def migrate_many(self, moves, after_compute: bool = True, fenced: bool = False) -> None:
        """Moves ``[(layer, pids, dst tier)]`` issued together: between addressable pools one copy launch per
        (source tier, destination tier) covers every layer (page ``(layer, slot)`` at ``layer * capacity +
        slot`` of :meth:`Tier.pools`), and one completion event covers them all."""
        batch = []  # (layer, pids, source tiers, source slots, dst, dst slots)
        for layer, pids, dst in moves:
            pids = np.asarray(pids, dtype=np.int64)
            src_tiers, src_slots = self.table.locate(layer, pids)
            move = src_tiers != dst
            if not move.any():
                continue
            pids, src_tiers, src_slots = pids[move], src_tiers[move], src_slots[move]
            self._wait_pids(layer, pids)  # a page moves once its previous move has landed
            dst_tier = self.table.tiers[dst]
            if dst_tier.num_free(layer) < pids.size:
                self.synchronize()  # slots vacated by earlier moves are released once those land
            dst_slots = dst_tier.alloc(layer, pids.size).numpy()  # [n]; raises TierFullError before any copy
            batch.append((layer, pids, src_tiers, src_slots, dst, dst_slots))
        if not batch:
            return
        pendings = [_Pending(None, layer, pids, fenced=fenced) for layer, pids, *_ in batch]
        groups: dict[tuple[int, int], list] = {}  # (source tier, dst tier) -> [(layer, src slots, dst slots)]
        for pending, (layer, _, src_tiers, src_slots, dst, dst_slots) in zip(pendings, batch):
            for t in np.unique(src_tiers):
                sel = np.flatnonzero(src_tiers == t)
                groups.setdefault((int(t), dst), []).append((layer, src_slots[sel], dst_slots[sel]))
                pending.release.append((int(t), torch.from_numpy(src_slots[sel])))
        stream_ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        if self.stream is not None and after_compute:
            self.stream.wait_stream(torch.cuda.current_stream())  # pages written by compute first
        with stream_ctx:
            for (src, dst), parts in groups.items():
                self._copy(src, dst, parts)
        for layer, pids, _, _, dst, dst_slots in batch:
            self.table.relocate(layer, pids, dst, dst_slots)
        event = None
        if self.asynchronous:
            event = self._new_event()
            event.record(self.stream)
        for pending in pendings:
            pending.event = event
            if self.asynchronous:
                self._pending.append(pending)
                continue
            if fenced:  # a synchronous copy has landed; no reader runs ahead of the host
                self._landed.append(pending)
                pending.reported = True
            self._release(pending)

    def _copy(self, src: int, dst: int, parts: list) -> None:
        """Copy ``[(layer, src slots, dst slots)]`` from ``tiers[src]`` to ``tiers[dst]``, counting bytes."""
        src_tier, dst_tier = self.table.tiers[src], self.table.tiers[dst]
        src_all, dst_all = src_tier.pools(), dst_tier.pools()
        n = sum(s.size for _, s, _ in parts)
        if self.use_kernel(src_all, dst_all):  # one launch for every layer
            flat_src = np.concatenate([layer * src_tier.capacity + s for layer, s, _ in parts])
            flat_dst = np.concatenate([layer * dst_tier.capacity + d for layer, _, d in parts])
            copy_pages(src_all, torch.from_numpy(flat_src), dst_all, torch.from_numpy(flat_dst))
        else:
            for layer, s, d in parts:
                dst_tier.write(layer, torch.from_numpy(d), src_tier.read(layer, torch.from_numpy(s)))
        link = f"{src_tier.name}->{dst_tier.name}"
        self.bytes_moved[link] += n * self.table.layout.page_bytes
        self.pages_moved[link] += n

    def gather(self, layer: int, pids: np.ndarray, device) -> tuple[torch.Tensor, Counter]:
        """Copies of ``pids``'s pages of ``layer`` in one temporary pool ``[n, 2, P, N_kv, D]`` on ``device``
        (one launch per source tier between addressable pools), and the bytes read per link."""
        layout = self.table.layout
        tiers, slots = self.table.locate(layer, pids)
        pool = torch.empty((pids.size, *layout.page_shape), dtype=layout.kv_dtype, device=device)
        links: Counter[str] = Counter()
        for t in np.unique(tiers):
            sel = np.flatnonzero(tiers == t)
            tier = self.table.tiers[t]
            src_pool = tier.pool(layer)
            if self.use_kernel(src_pool, pool):  # one launch through mapped host memory
                src, dst = to_device([slots[sel], sel], device, torch.int64)
                copy_pages(src_pool, src, pool, dst)
            else:
                dst = torch.from_numpy(sel).to(device)
                pool[dst] = tier.read(layer, torch.from_numpy(slots[sel])).to(device, non_blocking=True)
            links[f"{tier.name}->{self.table.tiers[0].name}"] += sel.size * layout.page_bytes
        return pool, links

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
        """Block the host until every copy has landed (and every given fence has passed), then release
        source slots. A fenced move whose fence was not yet given keeps its source slots."""
        if self.stream is not None:
            self.stream.synchronize()
        for p in self._pending:
            p.event.synchronize()
            if p.fence is not None:
                p.fence.synchronize()
        self.poll()

    def poll(self) -> None:
        """Release source slots of completed copies (of fenced ones, once their fence has passed)."""
        still = []
        for p in self._pending:
            if not p.event.query():
                still.append(p)
                continue
            if p.fenced and not p.reported:
                p.reported = True
                self._landed.append(p)
            if p.fenced and (p.fence is None or not p.fence.query()):
                still.append(p)
            else:
                self._release(p)
        self._pending = still

    def take_moved(self, fence=None) -> list[tuple[int, np.ndarray]]:
        """``[(layer, pids)]`` of every fenced move issued since the last call, landed or not: the current stream
        is ordered after their copies (the GPU waits, not the host), so the reader may point at the new place
        now; their source slots are released once the copy has landed and the fence (``fence()``: an event
        after every queued reader of the old place, or None when nothing is queued) has passed."""
        self.poll()
        moved = self._landed + [p for p in self._pending if p.fenced and not p.reported]
        fence = fence() if moved and fence is not None else None
        for p in moved:
            p.reported = True
            p.fence, p.fenced = fence, fence is not None  # no fence: no queued reader of the old place
            if self.stream is not None and not p.event.query():
                torch.cuda.current_stream().wait_event(p.event)
        self._landed = []
        return [(p.layer, p.pids) for p in moved]

    def _wait_pids(self, layer: int, pids: np.ndarray) -> None:
        waited = False
        for p in self._pending:
            if p.layer == layer and not p.event.query() and np.isin(p.pids, pids).any():
                p.event.synchronize()
                waited = True
        if waited:
            self.poll()

    def _release(self, p: _Pending) -> None:
        for t, slots in p.release:
            self.table.tiers[t].free(p.layer, slots)

