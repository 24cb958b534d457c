"""RadixCache: a radix tree of page-aligned token prefixes over the block table (SGLang's RadixAttention,
Zheng et al. 2024, with paged edges).

Each node is one full page: its key the page's ``page_size`` token ids, its value the pid holding its K/V. The tree
holds one reference on each of its pids (:meth:`BlockTable.retain`); a sequence that starts from a cached prefix
shares its pages (``BlockTable.add_sequence(seq, pids, length)``), full pages only. Without a table the tree is a
prefix index only (trace statistics, the simulator). Eviction is leaf-first and takes only pages no sequence
holds, lowest :meth:`Policy.priority` first (over the layers' minimum), ties by least recent use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvtier.errors import KVTierError
from kvtier.policies.base import PageInfo, Policy

if TYPE_CHECKING:  # the table is only passed in; the prefix index alone (traces, simulator) needs no torch
    from kvtier.table import BlockTable


@dataclass(eq=False, slots=True)
class RadixNode:
    pid: int  # -1 at the root
    depth: int  # pages from the root: this node is logical page depth - 1
    parent: "RadixNode | None"
    key: int = 0  # page_keys' hash of the page's tokens
    children: dict[int, "RadixNode"] = field(default_factory=dict)
    last_used: int = 0  # the tree's clock at the last match or insert through this node


@dataclass
class PrefixMatch:
    pids: np.ndarray  # [n] pids of the matched pages, in logical order
    n_tokens: int  # n * page_size
    node: RadixNode  # the deepest matched node (the root when nothing matched)


def page_keys(tokens: np.ndarray, page_size: int) -> list[int]:
    """The key of each full page of ``tokens [S]``: the 64-bit hash of its int64 token ids' bytes (keys
    only tell siblings apart, so two pages alias only if they share a parent and a 64-bit hash)."""
    n = len(tokens) // page_size
    buf = np.ascontiguousarray(tokens[:n * page_size], dtype=np.int64).tobytes()
    w = 8 * page_size
    return [hash(buf[i * w:(i + 1) * w]) for i in range(n)]


def splitmix64(x: np.ndarray) -> np.ndarray:
    """Steele et al.'s SplitMix64 finalizer, elementwise on uint64 ``x``."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


class RadixCache:
    """Page-aligned prefixes of token-id sequences -> shared pages of ``table``."""

    def __init__(self, table: BlockTable | None, policy: Policy | None = None, page_size: int | None = None):
        if (table is None) == (page_size is None):
            raise KVTierError("RadixCache: give a block table, or page_size alone for an index without pages")
        self.table, self.policy = table, policy
        self.page_size = table.layout.page_size if table is not None else page_size
        self.root = RadixNode(pid=-1, depth=0, parent=None)
        self.leaves: set[RadixNode] = set()
        self.num_pages = 0
        self.clock = 0
        self.step = 0  # the step the policy's priorities are asked at (set by the caller)

    def match(self, tokens, max_tokens: int | None = None) -> PrefixMatch:
        """The longest cached page-aligned prefix of ``tokens [S]`` (at most ``max_tokens`` tokens)."""
        tokens = np.asarray(tokens)
        if max_tokens is not None:
            tokens = tokens[:max_tokens]
        self.clock += 1
        node, pids = self.root, []
        for key in page_keys(tokens, self.page_size):
            child = node.children.get(key)
            if child is None:
                break
            node = child
            node.last_used = self.clock
            pids.append(node.pid)
        return PrefixMatch(np.asarray(pids, dtype=np.int64), len(pids) * self.page_size, node)

    def insert(self, tokens, pids, after: PrefixMatch | None = None) -> int:
        """Cache the full pages of ``tokens [S]``, held in ``pids [>= S // page_size]`` (a sequence's
        pages). A page already cached keeps its pid (the caller's copy stays the caller's); new nodes
        take a reference on their pid. ``after``: this sequence's own match, whose pages it still holds
        (the walk starts there). Returns the number of pages added."""
        node = self.root if after is None else after.node
        first = node.depth
        tokens = np.asarray(tokens)
        keys = page_keys(tokens[first * self.page_size:], self.page_size)
        pids = np.asarray(pids, dtype=np.int64)[first:]
        if pids.size < len(keys):
            raise KVTierError(f"insert of {first + len(keys)} pages with only {first + pids.size} pids")
        self.clock += 1
        added = 0
        for key, pid in zip(keys, pids.tolist()):
            child = node.children.get(key)
            if child is None:
                if self.table is not None:
                    self.table.retain([pid])
                child = RadixNode(pid=pid, depth=node.depth + 1, parent=node, key=key)
                node.children[key] = child
                self.leaves.discard(node)
                self.leaves.add(child)
                self.num_pages += 1
                added += 1
            node = child
            node.last_used = self.clock
        return added

    def evictable(self) -> int:
        """Pages :meth:`evict` could free now: subtrees that no sequence holds any page of."""
        order, stack = [], list(self.root.children.values())
        while stack:  # parents before children
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        free: dict[int, bool] = {}  # id(node) -> no sequence holds a page of its subtree
        for node in reversed(order):
            free[id(node)] = not self._held(node.pid) and all(free[id(c)] for c in node.children.values())
        return sum(free.values())

    def evict(self, n_pages: int) -> list[int]:
        """Free up to ``n_pages`` pages, leaves first, in the policy's order. Returns the freed pids."""
        freed: list[int] = []
        while len(freed) < n_pages:
            cands = [leaf for leaf in self.leaves if not self._held(leaf.pid)]
            if not cands:
                break
            for leaf in [cands[i] for i in self._order(cands)[:n_pages - len(freed)]]:
                del leaf.parent.children[leaf.key]
                self.leaves.discard(leaf)
                if leaf.parent is not self.root and not leaf.parent.children:
                    self.leaves.add(leaf.parent)
                self.num_pages -= 1
                freed += self.table.release([leaf.pid]) if self.table is not None else [leaf.pid]
        return freed

    def _held(self, pid: int) -> bool:
        """Does a sequence hold ``pid`` besides the tree?"""
        return self.table is not None and self.table.ref[pid] > 1

    def _order(self, leaves: list[RadixNode]) -> np.ndarray:
        """Indices of ``leaves`` in eviction order: the policy's priority (min over layers), then age."""
        age = np.array([leaf.last_used for leaf in leaves])
        if self.policy is None:
            return np.argsort(age, kind="stable")
        depth = np.array([leaf.depth for leaf in leaves])
        info = PageInfo(pids=np.array([leaf.pid for leaf in leaves], dtype=np.int64), logical=depth - 1,
                        seq_len=depth * self.page_size, page_size=self.page_size, step=self.step)
        prio = np.asarray(self.policy.priority(info)).min(axis=0)  # [n]
        return np.lexsort((age, prio))
