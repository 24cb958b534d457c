"""Quest (Tang et al., 2024, arXiv:2406.10774) as a placement policy: a page's score is the upper bound
of q·k over its keys for the newest query, from per-channel key min/max. (Quest's own use, choosing
the pages each decode step attends, is the ``topk`` scope.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from kvtier.engine.stats import quest_bound
from kvtier.policies.scored import ScoredPolicy, Scorer


@dataclass
class QueryBound(Scorer):
    """Quest's bound for the newest query, max over query heads (0 before any query)."""

    needs = frozenset({"keys", "queries"})

    def score(self, stats) -> np.ndarray:
        if stats.query_last is None:
            return np.zeros((1, stats.info.pids.size))
        kmin, kmax = stats.key_bounds  # [L, n, N_kv, D] on the engine's device
        q = stats.query_last  # [L, H, D]; a layer at a time keeps the temporaries at [n, H, D]
        bound = torch.cat([quest_bound(q[i:i + 1], kmin[i:i + 1], kmax[i:i + 1]).amax(-1)
                           for i in range(q.shape[0])])  # [L, n]
        return torch.nan_to_num(bound, neginf=-1e30).cpu().numpy()


@dataclass
class Quest(ScoredPolicy):
    name: ClassVar[str] = "quest"

    def make_scorer(self):
        return QueryBound()
