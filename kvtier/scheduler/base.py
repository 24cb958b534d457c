"""Scheduler: turns policy priorities and tier capacities into a MigrationPlan each step."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

from kvtier.policies.base import PageInfo, Policy


def page_info(table, step: int) -> PageInfo:
    """All live pages as policy candidates (a shared page appears once, under its first holder)."""
    seqs = list(table.seqs.values())
    if not seqs:
        empty = np.zeros(0, dtype=np.int64)
        return PageInfo(empty, empty, empty, table.layout.page_size, step)
    pids = np.concatenate([s.array() for s in seqs])  # [n] with repeats
    sizes = np.array([len(s.pids) for s in seqs])
    logical = np.arange(pids.size) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    seq_len = np.repeat(np.array([s.length for s in seqs], dtype=np.int64), sizes)
    if (table.ref[pids] == 1).all():  # no page shared: each listed once
        return PageInfo(pids, logical, seq_len, table.layout.page_size, step)
    first = np.sort(np.unique(pids, return_index=True)[1])  # first holder of each pid, in order
    return PageInfo(pids[first], logical[first], seq_len[first], table.layout.page_size, step)


@dataclass(frozen=True)
class Ranking:
    """What the policy says of every live page at one moment: the pages (``info``, n of them), their
    ``priority [1 or L, n]`` (float64, higher stays on the device) and ``admit [1 or L, n]`` (may a page off the
    device be promoted). Computed once per step plan; the placement plan and the scopes' device table read it."""

    info: PageInfo
    priority: np.ndarray
    admit: np.ndarray

    @classmethod
    def of(cls, table, policy: Policy, step: int) -> "Ranking":
        info = page_info(table, step)
        if info.pids.size == 0:
            return cls(info, np.zeros((1, 0)), np.zeros((1, 0), dtype=bool))
        priority, admit = policy.ranked(info)
        return cls(info, np.asarray(priority, dtype=np.float64), np.asarray(admit))


@dataclass
class Move:
    """Pages ``(layers[i], pids[i])`` to tier ``dst``; ``layers`` may be one layer for every pid."""

    layers: np.ndarray  # [n]
    pids: np.ndarray  # [n]
    dst: int  # tier index

    def __post_init__(self):
        self.pids = np.asarray(self.pids, dtype=np.int64).reshape(-1)
        self.layers = np.broadcast_to(np.asarray(self.layers, dtype=np.int64), self.pids.shape)


def pairs(moves: list[Move]) -> tuple[np.ndarray, np.ndarray]:
    """``(layers [n], pids [n])``: the pages of ``moves``, in order."""
    if not moves:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate([m.layers for m in moves]), np.concatenate([m.pids for m in moves])


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
    """Plans page placement: the moves of a step, which the engine's planner (:mod:`kvtier.engine.plan`) issues."""

    @abstractmethod
    def plan(self, table, policy, step: int, reserve: int = 0, ranking: Ranking | None = None) -> MigrationPlan:
        """Plan for ``step``, keeping ``reserve`` free device slots per layer for new pages; ``ranking``: the
        policy's :class:`Ranking` at this step when the caller has it (else the plan asks the policy)."""
