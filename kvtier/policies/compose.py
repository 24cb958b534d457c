"""Compose: pins from some policies, ranking (and admission) from another."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from kvtier.errors import ConfigError
from kvtier.policies.base import PINNED, PageInfo, Policy


@dataclass
class Compose(Policy):
    """A page pinned (+inf) by any of ``pins`` is pinned; every other page takes ``rank``'s priority."""

    rank: Policy = None
    pins: list[Policy] = field(default_factory=list)
    name: ClassVar[str] = "compose"

    def __post_init__(self):
        if self.rank is None:
            raise ConfigError("policy.rank", "Compose needs a ranking policy")

    @property
    def parts(self) -> list[Policy]:
        return [self.rank, *self.pins]

    def pinned_pages(self, page_size: int) -> int:
        return sum(p.pinned_pages(page_size) for p in self.parts)  # the union's bound

    @property
    def needs_salience(self) -> bool:
        return any(p.needs_salience for p in self.parts)

    @property
    def needs(self) -> frozenset:
        return frozenset().union(*(p.needs for p in self.parts))

    @property
    def attention_rows(self) -> int | None:
        rows = [p.attention_rows for p in self.parts]
        return None if None in rows else max(rows)

    def requests(self) -> list:
        return [r for p in self.parts for r in p.requests()]

    def attach(self, stats: list) -> None:
        for p in self.parts:  # each part its own requests' statistics, in order
            n = len(p.requests())
            p.attach(stats[:n])
            stats = stats[n:]

    def reset(self, num_layers):
        super().reset(num_layers)
        for p in self.parts:
            p.reset(num_layers)

    def on_step(self, step):
        for p in self.parts:
            p.on_step(step)

    def on_append(self, pids, step):
        for p in self.parts:
            p.on_append(pids, step)

    def on_access(self, layer, pids, step):
        for p in self.parts:
            p.on_access(layer, pids, step)

    @property
    def hears_access(self) -> bool:
        return any(p.hears_access for p in self.parts)

    @property
    def hears_step(self) -> bool:
        return any(p.hears_step for p in self.parts)

    def on_salience(self, layer, pids, scores, step):
        for p in self.parts:
            p.on_salience(layer, pids, scores, step)

    def ranked(self, info: PageInfo) -> tuple[np.ndarray, np.ndarray]:
        prio, admit = self.rank.ranked(info)
        for p in self.pins:
            prio = np.where(p.priority(info) == PINNED, PINNED, prio)
        return prio, admit

    def priority(self, info: PageInfo) -> np.ndarray:
        return self.ranked(info)[0]

    def admit(self, info: PageInfo) -> np.ndarray:
        return self.rank.admit(info)
