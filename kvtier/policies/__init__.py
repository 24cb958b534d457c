"""Placement policies, one dataclass per file; ``POLICIES`` maps recipe names to classes.

A scored policy (:mod:`kvtier.policies.scored`) is a scorer over :class:`PageStats` plus sinks and
a recent window pinned: StreamingLLM (:class:`SinkWindow`), :class:`H2O`, :class:`TOVA`,
:class:`SnapKV`, :class:`Knorm`, :class:`Quest`, :class:`ExpectedAttention`, :class:`ASPE`.
"""

from kvtier.policies.aspe import ASPE
from kvtier.policies.base import EVICT, PINNED, PageInfo, Policy
from kvtier.policies.compose import Compose
from kvtier.policies.expected_attention import ExpectedAttention
from kvtier.policies.h2o import H2O
from kvtier.policies.knorm import Knorm
from kvtier.policies.lru import LRU
from kvtier.policies.quest import Quest
from kvtier.policies.scored import ScoredPolicy, Scorer
from kvtier.policies.sink_window import SinkWindow
from kvtier.policies.snapkv import SnapKV
from kvtier.policies.stats import PageStats
from kvtier.policies.tova import TOVA

POLICIES = {"lru": LRU, "sink_window": SinkWindow, "aspe": ASPE, "compose": Compose, "h2o": H2O, "tova": TOVA,
            "snapkv": SnapKV, "knorm": Knorm, "quest": Quest, "expected_attention": ExpectedAttention,
            "scored": ScoredPolicy}

__all__ = ["ASPE", "Compose", "EVICT", "ExpectedAttention", "H2O", "Knorm", "LRU", "PINNED", "POLICIES",
           "PageInfo", "PageStats", "Policy", "Quest", "ScoredPolicy", "Scorer", "SinkWindow", "SnapKV", "TOVA"]
