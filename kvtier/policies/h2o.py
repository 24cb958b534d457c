"""H2O (Zhang et al., 2023, arXiv:2306.14048): heavy hitters, the tokens with the largest attention
accumulated over every query so far."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kvtier.policies.scored import ScoredPolicy, Scorer, best_head


@dataclass
class AccumulatedAttention(Scorer):
    """Attention mass a page received, summed over every observed query row (prefill rows included)."""

    needs = frozenset({"attention"})
    attention_fields: ClassVar[frozenset] = frozenset({"total"})
    every_row = True

    def score(self, stats) -> np.ndarray:
        return best_head(stats.attention_total)  # [L, n]


@dataclass
class H2O(ScoredPolicy):
    """Heavy hitters + the recent window (H2O's two halves); sinks are pinned as well (0 to drop)."""

    name: str = "h2o"

    def make_scorer(self):
        return AccumulatedAttention()
