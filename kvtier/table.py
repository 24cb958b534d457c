"""BlockTable: the hierarchical page table of seed 000.

Two levels. A sequence is a list of *page ids* (pids), one per logical page; a pid names one
physical page per layer, and ``(tier, slot)`` of each ``(layer, pid)`` says where its bytes live.
Forked sequences share pids (``ref`` counts the sequences holding a pid); appending into a
shared, partly filled last page copies it first (copy-on-write). Migration moves a
``(layer, pid)`` without touching any sequence's list, so every sharer sees the new place.
On a sliding-window layer a page left of every holder's window is *dropped*: its slot is freed
and ``tier_of`` says :data:`DROPPED`; the pid stays in the sequences (positions are logical) and
no scope, scheduler or migration touches that ``(layer, pid)`` again.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.errors import ConfigError, KVTierError, TierFullError
from kvtier.layout import KVLayout
from kvtier.tiers.base import Tier

DROPPED = -2  # tier_of of a (layer, pid) freed for good (left of its sliding window)
FIRST_PIDS = 64  # the pids a table starts with; it doubles them when it runs out


def pid_capacity(pages: int) -> int:
    """Pids a table holding ``pages`` pages per layer may name: FIRST_PIDS, doubled until they hold them."""
    return max(FIRST_PIDS, 1 << max(pages - 1, 0).bit_length())


def grown(a: np.ndarray, size: int, fill) -> np.ndarray:
    """``a`` with its last axis (pids) extended to at least ``size`` (doubling), new cells ``fill``."""
    if a.shape[-1] >= size:
        return a
    new = max(size, 2 * a.shape[-1])
    return np.concatenate([a, np.full(a.shape[:-1] + (new - a.shape[-1],), fill, a.dtype)], -1)


@dataclass
class SeqState:
    pids: list[int]
    length: int  # tokens
    _array: np.ndarray | None = field(default=None, repr=False)  # pids as an array, until they change

    def array(self) -> np.ndarray:
        """``pids`` as a read-only int64 array ``[n]``, made once per change of the pages."""
        if self._array is None:
            self._array = np.asarray(self.pids, dtype=np.int64)
            self._array.flags.writeable = False
        return self._array


class BlockTable:
    """Maps (sequence, layer, logical page) -> (tier index, slot); tiers[0] is the fastest."""

    def __init__(self, layout: KVLayout, tiers: list[Tier]):
        if not tiers:
            raise ConfigError("tiers", "at least one tier (the device tier) is needed")
        kinds = [t.kind for t in tiers]
        if kinds[0] != "device" or "device" in kinds[1:]:
            raise ConfigError("tiers", f"the device tier comes first and only once (fastest first), got tiers of "
                                       f"kinds {kinds} (a tier class of your own that holds the device's pages sets "
                                       "kind = 'device')")
        for t in tiers:
            if t.layout != layout:
                raise ConfigError(f"tiers.stack.{t.name}", "tier built for another KVLayout")
        self.layout = layout
        self.tiers = list(tiers)
        self.seqs: dict[int, SeqState] = {}
        cap = FIRST_PIDS
        L = layout.num_layers
        self.tier_of = np.full((L, cap), -1, dtype=np.int8)  # [L, pids]
        self.slot_of = np.full((L, cap), -1, dtype=np.int64)  # [L, pids]
        self.ref = np.zeros(cap, dtype=np.int32)  # [pids]
        self.pinned = np.zeros(cap, dtype=bool)  # [pids]
        self._marks = np.zeros((L, cap), dtype=bool)  # [L, pids] scratch of marked()
        self._free_pids = list(range(cap - 1, -1, -1))

    # -- sequences ---------------------------------------------------------------------------
    def add_sequence(self, seq: int, pids=(), length: int = 0) -> None:
        """A new sequence sharing the live pages ``pids`` that hold its first ``length`` tokens (copy-on-write)."""
        if seq in self.seqs:
            raise KVTierError(f"sequence {seq} already exists")
        pids = [int(p) for p in pids]
        if self.layout.pages_for(length) != len(pids) or (pids and (self.ref[pids] < 1).any()):
            raise KVTierError(f"sequence {seq}: {len(pids)} live pages cannot hold its first {length} tokens")
        self.seqs[seq] = SeqState(pids, length)
        self.ref[pids] += 1

    def seq_len(self, seq: int) -> int:
        return self._seq(seq).length

    def num_pages(self, seq: int) -> int:
        return len(self._seq(seq).pids)

    def pages(self, seq: int) -> np.ndarray:
        """pids of ``seq`` in logical order ``[n]`` (read-only)."""
        return self._seq(seq).array()

    def fork(self, src: int, dst: int) -> None:
        """``dst`` shares all of ``src``'s pages (copy-on-write)."""
        s = self._seq(src)
        self.add_sequence(dst, s.pids, s.length)

    def free(self, seq: int) -> list[int]:
        """Drop ``seq``; pages no other sequence holds are freed. Returns the freed pids."""
        s = self.seqs.pop(seq, None)
        if s is None:
            raise KVTierError(f"free of unknown sequence {seq}")
        return self.release(s.pids)

    def retain(self, pids) -> None:
        """One more holder (e.g. the radix prefix cache) of each live page of ``pids``."""
        pids = np.asarray(pids, dtype=np.int64)
        if (self.ref[pids] < 1).any():
            raise KVTierError(f"retain of pages no one holds: {pids[self.ref[pids] < 1].tolist()}")
        np.add.at(self.ref, pids, 1)

    def release(self, pids) -> list[int]:
        """One holder fewer of each of ``pids``; pages no one holds are freed. Returns the freed pids."""
        pids = np.asarray(pids, dtype=np.int64).reshape(-1)
        uniq, count = np.unique(pids, return_counts=True)  # a pid may be listed more than once
        if (count > self.ref[uniq]).any():
            raise KVTierError(f"release of pages no one holds: {uniq[count > self.ref[uniq]].tolist()}")
        self.ref[uniq] -= count.astype(self.ref.dtype)
        gone = set(uniq[self.ref[uniq] == 0].tolist())  # their last holder went
        freed = np.asarray([p for p in dict.fromkeys(pids.tolist()) if p in gone], dtype=np.int64)  # in the order given
        if freed.size:
            self._release(freed)
        return freed.tolist()

    def append(self, seq: int, n_tokens: int) -> tuple[list[int], list[tuple[int, int]]]:
        """Grow ``seq`` by ``n_tokens``: returns (new pids, copy-on-write pairs (old pid, new pid)).

        New pages go to the fastest tier with a free slot in each layer. A shared, partly filled
        last page is copied (data included) to a private pid before it is written.
        """
        s = self._seq(seq)
        P = self.layout.page_size
        if n_tokens <= 0:
            raise KVTierError(f"append of {n_tokens} tokens to sequence {seq}; need at least 1")
        copy_last = bool(s.length % P) and self.ref[s.pids[-1]] > 1
        need = self.layout.pages_for(s.length + n_tokens) - len(s.pids) + copy_last
        free = sum(t.num_free(np.arange(self.layout.num_layers)) for t in self.tiers)  # [L]
        if (free < need).any():
            layer = int(np.argmax(free < need))
            raise TierFullError(f"layer {layer}: {need} new pages needed, {free[layer]} free over all tiers; "
                                "raise the lowest tier's capacity or free sequences")
        cow = []
        if copy_last:
            old = s.pids[-1]
            new = self._new_pages(1)[0]
            self._place(new, prefer=self.tier_of[:, old])
            for layer in range(self.layout.num_layers):
                data = self.tiers[self.tier_of[layer, old]].read(layer, torch.tensor([self.slot_of[layer, old]]))
                self.tiers[self.tier_of[layer, new]].write(layer, torch.tensor([self.slot_of[layer, new]]), data)
            self.ref[old] -= 1
            s.pids[-1] = new
            s._array = None
            cow.append((old, new))
        new_pids = self._new_pages(self.layout.pages_for(s.length + n_tokens) - len(s.pids))
        if new_pids:
            self._place_new(np.asarray(new_pids, dtype=np.int64))
            s.pids.extend(new_pids)
            s._array = None
        s.length += n_tokens
        return new_pids, cow

    # -- physical pages ----------------------------------------------------------------------
    def locate(self, layer, pids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(tier index, slot) of ``pids`` in ``layer`` (an int, or layers broadcast against ``pids``), each of
        the broadcast shape."""
        at = np.asarray(layer) * self.tier_of.shape[1] + np.asarray(pids)  # flat (faster than two index arrays)
        return self.tier_of.reshape(-1)[at], self.slot_of.reshape(-1)[at]

    def relocate(self, layer, pids: np.ndarray, tier, slots: np.ndarray) -> None:
        """Record that ``pids`` ``[n]`` of ``layer`` (an int or ``[n]``) now live in ``tiers[tier]`` (an int or
        ``[n]``) at ``slots`` ``[n]`` (data already copied)."""
        self.tier_of[layer, pids] = tier
        self.slot_of[layer, pids] = slots

    def drop(self, layer: int, pids) -> np.ndarray:
        """Free the pages of ``pids`` in ``layer`` for good (never read again) and mark them
        :data:`DROPPED`; returns the pids dropped now ``[n]`` (ones already dropped are skipped).
        The caller makes sure no copy into or out of them is in flight."""
        pids = np.asarray(pids, dtype=np.int64)
        pids = pids[self.tier_of[layer, pids] >= 0]
        for t in np.unique(self.tier_of[layer, pids]):
            sel = pids[self.tier_of[layer, pids] == t]
            self.tiers[t].free(layer, torch.from_numpy(self.slot_of[layer, sel]))
        self.tier_of[layer, pids] = DROPPED
        self.slot_of[layer, pids] = -1
        return pids

    def live_pids(self) -> np.ndarray:
        return np.flatnonzero(self.ref > 0)

    def set_pinned(self, pids, pinned: bool = True) -> None:
        self.pinned[np.asarray(pids, dtype=np.int64)] = pinned

    def occupancy(self) -> dict[str, list[int]]:
        """Pages in use per tier, per layer."""
        return {t.name: t.num_used(np.arange(self.layout.num_layers)).tolist() for t in self.tiers}

    # -- internals ---------------------------------------------------------------------------
    def _seq(self, seq: int) -> SeqState:
        try:
            return self.seqs[seq]
        except KeyError:
            raise KVTierError(f"unknown sequence {seq}") from None

    def _new_pages(self, n: int) -> list[int]:
        """``n`` free pids, held once each, in the order single pops would give them."""
        while len(self._free_pids) < n:
            self._grow()
        pids = self._free_pids[len(self._free_pids) - n:][::-1]
        del self._free_pids[len(self._free_pids) - n:]
        self.ref[pids] = 1
        self.pinned[pids] = False
        return pids

    def _grow(self) -> None:
        old = self.ref.size  # every pid array doubles
        for name, fill in (("tier_of", -1), ("slot_of", -1), ("ref", 0), ("pinned", False), ("_marks", False)):
            setattr(self, name, grown(getattr(self, name), old + 1, fill))
        self._free_pids.extend(range(2 * old - 1, old - 1, -1))

    @contextlib.contextmanager
    def marked(self, layers: np.ndarray, pids: np.ndarray):
        """A mask ``[L, pid capacity]`` true at the pairs ``(layers[i], pids[i])`` ``[n]`` for the ``with`` block: one
        scratch array, cleared after (blocks do not nest)."""
        self._marks[layers, pids] = True
        try:
            yield self._marks
        finally:
            self._marks[layers, pids] = False

    def _place(self, pid: int, prefer: np.ndarray | None = None) -> None:
        """Give ``pid`` a slot in every layer: in its ``prefer [L]`` tier where that has room, else the fastest
        tier with room."""
        L = self.layout.num_layers
        has = np.stack([t.num_free(np.arange(L)) for t in self.tiers]) > 0  # [T, L]
        if not has.any(0).all():
            raise TierFullError(f"layer {int(np.flatnonzero(~has.any(0))[0])}: every tier is full; add capacity to "
                                "the lowest tier")
        tier = has.argmax(0)  # [L]
        if prefer is not None:
            tier = np.where(has[prefer, np.arange(L)], prefer, tier)
        for t in np.unique(tier):
            layers = np.flatnonzero(tier == t)
            self.tier_of[layers, pid] = t
            self.slot_of[layers, pid] = self.tiers[t].alloc(layers).numpy()

    def _place_new(self, pids: np.ndarray) -> None:
        """Give ``pids [k]`` a slot in every layer, in order: each the fastest tier with room after the ones before
        (one allocation per tier; the checked room suffices)."""
        L = self.layout.num_layers
        free = np.stack([t.num_free(np.arange(L)) for t in self.tiers])  # [T, L]
        tier = (np.arange(pids.size)[:, None, None] >= np.cumsum(free, 0)[None]).sum(1)  # [k, L]
        for t in np.unique(tier):
            layers, k = np.nonzero((tier == t).T)  # grouped by layer (no sort in alloc), a layer's earlier pid first
            self.tier_of[layers, pids[k]] = t
            self.slot_of[layers, pids[k]] = self.tiers[t].alloc(layers).numpy()

    def _release(self, pids: np.ndarray) -> None:
        """Free ``pids [n]`` in every layer: one call per tier with each slot's layer."""
        tier = self.tier_of[:, pids]  # [L, n]
        for t in range(len(self.tiers)):
            layers, cols = np.nonzero(tier == t)
            if not layers.size:
                continue
            self.tiers[t].free(layers, torch.from_numpy(self.slot_of[layers, pids[cols]]))
        self.tier_of[:, pids] = -1
        self.slot_of[:, pids] = -1
        self.ref[pids] = 0
        self.pinned[pids] = False
        self._free_pids.extend(pids.tolist())
