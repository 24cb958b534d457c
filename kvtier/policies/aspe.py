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
from kvtier.policies.base import EVICT, PINNED, PageInfo, Policy, check_counts, grown, sink_window_pages


@dataclass
class ASPE(Policy):
    sinks: int = 4
    window: int = 64
    obs_window: int = 16
    theta_evict: float = 1e-3
    theta_prefetch: float = 1e-2
    per_layer: bool = True
    name: ClassVar[str] = "aspe"

    def __post_init__(self):
        check_counts(self, "sinks", "window")
        if not isinstance(self.obs_window, int) or self.obs_window <= 0:
            raise ConfigError("policy.obs_window", f"must be a positive number of steps, got {self.obs_window!r}")
        for key in ("theta_evict", "theta_prefetch"):  # salience is an attention probability
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise ConfigError(f"policy.{key}", f"must be a salience (attention probability) in [0, 1], got {v!r}")
        if self.theta_evict > self.theta_prefetch:
            raise ConfigError("policy.theta_evict", f"{self.theta_evict} is above theta_prefetch "
                                                    f"({self.theta_prefetch}); use theta_evict <= theta_prefetch")

    def pinned_pages(self, page_size: int) -> int:
        return sink_window_pages(self.sinks, self.window, page_size)

    @property
    def needs_salience(self) -> bool:
        return True

    def reset(self, num_layers):
        super().reset(num_layers)
        self.hist = np.full((self.obs_window, num_layers, 64), np.nan, dtype=np.float32)  # [W, L, pids]
        self.last_phi = np.full((num_layers, 64), np.nan, dtype=np.float32)  # [L, pids]
        self._row = 0

    def on_step(self, step):
        self._row = step % self.obs_window
        self.hist[self._row] = np.nan

    def on_append(self, pids, step):
        self._grow(int(pids.max(initial=-1)) + 1)
        self.hist[:, :, pids] = np.nan  # a recycled pid starts with no history
        self.last_phi[:, pids] = np.nan

    def on_salience(self, layer, pids, scores, step):
        self._grow(int(pids.max(initial=-1)) + 1)
        self.hist[self._row, layer, pids] = scores.sum(-1)  # Σ over kv heads

    def phi(self, pids: np.ndarray) -> np.ndarray:
        """Φ ``[L, n]``: windowed mean where observed, else the last Φ seen, else θ_evict."""
        self._grow(int(pids.max(initial=-1)) + 1)
        h = self.hist[:, :, pids]  # [W, L, n]
        seen = ~np.isnan(h)
        count = seen.sum(0)
        mean = np.where(seen, h, 0).sum(0) / np.maximum(count, 1)  # [L, n]
        self.last_phi[:, pids] = np.where(count > 0, mean, self.last_phi[:, pids])
        phi = np.where(np.isnan(self.last_phi[:, pids]), self.theta_evict, self.last_phi[:, pids])
        if not self.per_layer:
            phi = np.broadcast_to(phi.sum(0, keepdims=True), phi.shape)
        return phi

    def priority(self, info: PageInfo) -> np.ndarray:
        phi = self.phi(info.pids).astype(np.float64)  # [L, n]
        pinned = (info.in_sinks(self.sinks) | info.in_window(self.window))[None, :]
        return np.where(pinned, PINNED, np.where(phi < self.theta_evict, EVICT, phi))

    def admit(self, info: PageInfo) -> np.ndarray:
        return self.phi(info.pids) > self.theta_prefetch  # [L, n]

    def _grow(self, size):
        self.hist = grown(self.hist, size, np.nan)
        self.last_phi = grown(self.last_phi, size, np.nan)
