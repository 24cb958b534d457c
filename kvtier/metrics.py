"""Counters a run reports: hits, bytes per link, stalls, occupancy, latency percentiles."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class CacheStats:
    """What the cache observed. Hit = an attended page that was read in place from the device tier; the hit rate
    over prefill and decode is :meth:`kvtier.engine.Engine.hit_rate` (decode pages are counted on the device)."""

    attended_pages: int = 0  # pages prefill chunks attended (every layer)
    resident_pages: int = 0  # of those, read from the device tier
    planned_pages: int = 0
    fetch_s: float = 0.0
    fidelity_s: float = 0.0  # time in the uncounted exact pass of cache.fidelity (left out of TTFT/TPOT)
    dropped_pages: int = 0  # (layer, page)s freed for good: left of their sliding window
    dropped_bytes: int = 0
    fetched_bytes: Counter = field(default_factory=Counter)  # link -> bytes copied for attention
    occupancy: list = field(default_factory=list)  # [(step, {tier: pages in use, mean over layers})]
    compressed_pages: int = 0  # (layer, page)s dropped by a compression once the prefill ended
    attended_tokens: dict = field(default_factory=dict)  # decode step -> keys attended, summed over layers
    attention_calls: dict = field(default_factory=dict)  # decode step -> attention calls (layers)
    steps: int = 0  # decode steps
    host_wait_s: float = 0.0  # host blocked on the GPU (lookahead bound, room for new pages)

    def add_attended_tokens(self, step: int, tokens: float, calls: int = 1) -> None:
        """``calls`` decode calls attended ``tokens`` keys in all (per sequence)."""
        self.attended_tokens[step] = self.attended_tokens.get(step, 0) + tokens
        self.attention_calls[step] = self.attention_calls.get(step, 0) + calls

    def attended_per_step(self) -> list[float]:
        """Keys attended per decode step, per layer and sequence (mean over layers), in step order."""
        return [self.attended_tokens[s] / self.attention_calls[s] for s in sorted(self.attended_tokens)]

    @property
    def attended_tokens_mean(self) -> float:
        per_step = self.attended_per_step()
        return float(np.mean(per_step)) if per_step else float("nan")

    def add_fetch(self, link: str, nbytes: int) -> None:
        self.fetched_bytes[link] += nbytes

    def observe_occupancy(self, step: int, table) -> None:
        self.occupancy.append((step, {name: float(np.mean(per_layer)) for name, per_layer in table.occupancy().items()}))


def bytes_moved(cache) -> Counter:
    """Every byte a cache moved, per link: fetches for attention plus the scheduler's migrations."""
    return cache.stats.fetched_bytes + Counter(cache.transfer.bytes_moved)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so that host wall times cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def percentile(values, q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if len(values) else float("nan")
