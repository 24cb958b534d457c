"""EventQueue: the simulator's clock. Events pop in time order, simultaneous ones in the order they were pushed."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import KVTierError


@dataclass(order=True)
class Event:
    time: float  # seconds
    seq: int  # push order: breaks ties, so equal times pop first-in first-out
    kind: str = field(compare=False)
    payload: Any = field(compare=False, default=None)


class CausalityError(KVTierError):
    """An event was scheduled before the simulated present."""


class EventQueue:
    def __init__(self):
        self._heap: list[Event] = []
        self._seq = itertools.count()
        self.now = 0.0
        self.popped = 0

    def push(self, time: float, kind: str, payload: Any = None) -> Event:
        if time < self.now:
            raise CausalityError(f"event {kind!r} at {time:.9f}s is before now ({self.now:.9f}s)")
        event = Event(time, next(self._seq), kind, payload)
        heapq.heappush(self._heap, event)
        return event

    def pop(self) -> Event:
        event = heapq.heappop(self._heap)
        self.now = event.time
        self.popped += 1
        return event

    def __len__(self) -> int:
        return len(self._heap)
