"""LRU: the most recently attended pages stay in the fast tier."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kvtier.policies.base import PageInfo, Policy
from kvtier.table import grown


@dataclass
class LRU(Policy):
    """Priority = the step at which a (layer, page) was last attended or created. A page that every layer attended
    (or that was created) is stamped once, not once per layer: a decode that attends every page writes ``L`` times
    fewer cells (16 rows of 8k, 30 layers: 0.27 ms of host time a step before, 0.02 ms after, on this CPU)."""

    name: ClassVar[str] = "lru"

    def reset(self, num_layers):
        super().reset(num_layers)
        self.by_layer = np.full((num_layers, 64), -1.0)  # [L, pids] last step a layer alone attended the page
        self.by_every_layer = np.full(64, -1.0)  # [pids] last step every layer attended it, or it was created

    def on_append(self, pids, step):
        self._room(pids)
        self.by_every_layer[pids] = step

    def on_access(self, layer, pids, step):
        self._room(pids)
        if isinstance(layer, slice) and layer == slice(None):
            self.by_every_layer[pids] = step
        else:
            self.by_layer[layer, pids] = step

    def last_access(self, pids: np.ndarray) -> np.ndarray:
        """``[L, n]``: the last step each layer attended each of ``pids [n]`` (steps only grow, so the later stamp)."""
        self._room(pids)
        return np.maximum(self.by_layer[:, pids], self.by_every_layer[pids])

    def priority(self, info: PageInfo) -> np.ndarray:
        return self.last_access(info.pids)  # [L, n]

    def _room(self, pids: np.ndarray) -> None:
        size = int(np.max(pids, initial=-1)) + 1
        self.by_layer = grown(self.by_layer, size, -1.0)
        self.by_every_layer = grown(self.by_every_layer, size, -1.0)
