"""Quest (Tang et al., 2024, arXiv:2406.10774) as a placement policy: a page's score is the upper bound
of q·k over its keys for the newest query, from per-channel key min/max. (Quest's own use, choosing
the pages each decode step attends, is the ``topk`` scope.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvtier.stats import quest_bound
from kvtier.policies.scored import ScoredPolicy, Scorer


@dataclass
class QueryBound(Scorer):
    """Quest's bound for the newest query, max over query heads (0 before any query; the lowest for an empty page)."""

    needs = frozenset({"keys", "queries"})

    def score_device(self, keys, queries, pids: int) -> torch.Tensor:
        L, _, _, D = keys.key_min.shape
        if queries is None:
            return torch.zeros(L, pids, device=keys.device)
        q = queries.last()  # [L, H, D] (NaN before any query)
        step = max(1, (1 << 24) // max(1, pids * q.shape[1] * D))  # layers at a time: temporaries <= 16M floats
        bound = torch.cat([quest_bound(q[a:a + step], keys.key_min[a:a + step, :pids], keys.key_max[a:a + step, :pids])
                           .amax(-1) for a in range(0, L, step)])  # [L, pids]
        empty = keys.count[:, :pids] == 0
        return torch.nan_to_num(bound, nan=0.0, neginf=-1e30).masked_fill(empty, -1e30)


@dataclass
class Quest(ScoredPolicy):
    name: ClassVar[str] = "quest"

    def make_scorer(self):
        return QueryBound()
