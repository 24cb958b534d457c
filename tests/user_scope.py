"""A user's own attention scope, imported by name from a recipe (``scope._target_=user_scope.Recent``):
nothing in kvtier names it."""

import torch

from kvtier.errors import ConfigError
from kvtier.scopes import DROPPED, Scope


class Recent(Scope):
    """Each decode step attends the newest ``pages`` pages of its row (the page being written among them)."""

    name = "recent"

    def __init__(self, pages: int = 2):
        if not isinstance(pages, int) or isinstance(pages, bool) or pages < 1:
            raise ConfigError("scope.pages", f"must be an integer >= 1, got {pages!r}")
        self.pages = pages

    def width(self, budget, once, max_pages):
        return min(self.pages, max_pages)

    def pick(self, layer, q, view):
        table, _, n_pages = view.rows(layer)
        K = min(self.pages, table.shape[1])
        pages = (n_pages - K).clamp(min=0)[:, None] + torch.arange(K, device=table.device)[None, :]  # [B, K]
        live = (pages < n_pages[:, None]) & (table.gather(1, pages.clamp(max=table.shape[1] - 1)) != DROPPED)
        return torch.where(live, pages, -1).to(torch.int32)
