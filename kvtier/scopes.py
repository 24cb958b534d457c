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
  the largest upper bound of q·k from per-page key min/max, sinks and the tail included.
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
               rank_fn) -> np.ndarray:
        """Under a token budget: at most ``k`` of ``candidates`` (sorted logical pages of sequence
        ``seq``, row ``b``) to attend whole. ``rank_fn(layer, pids) -> [m]`` is the policy's priority."""
        raise NotImplementedError


def every_page(table, seqs, first: int) -> list[np.ndarray]:
    return [np.arange(first, table.num_pages(seq)) for seq in seqs]


class AllScope(Scope):
    name = "all"

    def choose(self, table, seqs, layer, query, first, tail_from, q_len):
        return every_page(table, seqs, first)

    def middle(self, table, seq, b, layer, query, candidates, k, rank_fn):
        return candidates


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
        if k == 0:
            return on_dev[:0]
        if k >= on_dev.size:
            return on_dev
        prio = rank_fn(layer, table.pages(seq)[on_dev])  # [m]
        return np.sort(on_dev[np.argsort(-prio, kind="stable")[:k]])


class TopKScope(Scope):
    """Quest page selection at decode steps (prefill attends every page), from the key bounds of the
    cache's :class:`~kvtier.page_stats.KeyStats`.

    ``rank``: ``quest`` (the bound, max over query heads, as in the paper) or ``quest_head``
    (each query head's bounds turned into a softmax over the candidate pages, max over heads: a page
    that one head needs ranks high even when that head's logits are small).
    """

    name = "topk"
    RANKS = ("quest", "quest_head")

    def __init__(self, layout, topk_pages: int | None, sinks: int, keys, rank: str = "quest"):
        if topk_pages is not None and (not isinstance(topk_pages, int) or isinstance(topk_pages, bool)
                                       or topk_pages < 1):
            raise ConfigError("topk_pages", f"scope 'topk' needs topk_pages >= 1, got {topk_pages!r}")
        if rank not in self.RANKS:
            raise ConfigError("cache.rank", f"unknown rank {rank!r}; use one of {list(self.RANKS)}")
        self.layout, self.topk_pages, self.sinks, self.keys, self.rank = layout, topk_pages, sinks, keys, rank

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
                forced[free[self.best(layer, query[b], pids[free], k)]] = True
            chosen.append(np.flatnonzero(forced))
        return chosen

    def middle(self, table, seq, b, layer, query, candidates: np.ndarray, k: int, rank_fn) -> np.ndarray:
        """The ``k`` best of a sequence's ``candidates`` (logical pages) for ``query [B, H, 1, D]``."""
        if k >= candidates.size or k == 0:
            return candidates[:k]
        return np.sort(candidates[self.best(layer, query[b], table.pages(seq)[candidates], k)])

    def best(self, layer: int, q: torch.Tensor, pids: np.ndarray, k: int) -> np.ndarray:
        """Indices of the ``k`` best of ``pids`` for the query ``q [H, 1, D]``."""
        return torch.topk(self.scores(layer, q, pids), k).indices.cpu().numpy()

    def scores(self, layer: int, q: torch.Tensor, pids: np.ndarray) -> torch.Tensor:
        """Page scores ``[m]`` for the query ``q [H, 1, D]`` (see ``rank``)."""
        ub = self.keys.quest_bound(layer, q[:, -1], pids)  # [m, H]
        if self.rank == "quest_head":
            ub = torch.softmax(ub * q.shape[-1] ** -0.5, dim=0)
        return ub.amax(dim=1)


def make_scope(name: str, layout, topk_pages: int | None, sinks: int, keys=None, rank: str = "quest") -> Scope:
    """The scope called ``name`` (one of :data:`SCOPES`); ``topk`` reads ``keys`` (KeyStats)."""
    if name == "all":
        return AllScope()
    if name == "resident":
        return ResidentScope()
    if name == "topk":
        return TopKScope(layout, topk_pages, sinks, keys, rank)
    raise ConfigError("scope", f"unknown scope {name!r}; use one of {list(SCOPES)}")
