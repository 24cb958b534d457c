"""SequencePages: what serving reads and holds of an engine's pages, the narrow typed view of its block table.

A request scheduler (:mod:`kvtier.serve.scheduler`) asks how far a sequence is and which pages hold it, holds
pages it matched in the prefix tree while it makes room, counts free pages, and builds the prefix tree over the
engine's pages (:class:`~kvtier.radix.RadixCache`); it never edits the table itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

from kvtier.policies.base import Policy
from kvtier.radix import RadixCache
from kvtier.table import BlockTable


class SequencePages:
    """The pages of an engine's sequences over ``table``, ranked by ``policy`` when the prefix tree evicts."""

    def __init__(self, table: BlockTable, policy: Policy):
        self._table, self._policy = table, policy

    @property
    def device_capacity(self) -> int:
        """Pages per layer the device tier holds."""
        return self._table.tiers[0].capacity

    @property
    def tiered(self) -> bool:
        """Is there a tier below the device?"""
        return len(self._table.tiers) > 1

    def seq_len(self, seq: int) -> int:
        """Tokens of ``seq`` written so far."""
        return self._table.seq_len(seq)

    def num_pages(self, seq: int) -> int:
        """Pages ``seq`` holds."""
        return self._table.num_pages(seq)

    def pids(self, seq: int) -> np.ndarray:
        """The pids of ``seq``'s pages ``[n]``, in order."""
        return self._table.pages(seq)

    @contextlib.contextmanager
    def held(self, pids: np.ndarray) -> Iterator[None]:
        """Pages ``pids [n]`` held (one more reference each) inside the block: making room evicts none of them."""
        self._table.retain(pids)
        try:
            yield
        finally:
            self._table.release(pids)

    def free_pages(self) -> int:
        """Free pages over every tier (each tier's fullest layer)."""
        table = self._table
        return sum(min(t.num_free(layer) for layer in range(table.layout.num_layers)) for t in table.tiers)

    def used_by_tier(self) -> dict[str, int]:
        """Pages in use in layer 0, per tier name."""
        return {t.name: t.num_used(0) for t in self._table.tiers}

    def prefix_tree(self) -> RadixCache:
        """A prefix tree over these pages (it holds a reference on each page it keeps)."""
        return RadixCache(self._table, self._policy)
