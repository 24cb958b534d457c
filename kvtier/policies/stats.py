"""What scorers read: :class:`PageStats`, a value object over the candidate pages, and the :class:`StatsStore` a
scored policy reads through: ASPE's salience history, and the engine's statistics through the
:class:`~kvtier.stats.DeviceStats` the engine fills and owns (``StatsStore.attach``; :mod:`kvtier.stats`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from kvtier.stats import ATTENTION_FIELDS, AttentionStats, DeviceStats, SalienceStats, pid_index
from kvtier.errors import KVTierError
from kvtier.policies.base import PageInfo
from kvtier.table import grown

NEEDS = frozenset({"attention", "salience", "keys", "queries"})
__all__ = ["ATTENTION_FIELDS", "NEEDS", "PageStats", "StatsStore"]


class StatsStore:
    """What one scored policy reads. ``rows``: attention rows kept; ``obs_window``: steps of salience kept; ``keeps``:
    the attention sums its scorer reads (of :data:`ATTENTION_FIELDS`), the only ones kept up; ``score_device``: the
    scorer's, when it scores on the device."""

    def __init__(self, num_layers: int, rows: int = 1, obs_window: int = 16, keeps=ATTENTION_FIELDS, score_device=None):
        self.L, self.rows, self.obs_window = num_layers, rows, obs_window
        self.score_device = score_device  # the scorer's Scorer.score_device, when it scores on the device
        self.keeps = frozenset(keeps)
        # the engine's statistics this store reads (attach), or its own: attention and salience made on the first
        # hand-fed row, device scores computed when read
        self.device = DeviceStats()
        self.sal_last = np.full((num_layers, 64), np.nan, dtype=np.float32)  # [L, pids] the last windowed mean read
        self._step = 0

    def attach(self, stats: DeviceStats) -> None:
        """Read the engine's statistics ``stats`` (which it fills and owns) from now on."""
        self.device = stats
        if stats.salience is not None:
            stats.salience.begin(self._step)

    # -- events --------------------------------------------------------------------------------
    def on_step(self, step: int) -> None:
        self._step = step
        if self.device.salience is not None:
            self.device.salience.begin(step)

    def on_append(self, pids: np.ndarray, step: int = 0) -> None:
        if self.device.salience is not None and self.device.salience.host is None:
            self._hand_fed_salience(int(pids.max(initial=-1)) + 1)
        for stats in (self.device.attention, self.device.scores, self.device.salience):
            if stats is not None and pids.size:
                stats.on_append(pids, step)
        self.sal_last = grown(self.sal_last, int(pids.max(initial=-1)) + 1, np.nan)
        self.sal_last[:, pids] = np.nan

    def on_attention(self, layer: int, pids: np.ndarray, mass: np.ndarray) -> None:
        """Attention fed by hand, without an engine (tests, notebooks): ``mass [r, n, N_kv]``, the newest ``r`` query
        rows (oldest first) on pages ``pids [n]`` of ``layer``, into a CPU store."""
        size = int(pids.max(initial=-1)) + 1
        a, dev = self.device.attention, self.device
        if a is None or a.capacity < size:
            dev.attention = AttentionStats(self.L, max(64, 2 * size), mass.shape[-1], self.rows, self.keeps, "cpu")
            for old, new in zip(a.tensors() if a is not None else [], dev.attention.tensors()):  # pids kept so far
                (new[:old.shape[0]] if old.dim() == 3 else new[:, :old.shape[1]] if old.dim() == 4 else new).copy_(old)
        self.device.attention.add(layer, pid_index(pids, "cpu"), torch.as_tensor(mass))

    def on_salience(self, layer, pids: np.ndarray, scores: np.ndarray) -> None:
        """Salience fed by hand, without an engine (tests, the simulator): ``scores [n, N_kv]`` of pages ``pids [n]``
        of ``layer`` observed in the open step, into a CPU store."""
        pids = np.asarray(pids, dtype=np.int64)
        self._hand_fed_salience(int(pids.max(initial=-1)) + 1).add(layer, torch.from_numpy(pids), torch.as_tensor(scores))

    def _hand_fed_salience(self, size: int) -> SalienceStats:
        """The CPU store's salience, grown to hold pids below ``size`` (the pids kept so far and the open row kept)."""
        s = self.device.salience
        if s is None or s.capacity < size:
            self.device.salience = SalienceStats(self.L, max(64, 2 * size), self.obs_window, "cpu")
            if s is None:
                self.device.salience.row.fill_(self._step % self.obs_window)
            else:
                self.device.salience.ring[:s.capacity] = s.ring
                self.device.salience.row.copy_(s.row)
        return self.device.salience

    # -- reading -------------------------------------------------------------------------------
    def salience_mean(self, pids: np.ndarray | slice) -> np.ndarray:
        """ASPE's Φ ``[L, n]`` of ``pids`` (``[n]``, or a slice of them): mean salience over the window where
        observed, else the last mean seen, else NaN."""
        size = pids.stop if isinstance(pids, slice) else int(pids.max(initial=-1)) + 1
        self.sal_last = grown(self.sal_last, size, np.nan)
        if self.device.salience is None:
            return self.sal_last[:, pids].copy()
        if self.device.salience.host is None:
            self._hand_fed_salience(size)
        total, count = self.device.salience.read(pids)  # [n, L] each, over the window's observed steps
        phi = np.where(count.T > 0, (total / np.maximum(count, 1)).T, self.sal_last[:, pids])  # [L, n]
        self.sal_last[:, pids] = phi
        return phi

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

    def _attention(self, field: str) -> np.ndarray:
        """The kept attention field ``field`` of the candidates ``[L, n, N_kv]`` (0 before any row was observed)."""
        if field not in self.store.keeps:
            raise KVTierError(f"the scorer read attention_{field}, but its attention_fields "
                              f"{sorted(self.store.keeps)} do not name '{field}', so the store does not keep it: add "
                              "it to the scorer's attention_fields")
        if self.store.device.attention is None:
            return np.zeros((self.store.L, self.info.pids.size, 1))
        return self._read_only(self.store.device.attention.read()[field][:, self._cols])

    @cached_property
    def attention_total(self) -> np.ndarray:
        """Attention summed over every observed query row ``[L, n, N_kv]`` (H2O's accumulated score)."""
        return self._attention("total")

    @cached_property
    def attention_last(self) -> np.ndarray:
        """The newest query row's attention ``[L, n, N_kv]`` (per layer: its own newest row)."""
        return self._attention("last")

    @cached_property
    def attention_window(self) -> np.ndarray:
        """Attention summed over the last ``rows`` query rows ``[L, n, N_kv]`` (SnapKV's window)."""
        return self._attention("window")

    @cached_property
    def salience(self) -> np.ndarray:
        """ASPE's Φ ``[L, n]`` (NaN where never observed)."""
        return self.store.salience_mean(self._cols)

    def _keys(self, name: str) -> torch.Tensor:
        """The engine's key statistic ``name`` of the candidate pages ``[L, n, ...]``, on its device."""
        keys = self.store.device.keys
        return getattr(keys, name)[:, torch.tensor(self.info.pids, device=keys.device)]

    @cached_property
    def key_norm(self) -> np.ndarray:
        """Mean key L2 norm per page ``[L, n, N_kv]`` (NaN for an empty page), read now (a wait for the queued steps)."""
        return self.store.device.keys.norm_mean(self.info.pids)

    @cached_property
    def device_score(self) -> np.ndarray:
        """The scorer's own ``score_device`` of the candidates ``[L, n]``: the engine's snapshot (a page appended since
        reads the lowest finite score: not scored yet), or scored now (a wait) for a store no engine bound."""
        scores = self.store.device.scores
        if scores is None:
            keys, queries = self.store.device.keys, self.store.device.queries
            pids = torch.tensor(self.info.pids, device=keys.device)
            return self.store.score_device(keys, queries, keys.count.shape[1])[:, pids].double().cpu().numpy()
        return np.nan_to_num(scores.read(self.info.pids).astype(np.float64), nan=np.finfo(np.float64).min)

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
