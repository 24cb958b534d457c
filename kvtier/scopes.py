"""Attention scopes of the hook path: which pages each sequence attends in a step, chosen on the host.

A scope sees the cache's table and the step's page range (never a page left of a sliding window:
``first``; pages from ``tail_from`` on are always attended) and returns, per sequence, the sorted
logical page numbers to attend (``choose``). Under a token budget (:mod:`kvtier.budget`) the cache
attends the sink and window spans itself and asks the scope for the whole pages in between
(``middle``). Key statistics (Quest's bounds) live in the cache's
:class:`~kvtier.page_stats.KeyStats`. The fast path's device-side scopes are :mod:`kvtier.fast.scopes`.

- :class:`AllScope`: every page (exact).
- :class:`ResidentScope`: the pages in the device tier (under a budget: the best of them by the
  policy's priority).
- :class:`TopKScope`: Quest (Tang et al., 2024, arXiv:2406.10774): the ``topk_pages`` pages with
  the largest upper bound of q·k from per-page key min/max, sinks and the tail included; under a
  token budget with ``per_head``, each kv head its own best pages (as Quest chooses per head).
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.errors import ConfigError

SCOPES = ("all", "resident", "topk")


class Scope:
    """Chooses the pages of a step; ``choose`` must return each sequence's pages in ``[first, n)``."""

    name = "scope"

    def choose(self, table, seqs, layer: int, query: torch.Tensor, first: int, tail_from: int,
               q_len: int) -> list[np.ndarray]:
        raise NotImplementedError

    def middle(self, table, seq, b: int, layer: int, query: torch.Tensor, candidates: np.ndarray, k: int,
               rank_fn) -> tuple[np.ndarray, np.ndarray | None]:
        """Under a token budget: ``(pages, head_mask)``, at most ``k`` of ``candidates`` (sorted logical
        pages of sequence ``seq``, row ``b``) to attend whole, and None (every kv head sees them) or,
        for a per-head choice, the union of the heads' ``k`` pages with ``head_mask [len(pages), N_kv]``
        bool. ``rank_fn(layer, pids) -> [m]`` is the policy's priority."""
        raise NotImplementedError


def every_page(table, seqs, first: int) -> list[np.ndarray]:
    return [np.arange(first, table.num_pages(seq)) for seq in seqs]


class AllScope(Scope):
    name = "all"

    def choose(self, table, seqs, layer, query, first, tail_from, q_len):
        return every_page(table, seqs, first)

    def middle(self, table, seq, b, layer, query, candidates, k, rank_fn):
        return candidates, None


class ResidentScope(Scope):
    name = "resident"

    def choose(self, table, seqs, layer, query, first, tail_from, q_len):
        chosen = []
        for seq in seqs:
            on_dev = table.tier_of[layer, table.pages(seq)] == 0
            on_dev[tail_from:] = True  # the tokens being written are always attended
            chosen.append(np.flatnonzero(on_dev[first:]) + first)
        return chosen

    def middle(self, table, seq, b, layer, query, candidates, k, rank_fn):
        pids = table.pages(seq)[candidates]
        on_dev = candidates[table.tier_of[layer, pids] == 0]
        if k == 0 or k >= on_dev.size:
            return on_dev[:k], None
        prio = rank_fn(layer, table.pages(seq)[on_dev])  # [m]
        return np.sort(on_dev[np.argsort(-prio, kind="stable")[:k]]), None


