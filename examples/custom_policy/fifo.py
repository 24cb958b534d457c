"""A user's own placement policy: the oldest pages leave the device first, the first ``sinks`` tokens
stay. Nothing in kvtier names it: a recipe's ``_target_`` (policy/fifo.yaml) or Python builds it."""

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kvtier.errors import ConfigError
from kvtier.policies import PINNED, PageInfo, Policy


@dataclass
class Fifo(Policy):
    sinks: int = 4
    name: ClassVar[str] = "fifo"

    def __post_init__(self):
        if not isinstance(self.sinks, int) or self.sinks < 0:
            raise ConfigError("policy.sinks", f"must be an integer >= 0, got {self.sinks!r}")

    def pinned_pages(self, page_size: int) -> int:  # checked against the device budget
        return -(-self.sinks // page_size)

    def priority(self, info: PageInfo) -> np.ndarray:
        prio = info.logical.astype(np.float64)  # [n]: later pages rank higher
        return np.where(info.in_sinks(self.sinks), PINNED, prio)[None, :]  # [1, n]
