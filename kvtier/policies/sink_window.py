"""SinkWindow (StreamingLLM): attention sinks and the recent window are pinned."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtier.policies.base import PINNED, PageInfo, Policy, check_counts


@dataclass
class SinkWindow(Policy):
    """Pins pages holding the first ``sinks`` tokens and the last ``window`` tokens.

    Other pages rank by position (later is higher), so spare room holds a longer window.
    """

    sinks: int = 4
    window: int = 256
    name: str = "sink_window"

    def __post_init__(self):
        check_counts(self, "sinks", "window")

    def priority(self, info: PageInfo) -> np.ndarray:
        prio = info.logical.astype(np.float64)  # [n]
        pinned = info.in_sinks(self.sinks) | info.in_window(self.window)
        return np.where(pinned, PINNED, prio)[None, :]  # [1, n]
