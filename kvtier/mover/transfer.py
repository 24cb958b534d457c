"""TransferEngine: batched page moves between tiers, asynchronous on a side CUDA stream.

One call moves a batch of (layer, pid) pages, every layer together: one gather, one bulk copy, one scatter, one
completion event and one pending record for the batch. The BlockTable points at the destination at submit time;
a reader calls :meth:`wait` on the pages first (on the GPU the compute stream waits on the copy's event). The engine
moves only settled pages (``after_compute=False``) and takes each fenced move when it plans the next step
(:meth:`take_moved`); a source slot is released only once a *fence* event, after every queued step that may still
read the old place, has completed.
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
from kvtier.mover.copy_kernel import copy_pages

if TYPE_CHECKING:
    from kvtier.table import BlockTable


@dataclass
class _Pending:
    """One batch of moves: pages ``(layers[i], pids[i])`` ``[n]`` under one completion event."""

    event: "torch.cuda.Event | None"
    layers: np.ndarray
    pids: np.ndarray
    release: list[tuple[int, np.ndarray, np.ndarray]] = field(default_factory=list)  # (tier, layers, slots) to free
    fenced: bool = False  # release waits for ``fence`` too
    fence: "torch.cuda.Event | None" = None
    reported: bool = False  # handed out by take_moved

    def touches(self, layer=None, pids=None) -> bool:
        """Whether the batch moves any of ``pids`` (None: any page) in ``layer`` (None: any layer, or an int)."""
        mine = self.pids if layer is None else self.pids[self.layers == layer]
        return bool(mine.size) if pids is None else bool(np.isin(mine, pids).any())


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
        pids = np.asarray(pids, dtype=np.int64).reshape(-1)
        self.migrate_many(np.full(pids.size, layer), pids, dst, after_compute, fenced)

    def migrate_many(self, layers, pids, dst: int, after_compute: bool = True, fenced: bool = False) -> None:
        """Move pages ``(layers[i], pids[i])`` ``[n]`` into ``tiers[dst]``, issued together as one batch built with
        array ops over every layer: between addressable pools one copy launch per source tier covers every layer
        (page ``(layer, slot)`` at ``layer * capacity + slot`` of :meth:`Tier.pools`), and one completion event
        covers them all."""
        pids = np.asarray(pids, dtype=np.int64).reshape(-1)  # [n]
        if not pids.size:
            return
        layers = np.broadcast_to(np.asarray(layers, dtype=np.int64), pids.shape)  # [n]
        src_tiers, src_slots = self.table.locate(layers, pids)  # [n]
        move = src_tiers != dst  # pages already there are skipped
        if not move.any():
            return
        layers, pids, src_tiers, src_slots = layers[move], pids[move], src_tiers[move], src_slots[move]
        self._wait_pids(layers, pids)  # a page moves once its previous move has landed
        L, tiers = self.table.layout.num_layers, self.table.tiers
        if (np.bincount(layers, minlength=L) > tiers[dst].num_free(np.arange(L))).any():
            self.synchronize()  # slots vacated by earlier moves are released once those land
        dst_slots = tiers[dst].alloc(layers).numpy()  # [n] raises TierFullError before any copy
        pending = _Pending(None, layers, pids, fenced=fenced)
        stream_ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        if self.stream is not None and after_compute:
            self.stream.wait_stream(torch.cuda.current_stream())  # pages written by compute first
        for t, sel in _groups(src_tiers):
            with stream_ctx:
                self._copy(t, dst, layers[sel], src_slots[sel], dst_slots[sel])
            pending.release.append((t, layers[sel], src_slots[sel]))
        self.table.relocate(layers, pids, dst, dst_slots)
        if self.asynchronous:
            pending.event = self._new_event()
            pending.event.record(self.stream)
            self._pending.append(pending)
            return
        if fenced:  # a synchronous copy has landed; no reader runs ahead of the host
            self._landed.append(pending)
            pending.reported = True
        self._release(pending)

    def _copy(self, src: int, dst: int, layers: np.ndarray, src_slots: np.ndarray, dst_slots: np.ndarray) -> None:
        """Copy pages ``(layers[i], src_slots[i])`` of ``tiers[src]`` to ``(layers[i], dst_slots[i])`` of
        ``tiers[dst]`` (all ``[n]``), counting bytes."""
        src_tier, dst_tier = self.table.tiers[src], self.table.tiers[dst]
        src_all, dst_all = src_tier.pools(), dst_tier.pools()
        if self.use_kernel(src_all, dst_all):  # one launch for every layer
            device = src_all.device if src_all.is_cuda else dst_all.device
            src, dst = to_device([layers * src_tier.capacity + src_slots, layers * dst_tier.capacity + dst_slots],
                                 device)  # one non-blocking upload
            copy_pages(src_all, src, dst_all, dst)
        else:
            for layer in _in_order(layers).tolist():
                sel = layers == layer
                pages = src_tier.read(layer, torch.from_numpy(src_slots[sel]))
                dst_tier.write(layer, torch.from_numpy(dst_slots[sel]), pages)
        link = f"{src_tier.name}->{dst_tier.name}"
        self.bytes_moved[link] += src_slots.size * self.table.layout.page_bytes
        self.pages_moved[link] += src_slots.size

    def gather(self, layer: int, pids: np.ndarray, device) -> tuple[torch.Tensor, Counter]:
        """Copies of ``pids``'s pages of ``layer`` in one temporary pool ``[n, 2, P, N_kv, D]`` on ``device``
        (one launch per source tier between addressable pools), and the bytes read per link from the tiers below
        the device (its own pages are copied within it, not moved between tiers)."""
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
            if t:
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
            if not p.event.query():
                mask |= np.isin(pids, p.pids[p.layers == layer])
        return mask

    def wait(self, layer: int | None = None, pids=None) -> None:
        """Order the current stream after every in-flight copy touching these pages (all if None)."""
        self.poll()
        for p in self._pending:
            if p.touches(layer, pids):
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

    def take_moved(self, fence=None) -> tuple[np.ndarray, np.ndarray]:
        """``(layers [n], pids [n])``: the pages of every fenced move issued since the last call, landed or not:
        the current stream is ordered after their copies (the GPU waits, not the host), so the reader may point
        at the new place now; their source slots are released once the copy has landed and the fence
        (``fence()``: an event after every queued reader of the old place, or None when nothing is queued) has
        passed."""
        self.poll()
        moved = self._landed + [p for p in self._pending if p.fenced and not p.reported]
        fence = fence() if moved and fence is not None else None
        for p in moved:
            p.reported = True
            p.fence, p.fenced = fence, fence is not None  # no fence: no queued reader of the old place
            if self.stream is not None and not p.event.query():
                torch.cuda.current_stream().wait_event(p.event)
        self._landed = []
        if not moved:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return np.concatenate([p.layers for p in moved]), np.concatenate([p.pids for p in moved])

    def _wait_pids(self, layers: np.ndarray, pids: np.ndarray) -> None:
        """Block until no copy of a page ``(layers[i], pids[i])`` ``[n]`` is in flight (a mask of the asked pairs,
        ``BlockTable.marked``, read at each batch in flight)."""
        flying = [p for p in self._pending if not p.event.query()]
        if not flying:
            return
        waited = False
        with self.table.marked(layers, pids) as asked:
            for p in flying:
                if asked[p.layers, p.pids].any():
                    p.event.synchronize()
                    waited = True
        if waited:
            self.poll()

    def _release(self, p: _Pending) -> None:
        for t, layers, slots in p.release:
            self.table.tiers[t].free(layers, torch.from_numpy(slots))


def _in_order(x: np.ndarray) -> np.ndarray:
    """The distinct values of ``x`` ``[n]`` in order of first appearance."""
    values, first = np.unique(x, return_index=True)
    return values[np.argsort(first)]


def _groups(x: np.ndarray) -> list[tuple[int, np.ndarray | slice]]:
    """``(value, where)`` per distinct value of ``x`` ``[n]``, in order of first appearance (one value: all of it)."""
    if (x == x[0]).all():
        return [(int(x[0]), slice(None))]
    return [(int(v), x == v) for v in _in_order(x)]
