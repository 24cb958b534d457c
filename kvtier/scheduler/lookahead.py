"""LookaheadScheduler: the device tier holds the highest-priority pages, planned once per step.

Per layer: pinned pages (priority +inf, pinned in the table, or a sequence's newest page) stay; pages of priority
-inf leave; the remaining room (capacity - reserve) goes to the highest-priority pages among those resident and
those the policy admits. Demotions go to the fastest lower tier with room, cascading its lowest-priority pages down
when full; promotions go only into room the plan made; pages only a prefix cache holds rank below every
sequence's page. Without room below for every demotion the rest stay, unless the device cannot keep its reserve
(TierFullError). Dropped pages (:data:`~kvtier.table.DROPPED`) are never planned.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtier.errors import ConfigError, TierFullError
from kvtier.policies.base import PINNED, Policy
from kvtier.scheduler.base import MigrationPlan, Move, Ranking, Scheduler


CACHED = np.finfo(np.float64).min  # the priority of a page only the prefix cache holds: below every policy's


def cached_pages(table, live: np.ndarray) -> np.ndarray:
    """Pages held by no sequence, only by a prefix cache (a :class:`~kvtier.radix.RadixCache` reference)
    ``[m]``; ``live [n]``: every sequence's pages, each once."""
    if np.count_nonzero(table.ref) == live.size:
        return live[:0]
    held = table.ref > 0  # [pid capacity]
    held[live] = False
    return np.flatnonzero(held)


def row_groups(*arrays: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices l of the ``[L, ...]`` arrays grouped by their rows l (rows equal in every array share a group):
    ``group [L]``, each index's group (numbered as first seen), and ``first [u]``, each group's first index."""
    seen: dict = {}
    group = np.array([seen.setdefault(b"".join(a[i].tobytes() for a in arrays), len(seen))
                      for i in range(len(arrays[0]))])
    return group, np.unique(group, return_index=True)[1]


def order_ranks(rows: np.ndarray, flags: np.ndarray) -> np.ndarray:
    """Place ``[L, n]`` of each page in its layer's order: ``flags [L, n]`` ascending, then priority ``rows [1 or L,
    n]`` descending, ties to the earlier page. A stable sort by priority, then a stable (radix) sort of that order by
    the flags, every layer in one call; with one priority row, layers with the same flags (most) are ranked once."""
    L, n = flags.shape
    by_prio = np.argsort(-rows, axis=1, kind="stable")  # [1 or L, n]
    layer_of = None
    if rows.shape[0] == 1 and L > 1:
        layer_of, first = row_groups(flags)  # [L], [u]
        flags = flags[first]  # [u, n] the distinct flag rows
    by_prio = np.broadcast_to(by_prio, flags.shape)
    order = np.take_along_axis(by_prio, np.argsort(np.take_along_axis(flags, by_prio, 1), axis=1, kind="stable"), 1)
    rank = np.empty(flags.shape, dtype=np.int64)
    np.put_along_axis(rank, order, np.broadcast_to(np.arange(n), flags.shape), 1)
    return rank if layer_of is None else rank[layer_of]


def best_candidates(prio: np.ndarray, cand: np.ndarray, pinned: np.ndarray, limit: np.ndarray) -> np.ndarray:
    """``[u, n]``: per row the ``limit [u]`` first candidates ``cand [u, n]`` in :func:`order_ranks`' order (pinned
    candidates first, then priority ``prio [u, n]`` descending, ties to the earlier page), i.e. ``cand & (rank <
    limit)``, found by each row's k-th largest priority (a partition), not a stable sort (a sort of ``[30, 8k]``
    priorities is ~18 ms on the H200's host). Rows whose pinned candidates fill the room (rare) are cut one by one."""
    cut = cand.sum(1) > limit  # [u] rows with more candidates than room
    if not cut.any():
        return cand.copy()
    first = cand & pinned
    k = limit - first.sum(1)  # [u] room left after the pinned candidates
    split = cut & (k >= 0)  # [u] every pinned candidate and the best k others (priorities > -inf, < PINNED)
    best = _first_k_rows(np.where(cand & ~pinned, prio, -np.inf), np.where(split, k, 0)) | first  # whole rows:
    top = np.where(split[:, None], best, cand)  # no row gathers (a gather of [30, 8k] is slower than the rows)
    for g in np.flatnonzero(cut & (k < 0)):  # more pinned candidates than room: the best of them
        top[g] = _first_k(prio[g], first[g], int(limit[g]))
    return top


