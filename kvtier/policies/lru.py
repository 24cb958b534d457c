"""LRU: the most recently attended pages stay in the fast tier."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kvtier.policies.base import PageInfo, Policy, grown


@dataclass
class LRU(Policy):
    """Priority = the step at which a (layer, page) was last attended or created."""

    name: ClassVar[str] = "lru"

    def reset(self, num_layers):
        super().reset(num_layers)
        self.last_access = np.full((num_layers, 64), -1.0)  # [L, pids]

    def on_append(self, pids, step):
        self.last_access = grown(self.last_access, int(pids.max(initial=-1)) + 1, -1.0)
        self.last_access[:, pids] = step

    def on_access(self, layer, pids, step):
        self.last_access = grown(self.last_access, int(pids.max(initial=-1)) + 1, -1.0)
        self.last_access[layer, pids] = step

    def priority(self, info: PageInfo) -> np.ndarray:
        self.last_access = grown(self.last_access, int(info.pids.max(initial=-1)) + 1, -1.0)
        return self.last_access[:, info.pids]  # [L, n]
