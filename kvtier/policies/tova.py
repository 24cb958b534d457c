"""TOVA (Oren et al., 2024, arXiv:2401.06104): keep what the newest query attends; the token the
last query attends least (averaged over heads) goes first."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kvtier.policies.scored import ScoredPolicy, Scorer, fold_kv_heads


@dataclass
class LastQueryAttention(Scorer):
    """The newest query row's attention on each page, averaged over kv heads (as in the paper)."""

    needs = frozenset({"attention"})
    attention_fields: ClassVar[frozenset] = frozenset({"last"})

    def score(self, stats) -> np.ndarray:
        return fold_kv_heads(stats.attention_last, np.add) / stats.attention_last.shape[-1]  # [L, n] mean over kv heads


@dataclass
class TOVA(ScoredPolicy):
    """TOVA's ranking; TOVA itself pins nothing (``sinks=0, window=0`` for the paper's form)."""

    name: ClassVar[str] = "tova"

    def make_scorer(self):
        return LastQueryAttention()
