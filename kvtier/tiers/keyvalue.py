"""KeyValueTier: pages in a key-value store, one key per page; RedisTier and MooncakeTier are two.

Packing: key ``kvtier:{<namespace>:<layer>}:<slot>``, value the page's bytes followed by their checksum
(:func:`kvtier.tiers.disk.page_checksums`, 4 bytes, little-endian). The namespace is random per tier
object, so two caches, or two runs, on one store never collide. A batch is one round trip of the
store's client: ``_get`` (reads), ``_put`` (writes), ``_delete`` (frees), never one per page.

A page comes back only if it has the right length, its own checksum matches and it matches the checksum
this tier recorded when it wrote it (a page overwritten behind kvtier's back fails that). A key the
store dropped raises ``PageEvictedError``; a store that cannot be reached raises ``TierIOError``.
"""

from __future__ import annotations

import secrets
from abc import abstractmethod

import numpy as np
import torch

from kvtier.errors import PageCorruptedError, PageEvictedError, TierIOError
from kvtier.layout import KVLayout
from kvtier.tiers.base import Tier
from kvtier.tiers.disk import landing, page_bytes_view, page_checksums, slot_array

CHECKSUM = np.dtype("<u4")  # the page checksum stored after its bytes


class KeyValueTier(Tier):
    """``capacity`` pages per layer in a key-value store; ``read`` returns CPU tensors ``[n, 2, P, N_kv, D]``.

    A store says where it is (``where``, for messages), how its pages go missing (``lost``) and what to
    change when it refuses writes (``refused_fix``).
    """

    kind = "remote"
    lost = "dropped by the store"
    refused_fix = "give the store more memory"

    def __init__(self, layout: KVLayout, capacity: int, name: str | None):
        super().__init__(layout, capacity, name)
        self.namespace = secrets.token_hex(8)  # this tier's own keys: never another cache's or run's
        self._sum = np.zeros((layout.num_layers, capacity), dtype=np.uint32)  # [L, cap] checksums written
        self._valid = np.zeros((layout.num_layers, capacity), dtype=bool)  # [L, cap]

    @property
    def where(self) -> str:
        return f"the store of tier '{self.name}'"

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def stored_bytes(self) -> int:
        """What the store holds when every slot is written: values over all layers."""
        return self.layout.num_layers * self.capacity * (self.layout.page_bytes + CHECKSUM.itemsize)

    def key(self, layer: int, slot: int) -> str:
        """The key of page ``(layer, slot)``."""
        return f"kvtier:{{{self.namespace}:{layer}}}:{slot}"

    @abstractmethod
    def _get(self, keys: list[str]) -> list:
        """The values of ``keys`` (bytes-like), None for a key the store does not hold; one round trip."""

    @abstractmethod
    def _put(self, keys: list[str], values: np.ndarray) -> list:
        """Store row ``i`` of ``values`` (uint8 ``[n, page_bytes + 4]``) under ``keys[i]``; one round trip.
        Returns the refusals (errors, one per key refused), empty when every key was stored."""

    @abstractmethod
    def _delete(self, keys: list[str]) -> None:
        """Remove ``keys`` from the store; one round trip."""

    @abstractmethod
    def _disconnect(self) -> None:
        """Close the client (and whatever the tier started for it)."""

    def read(self, layer, slots, out=None):
        s = slot_array(self, slots)
        bad = s[~self._valid[layer, s]]
        if bad.size:
            raise PageCorruptedError(
                f"remote tier '{self.name}' layer {layer}: slots {bad.tolist()} hold no complete page "
                "(never written, freed, or their write failed); rewrite them before reading")
        dst, buf = landing(self.layout, s.size, out)  # buf: uint8 [n, page_bytes]
        values = self._get([self.key(layer, int(i)) for i in s]) if s.size else []
        pb, width = self.layout.page_bytes, self.layout.page_bytes + CHECKSUM.itemsize
        gone, short = np.zeros(s.size, dtype=bool), np.zeros(s.size, dtype=bool)
        stored = np.zeros(s.size, dtype=np.uint32)
        rows = memoryview(buf).cast("B")  # buf's bytes, flat: each value lands straight in its row
        for i, v in enumerate(values):
            if v is None or len(v) != width:
                gone[i], short[i] = v is None, v is not None
                continue
            rows[i * pb:(i + 1) * pb] = memoryview(v)[:pb]
            stored[i] = int.from_bytes(v[pb:], "little")
        sums = page_checksums(buf)
        corrupt = short | (~gone & ((sums != stored) | (sums != self._sum[layer, s])))
        if gone.any() or corrupt.any():
            buf[gone | corrupt] = 0
            self._valid[layer, s[gone]] = False
            if gone.any():
                raise PageEvictedError(
                    f"remote tier '{self.name}' layer {layer}: slots {s[gone].tolist()} are gone from {self.where} "
                    f"({self.lost}); rewrite them, or {self.refused_fix}")
            raise PageCorruptedError(
                f"remote tier '{self.name}' layer {layer}: slots {s[corrupt].tolist()} from {self.where} failed "
                "their checksum (overwritten behind kvtier's back, or corrupted); rewrite them")
        return dst if out is None or out is dst else out.copy_(dst)

    def write(self, layer, slots, pages):
        self._check_pages(slots, pages)
        s = slot_array(self, slots)
        buf = page_bytes_view(pages)  # [n, page_bytes]
        sums = page_checksums(buf)
        pb = self.layout.page_bytes
        values = np.empty((s.size, pb + CHECKSUM.itemsize), dtype=np.uint8)  # [n, page_bytes + 4]: page, checksum
        values[:, :pb] = buf
        values[:, pb:] = sums.astype(CHECKSUM).view(np.uint8).reshape(-1, CHECKSUM.itemsize)
        self._valid[layer, s] = False
        failed = self._put([self.key(layer, int(slot)) for slot in s], values)
        if failed:
            raise TierIOError(f"remote tier '{self.name}' layer {layer}: {self.where} refused {len(failed)} of "
                              f"{s.size} pages ({failed[0]}); {self.refused_fix}, or lower "
                              f"tiers.stack.{self.name}.fraction (or .size)")
        self._sum[layer, s] = sums
        self._valid[layer, s] = True

    def free(self, layer, slots):
        """Return the slots and delete their keys (releasing the store's memory).

        The slots are freed locally even when the store cannot be reached (``TierIOError``).
        """
        super().free(layer, slots)
        s = slot_array(self, slots)
        layers = np.broadcast_to(np.asarray(layer, dtype=np.int64), s.shape)
        self._valid[layers, s] = False
        for layer in np.unique(layers).tolist():  # one round trip per layer: its keys share a hash slot
            self._delete([self.key(layer, i) for i in s[layers == layer].tolist()])

    def close(self) -> None:
        """Delete this tier's keys when the store is reachable, then disconnect."""
        try:
            for layer in range(self.layout.num_layers):
                held = np.flatnonzero(self._valid[layer])
                if held.size:
                    self._delete([self.key(layer, int(i)) for i in held])
        except TierIOError:
            pass  # an unreachable store: a dead one holds nothing of ours, a hung one keeps our keys
        self._valid[:] = False
        self._disconnect()
