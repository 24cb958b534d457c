"""Where a prompt's prefix KV can be found: per-instance prefix caches and tiers, and a KV pool shared by every
instance (Mooncake's store: the DRAM and SSD of every node, read over each node's NIC).

Prefixes are the traces' 512-token hash blocks (:mod:`kvtier.serve.trace`): equal ids are equal prefixes up
to that block, so a prompt's cached prefix is the leading run of its blocks found. A :class:`BlockCache` holds
up to ``capacity`` blocks, least recently used out first; blocks are touched last-to-first so that a prefix is
never older than what extends it (a leaf goes before its parents, as a radix tree evicts), and an evicted block
drops to the tier ``below`` (HBM -> DRAM -> SSD). A :class:`Tiers` is such a chain with the link each tier
is read over.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvtier.errors import ConfigError
from kvtier.sim.hardware import Link


class Holders:
    """Which of several caches hold each block (a bit per cache), so that one walk of a prompt's blocks gives
    every cache's leading run (the router's question, asked of every instance at each arrival)."""

    def __init__(self, caches: int):
        self.caches = caches
        self.bits: dict[int, int] = {}

    def runs(self, blocks) -> list[int]:
        """Per cache, how many of ``blocks`` lead the prompt there."""
        out = [len(blocks)] * self.caches
        alive, bits = (1 << self.caches) - 1, self.bits
        for j, b in enumerate(blocks):
            now = bits.get(b, 0) & alive
            gone, alive = alive & ~now, now
            while gone:
                low = gone & -gone
                out[low.bit_length() - 1] = j
                gone ^= low
            if not alive:
                break
        return out


class BlockCache:
    """An LRU set of prefix blocks, at most ``capacity``; evictions go to ``below`` (None: dropped); ``holders``:
    the index that this cache's blocks are recorded in, as bit ``bit``."""

    def __init__(self, capacity: int, below: BlockCache | None = None, holders: Holders | None = None,
                 bit: int = 0):
        if capacity < 1:
            raise ConfigError("prefix.capacity", f"a block cache holds >= 1 block, got {capacity}")
        self.capacity, self.below = int(capacity), below
        self.blocks: OrderedDict = OrderedDict()
        self.holders, self.bit = holders, 1 << bit

    def __contains__(self, block: int) -> bool:
        return block in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def match(self, blocks) -> int:
        """How many of ``blocks`` lead the prompt here (no recency change)."""
        n = 0
        for b in blocks:
            if b not in self.blocks:
                break
            n += 1
        return n

    def touch(self, blocks) -> None:
        """Hold ``blocks`` (a prompt's leading blocks) as the most recently used, its first block newest."""
        held, index = self.blocks, self.holders.bits if self.holders is not None else None
        for b in reversed(blocks):
            if b in held:
                held.move_to_end(b)
            else:
                held[b] = None
                if index is not None:
                    index[b] = index.get(b, 0) | self.bit
        while len(held) > self.capacity:
            old, _ = held.popitem(last=False)
            if index is not None:
                left = index[old] & ~self.bit
                if left:
                    index[old] = left
                else:
                    del index[old]
            if self.below is not None:
                self.below.touch((old,))


@dataclass(frozen=True)
class Tier:
    """One level of a prefix hierarchy: ``capacity`` blocks read over ``link`` (None: in HBM already; per
    instance for a local tier, the reading node's NIC for the shared pool)."""

    name: str
    capacity: int
    link: Link | None = None


class Tiers:
    """A chain of :class:`BlockCache` s, fastest first; :meth:`match` is the prompt's leading run over all of
    them, with how many of its blocks each level holds."""

    def __init__(self, levels: list[Tier], holders: Holders | None = None, bit: int = 0):
        if not levels:
            raise ConfigError("prefix.tiers", "give at least one tier")
        self.levels = list(levels)
        self.caches: list[BlockCache] = []
        below = None
        for i, t in reversed(list(enumerate(self.levels))):
            below = BlockCache(t.capacity, below, holders if i == 0 else None, bit)
            self.caches.insert(0, below)

    def match(self, blocks, first: int | None = None) -> list[int]:
        """Per level, the blocks of the prompt's leading run over all levels found there (each block counted at
        the fastest level holding it); the first level's count is of its own leading run (``first``, when the
        caller knows it)."""
        first = self.caches[0].match(blocks) if first is None else first
        counts = [first] + [0] * (len(self.caches) - 1)
        for b in blocks[first:]:
            for i in range(1, len(self.caches)):
                if b in self.caches[i].blocks:
                    counts[i] += 1
                    break
            else:
                break
        return counts

    def touch(self, blocks) -> None:
        """The blocks land in the first level (their copies below stay until evicted there)."""
        self.caches[0].touch(blocks)
