"""LookaheadScheduler: the device tier holds the highest-priority pages, planned once per step.

Per layer: pinned pages (priority +inf, pinned in the BlockTable, or a sequence's newest page,
which the next token writes) always stay; pages with
priority -inf leave the device; the remaining device room (capacity - reserve) goes to the
highest-priority pages among those resident and those the policy admits. Demotions go to the
fastest lower tier with room, pushing that tier's lowest-priority pages further down when full
(a cascade); promotions are only planned into room the plan has made. A plan is issued at once;
how far ahead of its use a page is asked for is the caller's (``FastEngine(lookahead=k)`` feeds
the pages step t attended to the policy before step t + k). Dropped pages (left of a sliding
window, :data:`~kvtier.table.DROPPED`) are never planned.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtier.errors import ConfigError, TierFullError
from kvtier.policies.base import PINNED, PageInfo, Policy
from kvtier.scheduler.base import MigrationPlan, Move, Scheduler


def page_info(table, step: int) -> PageInfo:
    """All live pages as policy candidates (a shared page appears once, under its first holder)."""
    seqs = list(table.seqs.values())
    if not seqs:
        empty = np.zeros(0, dtype=np.int64)
        return PageInfo(empty, empty, empty, table.layout.page_size, step)
    pids = np.concatenate([np.asarray(s.pids, dtype=np.int64) for s in seqs])  # [n] with repeats
    logical = np.concatenate([np.arange(len(s.pids)) for s in seqs])
    seq_len = np.concatenate([np.full(len(s.pids), s.length, dtype=np.int64) for s in seqs])
    first = np.sort(np.unique(pids, return_index=True)[1])  # first holder of each pid, in order
    return PageInfo(pids[first], logical[first], seq_len[first], table.layout.page_size, step)


@dataclass
class LookaheadScheduler(Scheduler):
    max_moves_per_step: int | None = None  # per layer; None = unbounded

    def __post_init__(self):
        if self.max_moves_per_step is not None and self.max_moves_per_step < 1:
            raise ConfigError("scheduler.max_moves_per_step", f"must be >= 1 or null, got {self.max_moves_per_step!r}")

    def plan(self, table, policy: Policy, step: int, reserve: int = 0) -> MigrationPlan:
        plan = MigrationPlan(step)
        info = page_info(table, step)
        if info.pids.size == 0:
            return plan
        L = table.layout.num_layers
        prio = np.broadcast_to(policy.priority(info), (L, info.pids.size)).astype(np.float64)
        admit = np.broadcast_to(policy.admit(info), (L, info.pids.size))
        writing = info.logical == (info.seq_len - 1) // info.page_size  # each sequence's newest page
        pinned = (prio == PINNED) | (table.pinned[info.pids] | writing)[None, :]
        device = table.tiers[0]
        for layer in range(L):
            tier = table.tier_of[layer, info.pids]  # [n]
            resident = tier == 0
            room = device.num_free(layer) + int(resident.sum()) - reserve  # slots held elsewhere do not count
            keep = pinned[layer] & resident
            live = tier >= 0  # not dropped
            cand = np.flatnonzero((resident | admit[layer] | pinned[layer]) & (prio[layer] > -np.inf) & live)
            order = cand[np.lexsort((-prio[layer, cand], ~pinned[layer, cand]))]  # pinned, then best first
            want = np.zeros(info.pids.size, dtype=bool)
            want[order[:max(room, int(keep.sum()))]] = True
            want |= keep
            demote = np.flatnonzero(resident & ~want & ~pinned[layer])
            promote = np.flatnonzero(~resident & want)
            promote = promote[np.lexsort((-prio[layer, promote], ~pinned[layer, promote]))]  # pinned first
            free_after = device.num_free(layer) + demote.size - reserve
            promote = promote[:max(free_after, 0)]
            if self.max_moves_per_step is not None:
                demote = demote[np.argsort(prio[layer, demote], kind="stable")][:self.max_moves_per_step]
                promote = promote[:self.max_moves_per_step]
            plan.demote += self._demotions(table, layer, info.pids, prio[layer], demote)
            if promote.size:
                plan.promote.append(Move(layer, info.pids[promote], 0))
        return plan

    def _demotions(self, table, layer, pids, prio, demote) -> list[Move]:
        """Moves that push ``pids[demote]`` down one tier, cascading when a lower tier is full."""
        moves = []
        incoming = demote
        for t in range(1, len(table.tiers)):
            if incoming.size == 0:
                break
            tier = table.tiers[t]
            free = tier.num_free(layer)
            overflow = incoming.size - free
            if overflow > 0:
                if t == len(table.tiers) - 1:
                    raise TierFullError(f"layer {layer}: tier '{tier.name}' is full and is the lowest tier; "
                                        "raise its capacity")
                here = np.flatnonzero(table.tier_of[layer, pids] == t)
                victims = here[np.argsort(prio[here], kind="stable")][:overflow]
                moves_down = victims
            else:
                moves_down = np.zeros(0, dtype=np.int64)
            moves.append(Move(layer, pids[incoming], t))
            incoming = moves_down
        # lower tiers first, so each move finds its room
        return moves[::-1]