def _first_k(prio: np.ndarray, members: np.ndarray, k: int) -> np.ndarray:
    """``[n]``: the ``k`` of ``members [n]`` with the largest ``prio [n]``, ties to the earlier page."""
    return _first_k_rows(np.where(members, prio, -np.inf)[None], np.array([k]))[0]


def _first_k_rows(key: np.ndarray, k: np.ndarray) -> np.ndarray:
    """``[r, n]``: per row the ``k [r]`` pages of the largest ``key [r, n]`` (-inf: not a member; a row with ``k >
    0`` has more than ``k`` members), ties to the earlier page."""
    n = key.shape[1]
    at = np.clip(n - k, 0, n - 1)  # [r] where the k-th largest sits in ascending order
    if (at == at[0]).all():  # one k for every row (most): one partition along the rows
        kth = np.partition(key, at[0], axis=1)[:, at[0], None]  # [r, 1]
    else:  # a partition per row (faster than one along the rows at several k)
        kth = np.array([np.partition(row, i)[i] for row, i in zip(key, at.tolist())])[:, None]  # [r, 1]
    above, tied = key > kth, key == kth  # the k-th is a member's (> -inf): so are these
    short = k - above.sum(1)  # [r] ties to take
    over = np.flatnonzero(tied.sum(1) > short)
    if over.size:  # the earliest of the ties
        tied[over] &= np.cumsum(tied[over], 1) <= short[over, None]
    return (above | tied) & (k > 0)[:, None]


