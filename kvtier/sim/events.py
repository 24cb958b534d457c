"""EventQueue: the simulator's clock. Events pop in time order, simultaneous ones in the order they were pushed.
An event is a plain ``(time, seq, kind, payload)`` tuple on a heap (a million of them a run)."""

from __future__ import annotations

import heapq
from typing import Any

from kvtier.errors import KVTierError


class CausalityError(KVTierError):
    """An event was scheduled before the simulated present."""


class EventQueue:
    def __init__(self):
        self._heap: list[tuple] = []
        self._seq = 0
        self.now = 0.0
        self.popped = 0

    def push(self, time: float, kind: str, payload: Any = None) -> None:
        if time < self.now:
            raise CausalityError(f"event {kind!r} at {time:.9f}s is before now ({self.now:.9f}s)")
        self._seq += 1
        heapq.heappush(self._heap, (time, self._seq, kind, payload))

    def pop(self) -> tuple[str, Any]:
        """The next event's ``(kind, payload)``; the clock moves to its time."""
        self.now, _, kind, payload = heapq.heappop(self._heap)
        self.popped += 1
        return kind, payload

    def __len__(self) -> int:
        return len(self._heap)
