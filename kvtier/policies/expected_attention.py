"""Expected Attention (Devoto et al., 2025, arXiv:2510.00636): score keys by the attention future queries
are expected to give them, with queries modelled as a Gaussian fitted to the recent ones:
E[exp(q·k/√d)] = exp(μ·k/√d + kᵀΣk/(2d)).

Here, page-level and simplified: μ and a diagonal Σ from the last ``rows`` queries of each layer (as
observed, with their rotary phase; the paper averages the rotation over future positions and weighs
by value norms, neither done here), and a page's keys through their mean and mean square:
μ·k̄/√d + Σ_c σ²_c·mean(k_c²)/(2d) (the expected log-attention of the page's typical key).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvtier.policies.scored import ScoredPolicy, Scorer


@dataclass
class ExpectedLogit(Scorer):
    needs = frozenset({"keys", "queries"})
    rows: int = 32

    def score_device(self, keys, queries, pids: int) -> torch.Tensor:
        L, _, n_kv, D = keys.key_sum.shape
        if queries is None:
            return torch.zeros(L, pids, device=keys.device)
        mu, var = queries.moments()  # [L, H, D] (0 before any query)
        H = mu.shape[1]
        mu, var = mu.reshape(L, n_kv, H // n_kv, D), var.reshape(L, n_kv, H // n_kv, D)
        written = keys.count[:, :pids].clamp(min=1)[..., None, None]  # [L, pids, 1, 1]
        k, k2 = keys.key_sum[:, :pids] / written, keys.key_sq[:, :pids] / written  # [L, pids, N_kv, D]
        logit = (torch.einsum("lngd,lpnd->lpng", mu, k) / D ** 0.5 +
                 torch.einsum("lngd,lpnd->lpng", var, k2) / (2 * D))  # [L, pids, N_kv, G]
        return logit.reshape(L, pids, H).amax(-1)  # [L, pids]


@dataclass
class ExpectedAttention(ScoredPolicy):
    obs_window: int = 32
    name: ClassVar[str] = "expected_attention"

    def make_scorer(self):
        return ExpectedLogit(self.obs_window)