def _layer_pairs(mask: np.ndarray, layer_of: np.ndarray, layers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(layer [m], page [m])`` of every true ``mask [u, n]`` entry of each of ``layers`` (group ``layer_of[layer]``
    of ``mask``'s rows; only those rows are read), layer by layer in page order."""
    rows, local = np.unique(layer_of[layers], return_inverse=True)  # [r] the rows read; [k] each layer's
    g, at = np.nonzero(mask[rows])  # [e] row-major
    count = np.bincount(g, minlength=rows.size)  # [r]
    per = count[local]  # [k] entries each layer takes
    first = (np.cumsum(count) - count)[local]  # [k] where its row's entries start
    idx = np.repeat(first - np.cumsum(per) + per, per) + np.arange(per.sum())  # [m]
    return np.repeat(layers, per), at[idx]


@dataclass
class LookaheadScheduler(Scheduler):
    max_moves_per_step: int | None = None  # per layer; None = unbounded

    def __post_init__(self):
        if self.max_moves_per_step is not None and self.max_moves_per_step < 1:
            raise ConfigError("scheduler.placement.max_moves_per_step",
                              f"must be >= 1 or null, got {self.max_moves_per_step!r}")

    def plan(self, table, policy: Policy, step: int, reserve: int = 0, ranking: Ranking | None = None) -> MigrationPlan:
        """Every layer at once on ``[groups, n]`` arrays (n live pages; layers planned alike share a group); a loop
        only over layers that move."""
        plan = MigrationPlan(step)
        ranking = ranking or Ranking.of(table, policy, step)
        info, rows, admit = ranking.info, ranking.priority, ranking.admit  # rows, admit [1 or L, n]
        if info.pids.size == 0:
            return plan
        writing = info.logical == (info.seq_len - 1) // info.page_size  # each sequence's newest page
        pids, cached = info.pids, cached_pages(table, info.pids)  # [m]
        if cached.size:  # the prefix cache's pages: the first to leave the device, never promoted here
            pids = np.concatenate([pids, cached])
            rows = np.concatenate([rows, np.full((rows.shape[0], cached.size), CACHED)], 1)
            admit = np.concatenate([np.broadcast_to(admit, (admit.shape[0], info.pids.size)),
                                    np.zeros((admit.shape[0], cached.size), dtype=bool)], 1)
            writing = np.concatenate([writing, np.zeros(cached.size, dtype=bool)])
        L, n = table.layout.num_layers, pids.size
        device = table.tiers[0]
        free = device.num_free(np.arange(L))  # [L]
        # layers planned alike: with one priority row, layers whose places and device room are equal (most) are
        # planned once, as group g of layer_of [L] (first layer rep[g]); with per-layer priorities, each alone
        one_row = rows.shape[0] == 1 and admit.shape[0] == 1
        layer_of, rep = row_groups(table.tier_of, free[:, None]) if one_row else (np.arange(L), np.arange(L))
        u = rep.size
        prio = np.broadcast_to(rows, (u, n))  # [u, n]
        admit = np.broadcast_to(admit, (u, n))
        pinned = (prio == PINNED) | (table.pinned[pids] | writing)[None, :]  # [u, n]
        tier = table.tier_of[rep[:, None], pids[None, :]]  # [u, n]
        resident = tier == 0
        room = free[rep] + resident.sum(1) - reserve  # slots held elsewhere do not count
        keep = pinned & resident
        cand = (resident | admit | pinned) & (prio > -np.inf) & (tier >= 0)  # tier < 0: dropped
        limit = np.maximum(room, keep.sum(1))  # [u] candidates the device takes

        def ranks():  # [u, n] candidates, pinned, best first: computed only where promotions outnumber the room
            return order_ranks(rows, (2 * ~cand + ~pinned).astype(np.int8))

        rank = None
        want = best_candidates(prio, cand, pinned, limit) | keep
        demote = resident & ~want & ~pinned  # [u, n]
        promote = ~resident & want  # [u, n]
        down_n, up_n = demote.sum(1)[layer_of], promote.sum(1)[layer_of]  # [L]
        # most layers: their demotions fit the next tier down and their promotions the room: one move each way,
        # every such layer at once; the rest (a cascade, a cut, a move budget) one by one below
        lower = table.tiers[1].num_free(np.arange(L)) if len(table.tiers) > 1 else np.zeros(L, dtype=np.int64)
        whole = (down_n <= lower) & (up_n <= np.maximum(free + down_n - reserve, 0)) \
            & (self.max_moves_per_step is None)  # [L]
        for mask, count, dst, moves in ((demote, down_n, 1, plan.demote), (promote, up_n, 0, plan.promote)):
            layers, at = _layer_pairs(mask, layer_of, np.flatnonzero(whole & (count > 0)))
            if layers.size:
                moves.append(Move(layers, pids[at], dst))
        for layer in np.flatnonzero(~whole & (down_n + up_n > 0)):
            g = layer_of[layer]
            down = np.flatnonzero(demote[g])
            below = sum(t.num_free(int(layer)) for t in table.tiers[1:])  # room in the lower tiers
            if below < down.size and reserve - free[layer] <= below:  # a swap they cannot take now: the
                down = down[np.argsort(prio[g, down], kind="stable")][:below]  # worst pages go, the rest stay
            up = np.flatnonzero(promote[g])
            cap = min(max(free[layer] + down.size - reserve, 0), self.max_moves_per_step or up.size)
            if up.size > cap:  # the pinned, then the best, first
                rank = ranks() if rank is None else rank
                up = up[np.argsort(rank[g, up])][:cap]
            if self.max_moves_per_step is not None:
                down = down[np.argsort(prio[g, down], kind="stable")][:self.max_moves_per_step]
            plan.demote += self._demotions(table, int(layer), pids, prio[g], down)
            if up.size:
                plan.promote.append(Move(layer, pids[up], 0))
        return plan

    def _demotions(self, table, layer, pids, prio, demote) -> list[Move]:
        """Moves that push ``pids[demote]`` down one tier, cascading when a lower tier is full: its lowest-priority
        pages go a tier further, and where it holds too few of them, so do the lowest of the incoming pages."""
        moves = []
        incoming = demote
        for t in range(1, len(table.tiers)):
            if incoming.size == 0:
                break
            tier = table.tiers[t]
            overflow = incoming.size - tier.num_free(layer)
            moves_down = np.zeros(0, dtype=np.int64)
            if overflow > 0:
                if t == len(table.tiers) - 1:
                    raise TierFullError(f"layer {layer}: tier '{tier.name}' is full and is the lowest tier; "
                                        "raise its capacity")
                here = np.flatnonzero(table.tier_of[layer, pids] == t)
                moves_down = here[np.argsort(prio[here], kind="stable")][:overflow]
                passing = incoming[np.argsort(prio[incoming], kind="stable")][:overflow - moves_down.size]
                incoming, moves_down = np.setdiff1d(incoming, passing), np.concatenate([moves_down, passing])
            if incoming.size:
                moves.append(Move(layer, pids[incoming], t))
            incoming = moves_down
        # lower tiers first, so each move finds its room
        return moves[::-1]
