"""Quest (Tang et al., 2024, arXiv:2406.10774) as a placement policy: a page's score is the upper bound
of q·k over its keys for the newest query, from per-channel key min/max. (Quest's own use, choosing
the pages each decode step attends, is the ``topk`` scope.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kvtier.policies.scored import ScoredPolicy, Scorer


def quest_bound(q: np.ndarray, kmin: np.ndarray, kmax: np.ndarray) -> np.ndarray:
    """Σ_d max(q_d·kmin_d, q_d·kmax_d) per query head: q ``[L, H, D]``, keys ``[L, n, N_kv, D]`` -> ``[L, n, H]``."""
    L, H, D = q.shape
    n_kv = kmin.shape[2]
    qg = q.reshape(L, 1, n_kv, H // n_kv, D)  # [L, 1, N_kv, G, D]
    ub = np.maximum(qg * kmin[:, :, :, None], qg * kmax[:, :, :, None]).sum(-1)  # [L, n, N_kv, G]
    return ub.reshape(L, -1, H)


@dataclass
class QueryBound(Scorer):
    """Quest's bound for the newest query, max over query heads (0 before any query)."""

    needs = frozenset({"keys", "queries"})

    def score(self, stats) -> np.ndarray:
        if stats.query_last is None:
            return np.zeros((1, stats.info.pids.size))
        kmin, kmax = stats.key_bounds
        return np.nan_to_num(quest_bound(stats.query_last, kmin, kmax), neginf=-1e30).max(-1)  # [L, n]


@dataclass
class Quest(ScoredPolicy):
    name: ClassVar[str] = "quest"

    def make_scorer(self):
        return QueryBound()
