"""ASPE (seed 000): attention-salience-aware prefetch and eviction.

Φ(page) = mean over the last ``obs_window`` steps of Σ_heads max_{j∈page} A[τ, j] (summed over
layers too when ``per_layer=False``). Sinks and the local window are pinned; pages with
Φ < θ_evict are demoted even when there is room; a page outside the fast tier may be promoted
(prefetched) only when its predicted activation, its last observed Φ, exceeds θ_prefetch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kvtier.errors import ConfigError
from kvtier.policies.base import EVICT, PageInfo
from kvtier.policies.scored import ScoredPolicy, Scorer


@dataclass
class Salience(Scorer):
    """Φ: windowed mean of per-page salience (max attention probability, summed over kv heads);
    ``default`` where a page was never observed."""

    needs = frozenset({"salience"})
    obs_window: int = 16
    default: float = 1e-3
    per_layer: bool = True

    def score(self, stats) -> np.ndarray:
        phi = np.where(np.isnan(stats.salience), self.default, stats.salience)  # [L, n]
        return phi if self.per_layer else np.broadcast_to(phi.sum(0, keepdims=True), phi.shape)


@dataclass
class ASPE(ScoredPolicy):
    sinks: int = 4
    window: int = 64
    obs_window: int = 16
    theta_evict: float = 1e-3
    theta_prefetch: float = 1e-2
    per_layer: bool = True
    name: ClassVar[str] = "aspe"

    def __post_init__(self):
        if not isinstance(self.obs_window, int) or self.obs_window <= 0:
            raise ConfigError("policy.obs_window", f"must be a positive number of steps, got {self.obs_window!r}")
        for key in ("theta_evict", "theta_prefetch"):  # salience is an attention probability
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise ConfigError(f"policy.{key}", f"must be a salience (attention probability) in [0, 1], got {v!r}")
        if self.theta_evict > self.theta_prefetch:
            raise ConfigError("policy.theta_evict", f"{self.theta_evict} is above theta_prefetch "
                                                    f"({self.theta_prefetch}); use theta_evict <= theta_prefetch")
        super().__post_init__()

    def make_scorer(self):
        return Salience(self.obs_window, self.theta_evict, self.per_layer)

    def phi(self, pids: np.ndarray) -> np.ndarray:
        """Φ ``[L, n]``: windowed mean where observed, else the last Φ seen, else θ_evict."""
        n = pids.size
        return self.score(PageInfo(pids, np.zeros(n, np.int64), np.ones(n, np.int64), 1, 0))

    def ranked(self, info: PageInfo) -> tuple[np.ndarray, np.ndarray]:
        phi = self.score(info)  # [L, n]
        prio = np.where(self.pinned(info)[None, :], np.inf, np.where(phi < self.theta_evict, EVICT, phi))
        return prio, phi > self.theta_prefetch

    def priority(self, info: PageInfo) -> np.ndarray:
        return self.ranked(info)[0]

    def admit(self, info: PageInfo) -> np.ndarray:
        return self.ranked(info)[1]
