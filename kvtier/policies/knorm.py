"""Knorm (Devoto et al., 2024, arXiv:2406.11430): keys with a low L2 norm draw high attention, so the
lowest-norm keys are kept. Needs neither queries nor attention: the cheapest scorer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvtier.policies.scored import ScoredPolicy, Scorer


@dataclass
class KeyNorm(Scorer):
    """Minus the page's mean key norm (per kv head; the best head: the lowest norm; the lowest for an empty page)."""

    needs = frozenset({"keys"})

    def score_device(self, keys, queries, pids: int) -> torch.Tensor:
        count = keys.count[:, :pids, None]  # [L, pids, 1]
        norm = torch.where(count > 0, keys.norm_sum[:, :pids] / count.clamp(min=1), float("inf"))  # [L, pids, N_kv]
        return -norm.amin(-1)  # [L, pids]


@dataclass
class Knorm(ScoredPolicy):
    name: ClassVar[str] = "knorm"

    def make_scorer(self):
        return KeyNorm()
