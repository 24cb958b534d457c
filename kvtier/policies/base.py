"""Policy: decides which pages deserve the fast tier.

A policy hears lifecycle events (pages appended, pages attended, salience observed) and answers
one query, :meth:`Policy.priority`: a score per (layer, page), higher stays in the faster tier.
``+inf`` pins a page; ``-inf`` asks for its demotion even when there is room.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from kvtier.errors import ConfigError

PINNED = np.inf
EVICT = -np.inf


@dataclass
class PageInfo:
    """The candidate pages of one query: one row per (sequence, logical page)."""

    pids: np.ndarray  # [n] page ids
    logical: np.ndarray  # [n] logical page number within its sequence
    seq_len: np.ndarray  # [n] tokens of the owning sequence
    page_size: int
    step: int

    @property
    def first_token(self) -> np.ndarray:
        return self.logical * self.page_size  # [n]

    def in_sinks(self, sinks: int) -> np.ndarray:
        """Pages holding any of the first ``sinks`` tokens ``[n]``."""
        return self.first_token < sinks

    def in_window(self, window: int) -> np.ndarray:
        """Pages holding any of the last ``window`` tokens, and always the page being written ``[n]``."""
        last_page = (self.seq_len - 1) // self.page_size
        return ((self.first_token + self.page_size) > (self.seq_len - window)) | (self.logical == last_page)


def check_counts(policy, *fields: str) -> None:
    """ConfigError naming ``policy.<field>`` unless each field is an integer >= 0 (sinks, window, ...)."""
    for name in fields:
        v = getattr(policy, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ConfigError(f"policy.{name}", f"must be an integer >= 0, got {v!r}")


def sink_window_pages(sinks: int, window: int, page_size: int) -> int:
    """Most pages of one sequence that ``sinks`` leading and ``window`` trailing tokens touch."""
    return -(-sinks // page_size) + -(-window // page_size)


class Policy(ABC):
    """Base class of placement policies; a user's own subclass runs anywhere kvtier's do.

    Must provide :meth:`priority`; may override the event hooks (no-ops here; observed attention is not an event but a
    statistic the engine keeps on its device, :meth:`requests`), :meth:`admit`,
    :meth:`pinned_pages` (how many pages it pins, checked against the device budget) and
    ``needs_salience`` (true when it reads :meth:`on_salience`, which some kernels cannot give).

    The attention hooks' ``layer`` is an int (a prefill chunk's layer) or an int array ``[n]``, the layer of
    each page (a decode step reports every layer in one call): index per-layer state with ``[layer, pids]``.
    """

    name: str = "policy"  # a label for reports (class attribute)

    def reset(self, num_layers: int) -> None:
        """Forget all state; called when a cache is built."""
        self.num_layers = num_layers

    def on_step(self, step: int) -> None:
        """A new engine step (one prefill chunk or one decode token) begins."""

    def on_append(self, pids: np.ndarray, step: int) -> None:
        """New pages were created."""

    def on_access(self, layer: int | np.ndarray | slice, pids: np.ndarray, step: int) -> None:
        """Pages of ``layer`` were attended at ``step``: ``layer`` an int, the ``[n]`` layer of each of ``pids [n]``,
        or ``slice(None)``: every layer attended every one of ``pids`` (index ``[layer, pids]`` arrays with it)."""

    def on_salience(self, layer: int | np.ndarray, pids: np.ndarray, scores: np.ndarray, step: int) -> None:
        """Observed salience ``scores [n, N_kv]`` (max attention probability per kv head) of pages of ``layer``."""

    @abstractmethod
    def priority(self, info: PageInfo) -> np.ndarray:
        """Scores ``[L, n]`` (or ``[1, n]``, broadcast over layers)."""

    def admit(self, info: PageInfo) -> np.ndarray:
        """May a page that is not in the fast tier be promoted ``[L or 1, n]``? Default: yes."""
        return np.ones((1, info.pids.size), dtype=bool)

    def ranked(self, info: PageInfo) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`priority` and :meth:`admit` at once (a policy whose two answers share a score computes it once)."""
        return self.priority(info), self.admit(info)

    def pinned_pages(self, page_size: int) -> int:
        """Most pages of one sequence this policy pins (+inf), besides the page being written."""
        return 0

    @property
    def needs_salience(self) -> bool:
        return False

    def requests(self) -> list:
        """The device statistics this policy reads, one :class:`~kvtier.stats.StatsRequest` per reader (a scored
        policy; each scored part of a Compose): observed attention, salience, scores computed on the device; none
        here."""
        return []

    def attach(self, stats: list) -> None:
        """The engine's statistics, one :class:`~kvtier.stats.DeviceStats` per request of :meth:`requests` in its
        order (with the key and query statistics where the engine keeps them): the engine fills and owns them, the
        policy reads them."""

    @property
    def hears_step(self) -> bool:
        """Does :meth:`on_step` change a page's priority? (Engines then ask for it again after the step begins.)"""
        return type(self).on_step is not Policy.on_step

    @property
    def hears_access(self) -> bool:
        """Does :meth:`on_access` change anything? (Engines skip gathering accesses for policies that ignore them.)"""
        return type(self).on_access is not Policy.on_access

    @property
    def needs(self) -> frozenset:
        """Statistics the cache must gather: a subset of ``{"attention", "salience", "keys", "queries"}``."""
        return frozenset({"salience"}) if self.needs_salience else frozenset()

    @property
    def attention_rows(self) -> int | None:
        """Newest query rows of a prefill chunk whose attention the engine adds (None: every row; 0: none)."""
        return 0
