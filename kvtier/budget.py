"""Token budgets: how many keys a decode step attends per (layer, sequence), counted in tokens.

A budget of ``tokens`` keys is spent as StreamingLLM and Quest spend it: the first ``sinks`` tokens (truncated
pages), ``middle_pages`` whole pages chosen by the scope, and the most recent ``window_tokens`` (at least
``window``: the page rounding's leftover goes to the window). A sequence of at most ``tokens`` tokens is attended
whole. With ``once`` the window's start is fixed when the prefill ends (the pages not kept are dropped). One object
on every door: the ``budget=`` of :class:`~kvtier.engine.Engine`, :class:`~kvtier.cache.TieredKVCache` and
``kvtier.cache_for`` / ``offload``; its page size is the layout's (:func:`token_budget`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from kvtier.errors import ConfigError

MODES = ("continuous", "once")


def check_mode(mode: str) -> None:
    """``mode`` is one of :data:`MODES`."""
    if mode not in MODES:
        raise ConfigError("cache.mode", f"unknown mode {mode!r}; use one of {list(MODES)}")


@dataclass
class TokenBudget:
    """``tokens`` keys each decode step attends per (layer, sequence): ``sinks`` first tokens, the scope's middle
    pages, at least the ``window`` newest; ``mode`` ``continuous`` (each step chooses) or ``once`` (compressed when
    the prompt is in). ``page_size`` None: the layout's, filled in by the engine."""

    tokens: int
    sinks: int = 4
    window: int = 64
    page_size: int | None = None
    mode: str = "continuous"

    def __post_init__(self):
        for name in ("tokens", "sinks", "window"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError("budget" if name == "tokens" else f"cache.{name}",
                                  f"must be an integer >= 0, got {v!r}")
        if self.window < 1:
            raise ConfigError("cache.window", "a token budget attends at least the newest token: window >= 1")
        if self.sinks + self.window > self.tokens:
            raise ConfigError("budget", f"{self.tokens} tokens cannot hold sinks ({self.sinks}) + window "
                                              f"({self.window})")
        check_mode(self.mode)

    def paged(self, page_size: int) -> "TokenBudget":
        """This budget over pages of ``page_size`` tokens (the layout's): one made without a page size takes it."""
        if self.page_size is None:
            return dataclasses.replace(self, page_size=page_size)
        if self.page_size != page_size:
            raise ConfigError("budget", f"was made for pages of {self.page_size} tokens, the layout's hold {page_size}: "
                                        "leave its page_size out (it takes the layout's)")
        return self

    @property
    def middle_pages(self) -> int:
        return (self.tokens - self.sinks - self.window) // self.page_size

    @property
    def window_tokens(self) -> int:
        return self.tokens - self.sinks - self.middle_pages * self.page_size

    @property
    def step_pages(self) -> int:
        """Device pages a continuous ``resident`` step needs to attend the whole budget: the sink pages,
        the middle pages, the window's pages (one more where it straddles) and the next token's page."""
        P = self.page_size
        return -(-self.sinks // P) + self.middle_pages + -(-self.window_tokens // P) + 2

    def view(self, n: int, win_start: int | None = None) -> "BudgetView | None":
        """The spans of a sequence of ``n`` tokens (None when it fits whole); ``win_start`` fixes the window."""
        if n <= self.tokens and win_start is None:
            return None
        P = self.page_size
        start = n - self.window_tokens if win_start is None else win_start
        return BudgetView(self.sinks, start, -(-self.sinks // P), start // P)


def token_budget(budget, page_size: int) -> TokenBudget | None:
    """``budget=`` of every door: None (the scope's own choice) or a :class:`TokenBudget`, over pages of
    ``page_size`` tokens; anything else is refused by name (a plain number: which TokenBudget to write)."""
    if budget is None:
        return None
    if not isinstance(budget, TokenBudget):
        number = isinstance(budget, int) and not isinstance(budget, bool)
        raise ConfigError("budget", "is the keys each decode step attends, a kvtier.TokenBudget(tokens, sinks=4, "
                                    f"window=64, mode='continuous'), got {type(budget).__name__} {budget!r}"
                                    + (f": pass budget=kvtier.TokenBudget({budget})" if number else ""))
    return budget.paged(page_size)


@dataclass
class BudgetView:
    """One step's spans: tokens ``[0, sinks)`` and ``[win_start, n)`` are attended; the middle
    candidates are the logical pages ``[cand_lo, cand_hi)``."""

    sinks: int
    win_start: int
    cand_lo: int
    cand_hi: int

    @property
    def tail_from(self) -> int:
        return self.cand_hi

    def candidates(self, live: np.ndarray) -> np.ndarray:
        """Middle candidates among a sequence's pages, ``live [n_pages]`` bool (not dropped): logical ``[m]``."""
        idx = np.arange(self.cand_lo, min(self.cand_hi, live.size))
        return idx[live[idx]]
