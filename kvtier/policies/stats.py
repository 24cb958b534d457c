"""What scorers read: :class:`PageStats`, a value object over the candidate pages, and the
:class:`StatsStore` a scored policy fills from the cache's events.

The store keeps, per (layer, pid, kv head), observed attention (the exact probability mass a page
received from a query row, :func:`kvtier.page_stats.page_attention`): the running sum over every
observed row (H2O) and the last ``rows`` rows (a ring: TOVA reads the newest, SnapKV sums the
window), plus ASPE's salience history (max probability per page, summed over kv heads) and the
cache's key and query statistics (:mod:`kvtier.page_stats`), bound by the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from kvtier.errors import KVTierError
from kvtier.policies.base import PageInfo, grown

NEEDS = frozenset({"attention", "salience", "keys", "queries"})
ATTENTION_FIELDS = frozenset({"total", "last", "window"})  # PageStats.attention_<field>


def _sum_by(index: np.ndarray, values: np.ndarray, size: int) -> np.ndarray:
    """``values [n, C]`` summed by ``index [n]`` into ``[size, C]`` (float64; ``np.add.at``'s result, by bincount)."""
    return np.stack([np.bincount(index, weights=values[:, c], minlength=size) for c in range(values.shape[1])], -1)


class StatsStore:
    """Observations of one cache, numpy on the host. ``rows``: attention rows kept; ``obs_window``:
    steps of salience kept; ``keeps``: the attention sums a scorer reads (of :data:`ATTENTION_FIELDS`; the running
    sum for ``total``, the ring of rows for ``last`` and ``window``, the ring's sum for ``window``), the only ones
    kept up."""

    def __init__(self, num_layers: int, rows: int = 1, obs_window: int = 16, keeps=ATTENTION_FIELDS):
        self.L, self.rows, self.obs_window = num_layers, rows, obs_window
        self.keeps = frozenset(keeps)
        self.acc: np.ndarray | None = None  # [L, pids, N_kv] attention summed over every observed row
        self.ring: np.ndarray | None = None  # [rows, L, pids, N_kv] the last rows (0 where not attended)
        self.window_sum: np.ndarray | None = None  # [L, pids, N_kv] the ring summed over its rows, kept as it turns
        self.head = np.zeros(num_layers, dtype=np.int64)  # rows pushed per layer
        self.sal = np.full((obs_window, num_layers, 64), np.nan, dtype=np.float32)  # [W, L, pids]
        self.sal_last = np.full((num_layers, 64), np.nan, dtype=np.float32)  # [L, pids] last windowed mean
        self._sal_row = 0
        self.keys = None  # kvtier.page_stats.KeyStats, bound by the cache
        self.queries = None  # kvtier.page_stats.QueryStats

    # -- events --------------------------------------------------------------------------------
    def on_step(self, step: int) -> None:
        self._sal_row = step % self.obs_window
        self.sal[self._sal_row] = np.nan

    def on_append(self, pids: np.ndarray) -> None:
        self._grow(int(pids.max(initial=-1)) + 1)
        if self.acc is not None:
            self.acc[:, pids] = 0
            self.ring[:, :, pids] = 0
            self.window_sum[:, pids] = 0
        self.sal[:, :, pids] = np.nan
        self.sal_last[:, pids] = np.nan

    def on_attention(self, layer, pids: np.ndarray, mass: np.ndarray) -> None:
        """``mass [r, n, N_kv]``: the step's last ``r`` query rows (oldest first) on pages ``pids`` of ``layer`` (an
        int, or ``[n]`` each page's layer: each layer named gets the ``r`` rows)."""
        if self.acc is None:
            n_kv = mass.shape[-1]
            self.acc = np.zeros((self.L, self.sal.shape[-1], n_kv), dtype=np.float64)
            self.ring = np.zeros((self.rows, self.L, self.sal.shape[-1], n_kv), dtype=np.float32)
            self.window_sum = np.zeros((self.L, self.sal.shape[-1], n_kv), dtype=np.float64)
        self._grow(int(pids.max(initial=-1)) + 1)
        if pids.size == 0:
            return
        layer = np.broadcast_to(layer, pids.shape)  # [n]
        named = np.unique(layer)  # [l]
        lo, span, P = named[0], named[-1] + 1 - named[0], self.acc.shape[1]
        at = slice(lo, lo + span) if named.size == span else named  # the layers named (a view when contiguous)
        cell = (layer - lo) * P + pids  # [n] (layer, pid) from the first layer named; a page split over parts or
        # shared by rows repeats, and adds up

        def by_page(values):  # [n, N_kv] -> [l, P, N_kv] float64: summed per (layer, pid) of the layers named
            summed = _sum_by(cell, values, span * P).reshape(span, P, -1)
            return summed if named.size == span else summed[named - lo]

        newest = [by_page(row) for row in mass[-self.rows:]] if self.keeps & {"last", "window"} else []
        if "total" in self.keeps:
            self.acc[at] += newest[0] if mass.shape[0] == 1 and newest else by_page(mass.sum(0))
        window = "window" in self.keeps
        for row in newest:
            slot = self.head[named] % self.rows  # [l]
            ring = (slot[0], at) if (slot == slot[0]).all() else (slot, named)  # a view when one slot, contiguous
            if window:
                self.window_sum[at] -= self.ring[ring]  # the row leaving the window
            self.ring[ring] = row  # a page the row did not attend gets 0 from it
            if window:
                self.window_sum[at] += self.ring[ring]
            self.head[named] += 1

    def on_salience(self, layer, pids: np.ndarray, scores: np.ndarray) -> None:
        self._grow(int(pids.max(initial=-1)) + 1)
        self.sal[self._sal_row, layer, pids] = scores.sum(-1)  # Σ over kv heads

    def _grow(self, size: int) -> None:
        if size <= self.sal.shape[-1]:
            return
        self.sal = grown(self.sal, size, np.nan)
        self.sal_last = grown(self.sal_last, size, np.nan)
        if self.acc is not None:
            self.acc = np.moveaxis(grown(np.moveaxis(self.acc, 1, -1), size, 0.0), -1, 1)
            self.ring = np.moveaxis(grown(np.moveaxis(self.ring, 2, -1), size, 0.0), -1, 2)
            self.window_sum = np.moveaxis(grown(np.moveaxis(self.window_sum, 1, -1), size, 0.0), -1, 1)

    # -- reading -------------------------------------------------------------------------------
    def salience_mean(self, pids: np.ndarray) -> np.ndarray:
        """ASPE's Φ ``[L, n]``: mean salience over the window where observed, else the last mean
        seen, else NaN."""
        self._grow(int(pids.max(initial=-1)) + 1)
        h = self.sal[:, :, pids]  # [W, L, n]
        seen = ~np.isnan(h)
        count = seen.sum(0)
        mean = np.where(seen, h, 0).sum(0) / np.maximum(count, 1)  # [L, n]
        self.sal_last[:, pids] = np.where(count > 0, mean, self.sal_last[:, pids])
        return self.sal_last[:, pids].copy()

    def stats(self, info: PageInfo) -> "PageStats":
        return PageStats(info, self)


@dataclass
class PageStats:
    """The candidate pages of :class:`PageInfo` (``n`` of them) and what is known of them; each
    field is computed on first use. Arrays are per layer: ``[L, n, ...]``; the per-channel key and query
    fields stay torch tensors on the engine's device (a scorer reduces them there and reads back ``[L, n]``:
    at 8k tokens they are megabytes per step)."""

    info: PageInfo
    store: StatsStore = field(repr=False)

    @cached_property
    def _cols(self) -> slice | np.ndarray:
        """The candidates' pids as a slice when they are one ascending run (the arrays' views then, no copy)."""
        p = self.info.pids
        if p.size and p[-1] - p[0] + 1 == p.size and (np.diff(p) == 1).all():
            return slice(int(p[0]), int(p[-1]) + 1)
        return p

    @staticmethod
    def _read_only(a: np.ndarray) -> np.ndarray:
        """``a`` (perhaps a view of the store's arrays) as a scorer may read it, never write."""
        a.flags.writeable = False
        return a

    def _kept(self, field: str) -> None:
        if field not in self.store.keeps:
            raise KVTierError(f"the scorer read attention_{field}, but its attention_fields "
                              f"{sorted(self.store.keeps)} do not name '{field}', so the store does not keep it: add "
                              "it to the scorer's attention_fields")

    @cached_property
    def attention_total(self) -> np.ndarray:
        """Attention summed over every observed query row ``[L, n, N_kv]`` (H2O's accumulated score)."""
        self._kept("total")
        if self.store.acc is None:
            return np.zeros((self.store.L, self.info.pids.size, 1))
        self.store._grow(int(self.info.pids.max(initial=-1)) + 1)
        return self._read_only(self.store.acc[:, self._cols])

    @cached_property
    def attention_last(self) -> np.ndarray:
        """The newest query row's attention ``[L, n, N_kv]`` (per layer: its own newest row)."""
        self._kept("last")
        if self.store.ring is None:
            return np.zeros((self.store.L, self.info.pids.size, 1), dtype=np.float32)
        self.store._grow(int(self.info.pids.max(initial=-1)) + 1)
        newest = (self.store.head - 1) % self.store.rows  # [L]
        return self.store.ring[newest[:, None], np.arange(self.store.L)[:, None], self.info.pids[None, :]]

    @cached_property
    def attention_window(self) -> np.ndarray:
        """Attention summed over the last ``rows`` query rows ``[L, n, N_kv]`` (SnapKV's window)."""
        self._kept("window")
        if self.store.window_sum is None:
            return np.zeros((self.store.L, self.info.pids.size, 1))
        self.store._grow(int(self.info.pids.max(initial=-1)) + 1)
        return self._read_only(self.store.window_sum[:, self._cols])

    @cached_property
    def salience(self) -> np.ndarray:
        """ASPE's Φ ``[L, n]`` (NaN where never observed)."""
        return self.store.salience_mean(self.info.pids)

    def _keys(self, name: str) -> torch.Tensor:
        """The engine's key statistic ``name`` of the candidate pages ``[L, n, ...]``, on its device."""
        keys = self.store.keys
        return getattr(keys, name)[:, torch.from_numpy(self.info.pids).to(keys.device)]

    @cached_property
    def key_count(self) -> np.ndarray:
        """Tokens written per page ``[L, n]``."""
        return self._keys("count").cpu().numpy()

    @cached_property
    def key_norm(self) -> np.ndarray:
        """Mean key L2 norm per page ``[L, n, N_kv]`` (NaN for an empty page)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return self._keys("norm_sum").cpu().numpy() / self.key_count[..., None]

    @cached_property
    def _written(self) -> torch.Tensor:
        """Tokens written per page, at least 1 ``[L, n, 1, 1]`` (device): what the key means divide by."""
        return self._keys("count").clamp(min=1)[..., None, None]

    @cached_property
    def key_mean(self) -> torch.Tensor:
        """Mean key ``[L, n, N_kv, D]`` (device: a scorer reduces it there)."""
        return self._keys("key_sum") / self._written

    @cached_property
    def key_sq_mean(self) -> torch.Tensor:
        """Mean squared key, per channel ``[L, n, N_kv, D]`` (device)."""
        return self._keys("key_sq") / self._written

    @cached_property
    def key_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Quest's per-channel key min and max ``[L, n, N_kv, D]`` each (device)."""
        return self._keys("key_min"), self._keys("key_max")

    @cached_property
    def query_last(self) -> torch.Tensor | None:
        """The newest decode query per layer ``[L, H, D]`` (device; None before any decode step)."""
        return self.store.queries.last() if self.store.queries is not None else None

    @cached_property
    def query_moments(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Mean and variance of the recent decode queries ``[L, H, D]`` each (device)."""
        return self.store.queries.moments() if self.store.queries is not None else None
