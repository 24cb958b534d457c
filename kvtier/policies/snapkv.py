"""SnapKV (Li et al., 2024, arXiv:2404.14469): an observation window of the newest queries votes on
which keys matter; their attention is pooled and the best keys are kept."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kvtier.errors import ConfigError
from kvtier.policies.scored import ScoredPolicy, Scorer, best_head


@dataclass
class WindowAttention(Scorer):
    """Attention summed over the last ``rows`` query rows (at the end of a prefill: the prompt's last
    ``rows`` tokens, the question; during decode: the last ``rows`` steps). A page sums its tokens,
    which pools neighbouring keys as SnapKV's max-pooling does; heads: the best kv head."""

    needs = frozenset({"attention"})
    attention_fields: ClassVar[frozenset] = frozenset({"window"})
    rows: int = 32

    def score(self, stats) -> np.ndarray:
        return best_head(stats.attention_window)  # [L, n]


@dataclass
class SnapKV(ScoredPolicy):
    obs_window: int = 32
    name: ClassVar[str] = "snapkv"

    def __post_init__(self):
        if not isinstance(self.obs_window, int) or isinstance(self.obs_window, bool) or self.obs_window < 1:
            raise ConfigError("policy.obs_window", f"must be a positive number of query rows, got {self.obs_window!r}")
        super().__post_init__()

    def make_scorer(self):
        return WindowAttention(self.obs_window)