class TopKScope(Scope):
    """Quest page selection at decode steps (prefill attends every page), from the key bounds of the
    cache's :class:`~kvtier.page_stats.KeyStats`.

    ``rank``: ``quest`` (the bound, max over query heads, as in the paper) or ``quest_head``
    (each query head's bounds turned into a softmax over the candidate pages, max over heads: a page
    that one head needs ranks high even when that head's logits are small). ``per_head`` (token
    budgets): each kv head attends its own ``k`` best pages by its group's score, the step attending
    their union with a per-head mask (each head still sees ``k`` pages: the budget holds per head).
    ``query_rows`` (token budgets): a page's bound is the max over the layer's last ``query_rows``
    decode queries of the sequence (the current one included), so pages that a question fed just
    before keeps needing stay chosen. ``policy_share`` (token budgets): that share of the ``k`` pages
    goes to the policy's best pages (its scorer: salience, accumulated attention, ...), the rest to
    the best Quest bounds among the others.
    """

    name = "topk"
    RANKS = ("quest", "quest_head")

    def __init__(self, layout, topk_pages: int | None, sinks: int, keys, rank: str = "quest",
                 per_head: bool = False, query_rows: int = 1, policy_share: float = 0.0):
        if topk_pages is not None and (not isinstance(topk_pages, int) or isinstance(topk_pages, bool)
                                       or topk_pages < 1):
            raise ConfigError("topk_pages", f"scope 'topk' needs topk_pages >= 1, got {topk_pages!r}")
        if rank not in self.RANKS:
            raise ConfigError("cache.rank", f"unknown rank {rank!r}; use one of {list(self.RANKS)}")
        self.layout, self.topk_pages, self.sinks, self.keys, self.rank = layout, topk_pages, sinks, keys, rank
        if not isinstance(query_rows, int) or isinstance(query_rows, bool) or query_rows < 1:
            raise ConfigError("cache.query_rows", f"must be an integer >= 1, got {query_rows!r}")
        if not 0.0 <= policy_share <= 1.0:
            raise ConfigError("cache.policy_share", f"must be in [0, 1], got {policy_share!r}")
        self.per_head, self.query_rows, self.policy_share = per_head, query_rows, policy_share
        self.recent: dict[tuple[int, int], torch.Tensor] = {}  # (layer, row b) -> last queries [r, H, D]

    def choose(self, table, seqs, layer, query, first, tail_from, q_len):
        if q_len > 1:
            return every_page(table, seqs, first)
        if self.topk_pages is None:
            raise ConfigError("topk_pages", "scope 'topk' needs topk_pages (or a token budget)")
        P = self.layout.page_size
        chosen = []
        for b, seq in enumerate(seqs):
            pids = table.pages(seq)
            forced = np.zeros(pids.size, dtype=bool)
            forced[tail_from:] = True
            forced[: -(-self.sinks // P)] = True
            forced[:first] = False
            free = np.flatnonzero(~forced[first:]) + first
            k = min(self.topk_pages - int(forced.sum()), free.size)
            if k > 0:
                forced[free[self.best(layer, query[b, :, -1][None], pids[free], k)]] = True
            chosen.append(np.flatnonzero(forced))
        return chosen

    def middle(self, table, seq, b, layer, query, candidates: np.ndarray, k: int, rank_fn):
        """The ``k`` best of a sequence's ``candidates`` (logical pages) for ``query [B, H, 1, D]``
        (per kv head with ``per_head``: their union and the mask)."""
        q = self.remember(layer, b, query[b, :, -1])  # [r, H, D]
        if k >= candidates.size or k == 0:
            return candidates[:k], None
        pids = table.pages(seq)[candidates]
        k_policy = int(round(self.policy_share * k))
        if k_policy:  # the policy's best pages, then Quest's best of the rest
            by_policy = np.argsort(-rank_fn(layer, pids), kind="stable")[:k_policy]
            rest = np.delete(np.arange(candidates.size), by_policy)
            kept = np.concatenate([by_policy, rest[self.best(layer, q, pids[rest], k - k_policy)]])
            return np.sort(candidates[kept]), None
        if not self.per_head:
            return np.sort(candidates[self.best(layer, q, pids, k)]), None
        scores = self.scores(layer, q, pids, per_kv_head=True)  # [m, N_kv]
        picked = torch.zeros(scores.shape, dtype=torch.bool)
        picked.scatter_(0, torch.topk(scores, k, dim=0).indices.cpu(), True)  # [m, N_kv]: k per head
        mask = picked.numpy()
        union = mask.any(axis=1)
        return candidates[union], mask[union]

    def remember(self, layer: int, b: int, q: torch.Tensor) -> torch.Tensor:
        """Add the decode query ``q [H, D]`` of row ``b``; its last ``query_rows`` queries ``[r, H, D]``."""
        if self.query_rows == 1:
            return q[None]
        prev = self.recent.get((layer, b))
        rows = q[None] if prev is None else torch.cat([prev, q[None]])[-self.query_rows:]
        self.recent[layer, b] = rows
        return rows

    def best(self, layer: int, q: torch.Tensor, pids: np.ndarray, k: int) -> np.ndarray:
        """Indices of the ``k`` best of ``pids`` for the queries ``q [r, H, D]``."""
        return torch.topk(self.scores(layer, q, pids), k).indices.cpu().numpy()

    def scores(self, layer: int, q: torch.Tensor, pids: np.ndarray, per_kv_head: bool = False) -> torch.Tensor:
        """Page scores for the queries ``q [r, H, D]`` (see ``rank``; max over the rows): ``[m]``, max
        over query heads, or with ``per_kv_head`` ``[m, N_kv]``, max over each kv head's group."""
        ub = torch.stack([self.keys.quest_bound(layer, row, pids) for row in q]).amax(0)  # [m, H]
        if self.rank == "quest_head":
            ub = torch.softmax(ub * q.shape[-1] ** -0.5, dim=0)
        if per_kv_head:
            return ub.view(ub.shape[0], self.layout.num_kv_heads, -1).amax(dim=2)
        return ub.amax(dim=1)


def make_scope(name: str, layout, topk_pages: int | None, sinks: int, keys=None, rank: str = "quest",
               per_head: bool = False, query_rows: int = 1, policy_share: float = 0.0) -> Scope:
    """The scope called ``name`` (one of :data:`SCOPES`); ``topk`` reads ``keys`` (KeyStats)."""
    if name == "all":
        return AllScope()
    if name == "resident":
        return ResidentScope()
    if name == "topk":
        return TopKScope(layout, topk_pages, sinks, keys, rank, per_head, query_rows, policy_share)
    raise ConfigError("scope", f"unknown scope {name!r}; use one of {list(SCOPES)}")
