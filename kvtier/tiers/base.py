"""Tier: one level of the memory hierarchy, holding one page pool per layer.

A page is ``[2, page_size, N_kv, D]`` (K then V, FlashInfer NHD). Capacities are in pages per
layer. Slots are allocated from a per-layer free stack; a full tier raises ``TierFullError``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.errors import ConfigError, KVTierError, TierFullError
from kvtier.layout import KVLayout


@dataclass(frozen=True)
class TierSpec:
    """A tier's cost figures, kept on it as ``spec``: bandwidth to the device tier and latency."""

    bandwidth_gbps: float
    latency_s: float

    def __post_init__(self):
        if not self.bandwidth_gbps > 0:
            raise ConfigError("spec.bandwidth_gbps", f"must be > 0, got {self.bandwidth_gbps}")
        if not self.latency_s >= 0:
            raise ConfigError("spec.latency_s", f"must be >= 0, got {self.latency_s}")


class Tier(ABC):
    """One level of the hierarchy. Subclasses store pages; this class owns slot bookkeeping: per-layer
    free stacks of slot ids with an allocated bitmap (catches double frees)."""

    kind: str = "tier"

    def __init__(self, layout: KVLayout, capacity: int, spec: TierSpec, name: str | None = None):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0:
            raise ConfigError("capacity", f"tier '{name or self.kind}': must be a positive number of pages, got {capacity!r}")
        self.layout = layout
        self.capacity = capacity
        self.spec = spec
        self.name = name or self.kind
        L = layout.num_layers
        self._stack = np.tile(np.arange(capacity - 1, -1, -1, dtype=np.int64), (L, 1))  # [L, cap] free slots on top
        self._top = np.full(L, capacity, dtype=np.int64)  # [L] free slots per layer
        self._used = np.zeros((L, capacity), dtype=bool)  # [L, cap]

    # -- bookkeeping -------------------------------------------------------------------------
    def alloc(self, layer: int, n: int) -> torch.Tensor:
        """Reserve ``n`` slots in ``layer``'s pool: int64 ``[n]``; raises TierFullError."""
        top = int(self._top[layer])
        if n > top:
            raise TierFullError(f"tier '{self.name}' layer {layer}: asked for {n} pages, {top} of {self.capacity} "
                                "free; raise this tier's capacity or let the scheduler demote pages first")
        slots = self._stack[layer, top - n:top][::-1].copy()
        self._top[layer] = top - n
        self._used[layer, slots] = True
        return torch.from_numpy(slots)

    def free(self, layer: int, slots: torch.Tensor) -> None:
        """Return slots to the pool; freeing a slot twice raises."""
        s = np.asarray(slots.cpu(), dtype=np.int64).reshape(-1)
        if s.size == 0:
            return
        if (s < 0).any() or (s >= self.capacity).any() or not self._used[layer, s].all() \
                or np.unique(s).size != s.size:
            raise KVTierError(f"tier '{self.name}' layer {layer}: free of slots not allocated: {s.tolist()}")
        self._used[layer, s] = False
        top = int(self._top[layer])
        self._stack[layer, top:top + s.size] = s
        self._top[layer] = top + s.size

    def num_free(self, layer: int) -> int:
        return int(self._top[layer])

    def num_used(self, layer: int) -> int:
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
