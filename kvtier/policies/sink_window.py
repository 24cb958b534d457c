"""SinkWindow (StreamingLLM): attention sinks and the recent window are pinned."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kvtier.policies.base import PINNED, PageInfo, Policy, check_counts, sink_window_pages


@dataclass
class SinkWindow(Policy):
    """Pins pages holding the first ``sinks`` tokens and the last ``window`` tokens.

    Other pages rank by position (later is higher), so spare room holds a longer window.
    """

    sinks: int = 4
    window: int = 256
    name: ClassVar[str] = "sink_window"

    def __post_init__(self):
        check_counts(self, "sinks", "window")

    def pinned_pages(self, page_size: int) -> int:
        return sink_window_pages(self.sinks, self.window, page_size)

    def priority(self, info: PageInfo) -> np.ndarray:
        prio = info.logical.astype(np.float64)  # [n]
        pinned = info.in_sinks(self.sinks) | info.in_window(self.window)
        return np.where(pinned, PINNED, prio)[None, :]  # [1, n]
