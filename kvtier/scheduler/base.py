"""Scheduler: turns policy priorities and tier capacities into a MigrationPlan each step."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Move:
    layer: int
    pids: np.ndarray  # [n]
    dst: int  # tier index


@dataclass
class MigrationPlan:
    """Demotions first (they make room), then promotions. ``step`` is when it was made."""

    step: int
    demote: list[Move] = field(default_factory=list)
    promote: list[Move] = field(default_factory=list)

    @property
    def moves(self) -> list[Move]:
        return self.demote + self.promote

    def num_pages(self) -> int:
        return sum(m.pids.size for m in self.moves)


class Scheduler(ABC):
    """Plans page placement; ``execute`` hands a plan to the TransferEngine."""

    @abstractmethod
    def plan(self, table, policy, step: int, reserve: int = 0) -> MigrationPlan:
        """Plan for ``step``, keeping ``reserve`` free device slots per layer for new pages."""

    def execute(self, plan: MigrationPlan, transfer) -> None:
        for move in plan.moves:
            transfer.migrate(move.layer, move.pids, move.dst)
