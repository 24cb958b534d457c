"""Knorm (Devoto et al., 2024, arXiv:2406.11430): keys with a low L2 norm draw high attention, so the
lowest-norm keys are kept. Needs neither queries nor attention: the cheapest scorer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kvtier.policies.scored import ScoredPolicy, Scorer, best_head


@dataclass
class KeyNorm(Scorer):
    """Minus the page's mean key norm (per kv head; the best head: the lowest norm)."""

    needs = frozenset({"keys"})
    reads_key_norm: ClassVar[bool] = True

    def score(self, stats) -> np.ndarray:
        return best_head(-np.nan_to_num(stats.key_norm, nan=np.inf))  # [L, n]


@dataclass
class Knorm(ScoredPolicy):
    name: ClassVar[str] = "knorm"

    def make_scorer(self):
        return KeyNorm()
