"""Attention scopes of the hook path: which pages each sequence attends in a step, chosen on the host.

A scope sees the cache's table and the step's page range (never a page left of a sliding window:
``first``; pages from ``tail_from`` on are always attended) and returns, per sequence, the sorted
logical page numbers to attend. A scope that keeps per-page state hears pages appear and keys be
written. The fast path's device-side scopes are :mod:`kvtier.fast.scopes`.

- :class:`AllScope`: every page (exact).
- :class:`ResidentScope`: the pages in the device tier.
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

    def on_append(self, pids: np.ndarray) -> None:
        """New pages ``pids`` were appended (fresh state)."""

    def on_copy(self, src: int, dst: int) -> None:
        """Page ``dst`` is a copy of ``src`` (copy-on-write)."""

    def on_write(self, table, seqs, layer: int, keys: torch.Tensor, start: int) -> None:
        """Keys ``[B, N_kv, q, D]`` were written at positions ``start..`` of each sequence."""


def every_page(table, seqs, first: int) -> list[np.ndarray]:
    return [np.arange(first, table.num_pages(seq)) for seq in seqs]


class AllScope(Scope):
    name = "all"

    def choose(self, table, seqs, layer, query, first, tail_from, q_len):
        return every_page(table, seqs, first)


class ResidentScope(Scope):
    name = "resident"

    def choose(self, table, seqs, layer, query, first, tail_from, q_len):
        chosen = []
        for seq in seqs:
            on_dev = table.tier_of[layer, table.pages(seq)] == 0
            on_dev[tail_from:] = True  # the tokens being written are always attended
            chosen.append(np.flatnonzero(on_dev[first:]) + first)
        return chosen


class TopKScope(Scope):
    """Quest page selection at decode steps (prefill attends every page); owns the key bounds
    ``[L, pids, N_kv, D]`` float32 on ``device``."""

    name = "topk"

    def __init__(self, layout, topk_pages: int, sinks: int, device):
        if not isinstance(topk_pages, int) or isinstance(topk_pages, bool) or topk_pages < 1:
            raise ConfigError("topk_pages", f"scope 'topk' needs topk_pages >= 1, got {topk_pages!r}")
        self.layout, self.topk_pages, self.sinks, self.device = layout, topk_pages, sinks, device
        shape = (layout.num_layers, 64, layout.num_kv_heads, layout.head_dim)
        self.key_min = torch.full(shape, float("inf"), device=device)
        self.key_max = torch.full(shape, float("-inf"), device=device)

    def choose(self, table, seqs, layer, query, first, tail_from, q_len):
        if q_len > 1:
            return every_page(table, seqs, first)
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
                scores = self.scores(layer, query[b], pids[free])  # [m]
                forced[free[torch.topk(scores, k).indices.cpu().numpy()]] = True
            chosen.append(np.flatnonzero(forced))
        return chosen

    def scores(self, layer: int, q: torch.Tensor, pids: np.ndarray) -> torch.Tensor:
        """Quest upper bound of q·k over each page, max over heads: ``[m]``. q ``[H, 1, D]``."""
        idx = torch.from_numpy(pids).to(self.device)
        kmin, kmax = self.key_min[layer, idx], self.key_max[layer, idx]  # [m, N_kv, D]
        g = q.shape[0] // self.layout.num_kv_heads
        qg = q[:, -1].float().view(self.layout.num_kv_heads, g, -1).to(self.device)  # [N_kv, G, D]
        ub = torch.maximum(qg[None] * kmin[:, :, None], qg[None] * kmax[:, :, None]).sum(-1)  # [m, N_kv, G]
        return ub.amax(dim=(1, 2))

    def on_append(self, pids):
        self._grow(int(pids.max()) + 1)
        idx = torch.from_numpy(pids).to(self.device)
        self.key_min[:, idx] = float("inf")
        self.key_max[:, idx] = float("-inf")

    def on_copy(self, src, dst):
        self._grow(max(src, dst) + 1)
        self.key_min[:, dst] = self.key_min[:, src]
        self.key_max[:, dst] = self.key_max[:, src]

    def on_write(self, table, seqs, layer, keys, start):
        P = self.layout.page_size
        pos = np.arange(start, start + keys.shape[2])
        for b, seq in enumerate(seqs):
            pids = torch.from_numpy(table.pages(seq)[pos // P]).to(self.device)  # [q]
            k = keys[b].transpose(0, 1).float().to(self.device)  # [q, N_kv, D]
            idx = pids[:, None, None].expand_as(k)
            self.key_min[layer].scatter_reduce_(0, idx, k, reduce="amin")
            self.key_max[layer].scatter_reduce_(0, idx, k, reduce="amax")

    def _grow(self, size: int) -> None:
        cap = self.key_min.shape[1]
        if size <= cap:
            return
        extra = max(size, 2 * cap) - cap
        def pad(t, v):
            return torch.cat([t, torch.full((t.shape[0], extra, *t.shape[2:]), v, device=t.device)], 1)

        self.key_min, self.key_max = pad(self.key_min, float("inf")), pad(self.key_max, float("-inf"))


def make_scope(name: str, layout, topk_pages: int | None, sinks: int, device) -> Scope:
    """The scope called ``name`` (one of :data:`SCOPES`)."""
    if name == "all":
        return AllScope()
    if name == "resident":
        return ResidentScope()
    if name == "topk":
        return TopKScope(layout, topk_pages, sinks, device)
    raise ConfigError("scope", f"unknown scope {name!r}; use one of {list(SCOPES)}")
