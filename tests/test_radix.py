"""The radix prefix cache against a plain-dict model: randomized requests (match a cached prefix, share its
pages, compute the rest), inserts, evictions, forks with copy-on-write, decode appends and frees.

A token's K/V is a function of its whole prefix (as in a model), so a sequence reading back its own
K/V checks that shared pages hold the right data and were never written in place."""

import zlib
from collections import Counter

import numpy as np
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier import BlockTable, KVLayout
from kvtier.errors import TierFullError
from kvtier.mover.paged_io import read_tokens, write_tokens
from kvtier.policies import LRU
from kvtier.radix import RadixCache
from kvtier.tiers import DeviceTier, HostTier

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=2, page_size=4, dtype="float32")
P = LAYOUT.page_size


def kv_of(tokens: list[int], start: int) -> torch.Tensor:
    """K/V ``[L, 2, S - start, N_kv, D]`` of ``tokens[start:]``, each a function of its whole prefix."""
    vals = [zlib.crc32(np.asarray(tokens[:i + 1], dtype=np.int64).tobytes()) for i in range(start, len(tokens))]
    base = torch.tensor(vals, dtype=torch.float64)[None, None, :, None, None]  # [1, 1, n, 1, 1]
    off = torch.arange(LAYOUT.num_layers * 2 * LAYOUT.head_dim, dtype=torch.float64)
    off = off.view(LAYOUT.num_layers, 2, 1, 1, LAYOUT.head_dim)  # [L, 2, 1, 1, D]
    return ((base + off) % 1000).to(torch.float32)  # [L, 2, n, 1, D]


class RadixMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.tiers = [DeviceTier(LAYOUT, 10, device="cpu"), HostTier(LAYOUT, 14)]
        self.table = BlockTable(LAYOUT, self.tiers)
        self.policy = LRU()
        self.policy.reset(LAYOUT.num_layers)
        self.cache = RadixCache(self.table, self.policy)  # no page is attended here: the order is by age
        self.tokens: dict[int, list[int]] = {}  # seq -> its token ids (the model of its K/V)
        self.tree: dict[tuple, int] = {}  # page-aligned prefix -> pid (the model of the tree)
        self.next_seq = 0

    def _append(self, seq: int, new: list[int]) -> bool:
        """Grow ``seq`` by ``new`` tokens and write their K/V; on a full table evict from the tree once."""
        for attempt in (0, 1):
            try:
                self.table.append(seq, len(new))
                break
            except TierFullError:
                if attempt:
                    return False
                for pid in self.cache.evict(LAYOUT.pages_for(len(new)) + 1):
                    self._forget(pid)
        start = len(self.tokens[seq])
        self.tokens[seq] = self.tokens[seq] + new
        kv = kv_of(self.tokens[seq], start)
        for layer in range(LAYOUT.num_layers):
            write_tokens(self.table, layer, seq, kv[layer], start)
        return True

    def _forget(self, pid: int) -> None:
        (prefix,) = [k for k, v in self.tree.items() if v == pid]
        assert not any(len(k) > len(prefix) and k[:len(prefix)] == prefix for k in self.tree), "not a leaf"
        assert not any(pid in s.pids for s in self.table.seqs.values()), "evicted a page a sequence holds"
        del self.tree[prefix]

    def _model_match(self, tokens: list[int]) -> list[int]:
        pids = []
        for n in range(P, len(tokens) + 1, P):
            if tuple(tokens[:n]) not in self.tree:
                break
            pids.append(self.tree[tuple(tokens[:n])])
        return pids

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=14))
    def request(self, tokens):
        """A new request: share its longest cached prefix (leaving one token to compute), compute the rest."""
        m = self.cache.match(tokens, max_tokens=len(tokens) - 1)
        assert m.pids.tolist() == self._model_match(tokens[:len(tokens) - 1])
        seq = self.next_seq
        self.next_seq += 1
        self.table.add_sequence(seq, m.pids, m.n_tokens)
        self.tokens[seq] = list(tokens[:m.n_tokens])
        if not self._append(seq, list(tokens[m.n_tokens:])):
            self.table.free(seq)
            del self.tokens[seq]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def insert(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        toks, pids = self.tokens[seq], self.table.pages(seq)
        added = self.cache.insert(toks, pids)
        new = 0
        for i in range(len(toks) // P):
            key = tuple(toks[:(i + 1) * P])
            if key not in self.tree:
                self.tree[key] = int(pids[i])
                new += 1
        assert added == new

    @rule(tokens=st.lists(st.integers(0, 2), min_size=0, max_size=14))
    def match(self, tokens):
        m = self.cache.match(tokens)
        assert m.pids.tolist() == self._model_match(tokens) and m.n_tokens == P * m.pids.size

    @rule(n=st.integers(1, 4))
    def evict(self, n):
        held = Counter(p for s in self.table.seqs.values() for p in s.pids)
        free_prefixes = [k for k, v in self.tree.items()
                         if not any(held[pid] for kk, pid in self.tree.items() if kk[:len(k)] == k)]
        assert self.cache.evictable() == len(free_prefixes)
        freed = self.cache.evict(n)
        assert len(freed) == min(n, len(free_prefixes))
        for pid in freed:
            self._forget(pid)
            assert self.table.ref[pid] == 0

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        """A second branch of a running sequence (e.g. n > 1 sampling): its partial last page is shared
        until either branch writes it."""
        src = data.draw(st.sampled_from(sorted(self.tokens)))
        dst = self.next_seq
        self.next_seq += 1
        self.table.fork(src, dst)
        self.tokens[dst] = list(self.tokens[src])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def decode(self, data, new):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self._append(seq, new)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def finish(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.table.free(seq)
        del self.tokens[seq]

    @invariant()
    def sequences_read_their_own_kv(self):
        for seq, toks in self.tokens.items():
            if not toks:
                continue
            want = kv_of(toks, 0)
            for layer in range(LAYOUT.num_layers):
                assert torch.equal(read_tokens(self.table, layer, seq), want[layer])

    @invariant()
    def tree_pages_unchanged(self):
        for prefix, pid in self.tree.items():
            want = kv_of(list(prefix), len(prefix) - P)  # [L, 2, P, 1, D]
            for layer in range(LAYOUT.num_layers):
                t, slot = self.table.locate(layer, np.array([pid]))
                got = self.tiers[t[0]].read(layer, torch.from_numpy(slot))[0]  # [2, P, 1, D]
                assert torch.equal(got, want[layer])

    @invariant()
    def no_leak(self):
        holders = Counter(p for s in self.table.seqs.values() for p in s.pids)
        holders.update(self.tree.values())
        assert self.cache.num_pages == len(self.tree)
        live = self.table.live_pids()
        assert set(live.tolist()) == set(holders)
        for pid, n in holders.items():
            assert self.table.ref[pid] == n
        for layer in range(LAYOUT.num_layers):
            assert sum(t.num_used(layer) for t in self.tiers) == live.size


def test_radix_against_dict_model():
    RadixMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
    RadixMachine.TestCase("runTest").runTest()


def test_policy_orders_eviction():
    """With a policy, the leaf the policy ranks lowest goes first (LRU: the one attended longest ago)."""
    table = BlockTable(LAYOUT, [DeviceTier(LAYOUT, 8, device="cpu")])
    policy = LRU()
    policy.reset(LAYOUT.num_layers)
    cache = RadixCache(table, policy)
    for seq, tok in enumerate((1, 2)):
        table.add_sequence(seq)
        table.append(seq, P)
        policy.on_append(table.pages(seq), step=0)
        cache.insert([tok] * P, table.pages(seq))
        table.free(seq)
    a, b = cache.match([1] * P).pids[0], cache.match([2] * P).pids[0]  # b is the more recently matched
    policy.on_access(0, np.array([a]), step=5)
    policy.on_access(1, np.array([a]), step=5)
    policy.on_access(0, np.array([b]), step=3)  # b's layer 0 was attended before any layer of a
    policy.on_access(1, np.array([b]), step=9)
    assert cache.evict(1) == [int(b)]
