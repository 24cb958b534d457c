"""The scopes that need no key statistics: ``all`` (exact) and ``resident`` (the device pages). Neither reads
the query: each plans the page lists of every layer once per step (:meth:`~kvtier.scopes.base.Scope.plan`)."""

from __future__ import annotations

import torch

from kvtier.budget import TokenBudget
from kvtier.scopes.base import Scope, StepView, best_of, budget_pick, compact, live_mask, window_pages


def live_pages(layers: int | range, view: StepView) -> torch.Tensor:
    """Every page of each row that is not dropped, compacted ``[(L',) B, M]``."""
    table, lens, _ = view.rows(layers)
    return compact(live_mask(table, lens, view.page_size))


class All(Scope):
    """Every page (exact attention); under a token budget (``mode=once``, or a continuous budget with
    ``scope=all`` refused by the engine) the budget's spans."""

    name = "all"
    query_free = True

    def width(self, budget, once, max_pages):
        return max_pages if budget is not None else None

    def plan(self, layers, view):
        if view.budget is None or layers[0] < view.dense_layers:
            return live_pages(layers, view) if self.engine.planner.dropped_any else None
        return budget_pick(layers, view, None, device_only=False)


class Resident(Scope):
    """The pages in the device tier (and the page being written); under a token budget, the middle pages
    are the device pages the policy ranks best (its priority, ``view.policy_scores``), as eviction libraries do."""

    name = "resident"
    device_only = True
    query_free = True

    def needs_rank(self, budget: TokenBudget | None) -> bool:
        return budget is not None and budget.mode == "continuous"  # once: every kept page is listed

    def width(self, budget, once, max_pages):
        return max_pages if budget is None else super().width(budget, once, max_pages)

    def plan(self, layers, view):
        table, lens, n_pages = view.rows(layers)  # [L', B, M]
        if layers[0] < view.dense_layers:
            return live_pages(layers, view)
        if view.budget is None:  # device pages, and from the tail on (the page being written; a window's cut page)
            logical = torch.arange(table.shape[-1], device=table.device)
            first, tail_from = window_pages(lens.clamp(min=1), view.window(layers), view.page_size)
            keep = (table >= 0) | (logical >= tail_from[:, None])
            return compact(keep & (logical >= first[:, None]) & (logical < n_pages[:, None]))
        # the policy's scores [L', B, M]: continuous budgets only (once lists every kept page)
        return budget_pick(layers, view, lambda cand, k: best_of(view.policy_scores(layers), cand, k),
                           device_only=True)
