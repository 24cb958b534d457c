"""Placement policies, one dataclass per file; ``POLICIES`` maps recipe names to classes."""

from kvtier.policies.aspe import ASPE
from kvtier.policies.base import EVICT, PINNED, PageInfo, Policy
from kvtier.policies.compose import Compose
from kvtier.policies.lru import LRU
from kvtier.policies.sink_window import SinkWindow

POLICIES = {"lru": LRU, "sink_window": SinkWindow, "aspe": ASPE, "compose": Compose}

__all__ = ["ASPE", "Compose", "EVICT", "LRU", "PINNED", "POLICIES", "PageInfo", "Policy", "SinkWindow"]
