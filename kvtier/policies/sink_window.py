"""SinkWindow (StreamingLLM, Xiao et al., 2023, arXiv:2309.17453): attention sinks and the recent window."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kvtier.policies.scored import ScoredPolicy, Scorer


@dataclass
class Recency(Scorer):
    """Later pages score higher: position alone (StreamingLLM keeps nothing but sinks and the recent)."""

    def score(self, stats) -> np.ndarray:
        return stats.info.logical.astype(np.float64)[None, :]  # [1, n]


@dataclass
class SinkWindow(ScoredPolicy):
    """StreamingLLM: pins the pages holding the first ``sinks`` and the last ``window`` tokens.

    Other pages rank by position (later is higher), so spare room holds a longer window. Under a
    token budget (``TieredKVCache(budget=...)``) attention reads exactly the first ``sinks`` tokens
    and the last ``budget - sinks`` tokens, as in the paper.
    """

    window: int = 256
    name: ClassVar[str] = "sink_window"

    def make_scorer(self):
        return Recency()
