"""Tier: one level of the memory hierarchy, holding one page pool per layer.

A page is ``[2, page_size, N_kv, D]`` (K then V, FlashInfer NHD). Capacities are in pages per
layer. Slots are allocated from a per-layer free stack; a full tier raises ``TierFullError``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch

from kvtier.errors import ConfigError, KVTierError, TierFullError
from kvtier.layout import KVLayout


class Tier(ABC):
    """One level of the hierarchy. Subclasses store pages; this class owns slot bookkeeping: per-layer
    free stacks of slot ids with an allocated bitmap (catches double frees)."""

    kind: str = "tier"

    def __init__(self, layout: KVLayout, capacity: int, name: str | None = None):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0:
            raise ConfigError("capacity", f"tier '{name or self.kind}': must be a positive number of pages, got {capacity!r}")
        self.layout = layout
        self.capacity = capacity
        self.name = name or self.kind
        L = layout.num_layers
        self._stack = np.tile(np.arange(capacity - 1, -1, -1, dtype=np.int64), (L, 1))  # [L, cap] free slots on top
        self._top = np.full(L, capacity, dtype=np.int64)  # [L] free slots per layer
        self._used = np.zeros((L, capacity), dtype=bool)  # [L, cap]
        self._marks = np.zeros((L, capacity), dtype=np.int32)  # [L, cap] scratch of free's double-free check

    @classmethod
    def check_settings(cls, field: str, layout: KVLayout, capacity: int, **settings) -> None:
        """ConfigError for a setting of this tier that cannot work, before anything is built or any model loads
        (:func:`kvtier.build.plan`): ``settings`` are the constructor's arguments (the recipe node's keys, defaults
        filled in), ``field`` the node's key (``tiers.stack.<name>``), ``capacity`` its pages per layer."""

    # -- bookkeeping -------------------------------------------------------------------------
    def alloc(self, layer, n: int = 1) -> torch.Tensor:
        """Reserve ``n`` slots in each of ``layer`` (an int, or ``[k]`` layers, repeats allowed): int64 ``[k * n]``,
        ``n`` per entry in order (a layer's k-th slot is its k-th off the free stack); raises TierFullError
        before reserving any."""
        layers = np.repeat(np.asarray(layer, dtype=np.int64).reshape(-1), n)  # [k * n]
        count = np.bincount(layers, minlength=self._top.size)  # [L]
        short = np.flatnonzero(count > self._top)
        if short.size:
            layer, top = int(short[0]), int(self._top[short[0]])
            raise TierFullError(f"tier '{self.name}' layer {layer}: asked for {count[layer]} pages, {top} of "
                                f"{self.capacity} free; raise this tier's capacity or let the scheduler demote "
                                "pages first")
        cap = self.capacity  # flat indices into the [L * cap] views (faster than two index arrays)
        slots = self._stack.reshape(-1)[layers * cap + self._top[layers] - 1 - rank_in_layer(layers, count)]
        self._top -= count
        self._used.reshape(-1)[layers * cap + slots] = True
        return torch.from_numpy(slots)

    def free(self, layer, slots: torch.Tensor) -> None:
        """Return ``slots`` ``[n]`` of ``layer`` (an int, or ``[n]``: each slot's layer) to the pool; a slot that is
        not allocated, or given twice, raises KVTierError before any is freed."""
        s = (slots.cpu().numpy() if torch.is_tensor(slots) else np.asarray(slots)).astype(np.int64).reshape(-1)
        if s.size == 0:
            return
        layers = np.broadcast_to(np.asarray(layer, dtype=np.int64), s.shape)  # [n]
        flat = layers * self.capacity + s  # [n] into the [L * cap] views (faster than two index arrays)
        used, marks = self._used.reshape(-1), self._marks.reshape(-1)
        bad = (s < 0).any() or (s >= self.capacity).any() or not used[flat].all()
        if not bad:  # a slot given twice: a later entry overwrites an earlier one's mark (no sort)
            entry = np.arange(s.size, dtype=np.int32)
            marks[flat] = entry
            bad = not (marks[flat] == entry).all()
        if bad:
            where = f"layer {layer}" if np.ndim(layer) == 0 else f"layers {layers.tolist()}"
            raise KVTierError(f"tier '{self.name}' {where}: free of slots not allocated: {s.tolist()}")
        used[flat] = False
        count = np.bincount(layers, minlength=self._top.size)  # [L]
        self._stack.reshape(-1)[layers * self.capacity + self._top[layers] + rank_in_layer(layers, count)] = s
        self._top += count

    def num_free(self, layer):
        """Free slots of ``layer``: an int, or ``[k]`` for ``[k]`` layers."""
        n = self._top[layer]
        return int(n) if np.ndim(n) == 0 else n.copy()

    def num_used(self, layer):
        """Used slots of ``layer``: an int, or ``[k]`` for ``[k]`` layers."""
        return self.capacity - self.num_free(layer)

    def allocated_slots(self, layer: int) -> np.ndarray:
        return np.flatnonzero(self._used[layer])

    # -- data --------------------------------------------------------------------------------
    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where :meth:`read` returns pages (and where attention 'where they live' runs)."""

    @abstractmethod
    def read(self, layer: int, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Pages ``[n, 2, page_size, N_kv, D]`` of ``slots`` (into ``out`` when given)."""

    @abstractmethod
    def write(self, layer: int, slots: torch.Tensor, pages: torch.Tensor) -> None:
        """Store ``pages`` ``[n, 2, page_size, N_kv, D]`` into ``slots``."""

    def pool(self, layer: int) -> torch.Tensor | None:
        """The layer's whole pool ``[capacity, 2, P, N_kv, D]`` when it is addressable memory, else None."""
        return None

    def pools(self) -> torch.Tensor | None:
        """Every layer's pool as one ``[L * capacity, 2, P, N_kv, D]`` tensor (page ``(layer, slot)`` at
        ``layer * capacity + slot``) when the tier is addressable memory, else None."""
        return None

    def close(self) -> None:
        """Release backing resources (files, connections)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, capacity={self.capacity})"

    def _check_pages(self, slots: torch.Tensor, pages: torch.Tensor) -> None:
        want = (slots.numel(), *self.layout.page_shape)
        if tuple(pages.shape) != want:
            raise ValueError(f"tier '{self.name}': pages of shape {tuple(pages.shape)}, expected {want}")
        if pages.dtype != self.layout.kv_dtype:
            raise ValueError(f"tier '{self.name}': pages of dtype {pages.dtype}, expected {self.layout.kv_dtype}")


def rank_in_layer(layers: np.ndarray, count: np.ndarray) -> np.ndarray:
    """``[n]``: how many earlier entries of ``layers`` ``[n]`` name the same layer (``count [L]``: entries per layer)."""
    if layers.size and (layers[1:] >= layers[:-1]).all():  # grouped by layer already (np.nonzero's order): no sort
        return np.arange(layers.size) - (np.cumsum(count) - count)[layers]
    order = np.argsort(layers, kind="stable")
    rank = np.empty_like(layers)
    rank[order] = np.arange(layers.size) - (np.cumsum(count) - count)[layers[order]]
    return rank
