"""Randomized alloc / append / fork / migrate / free / salience / scheduler steps against a plain-dict model.

The default suite runs it short; ``-m nightly`` runs >= 10^5 operations.
"""

import tempfile
import time
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from kvtier import BlockTable, KVLayout
from kvtier.errors import KVTierError, TierFullError
from kvtier.mover.paged_io import read_tokens, write_tokens
from kvtier.policies import ASPE
from kvtier.scheduler import LookaheadScheduler
from kvtier.mover import TransferEngine
from kvtier.tiers import DeviceTier, DiskTier, HostTier

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_size=4, dtype="bfloat16")


class TableMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    def __init__(self):
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory()
        self.tiers = [DeviceTier(LAYOUT, 6, device="cpu"), HostTier(LAYOUT, 8),
                      DiskTier(LAYOUT, 64, self.tmp.name)]
        self.table = BlockTable(LAYOUT, self.tiers)
        self.transfer = TransferEngine(self.table)
        self.model: dict[int, torch.Tensor] = {}  # seq -> [L, 2, S, N_kv, D]
        self.next_id = 0
        self.policy = ASPE(sinks=4, window=8, obs_window=3)
        self.policy.reset(LAYOUT.num_layers)
        self.scheduler = LookaheadScheduler()
        self.step = 0

    def teardown(self):
        for t in self.tiers:
            t.close()
        self.tmp.cleanup()

    @rule(target=seqs)
    def add(self):
        seq = self.next_id
        self.next_id += 1
        self.table.add_sequence(seq)
        self.model[seq] = torch.empty(LAYOUT.num_layers, 2, 0, 2, 4, dtype=LAYOUT.dtype)
        return seq

    @rule(seq=seqs, n=st.integers(1, 9))
    def append(self, seq, n):
        if seq not in self.model:
            return
        start = self.table.seq_len(seq)
        try:
            self.table.append(seq, n)
        except TierFullError:
            # nothing half-done: the table must be as before
            assert self.table.seq_len(seq) == start
            return
        kv = torch.randn(LAYOUT.num_layers, 2, n, 2, 4).to(LAYOUT.dtype)
        for layer in range(LAYOUT.num_layers):
            write_tokens(self.table, layer, seq, kv[layer], start)
        self.model[seq] = torch.cat([self.model[seq], kv], dim=2)

    @rule(target=seqs, src=seqs)
    def fork(self, src):
        if src not in self.model:
            return -1
        dst = self.next_id
        self.next_id += 1
        self.table.fork(src, dst)
        self.model[dst] = self.model[src].clone()
        return dst

    @rule(data=st.data(), layer=st.integers(0, 1), dst=st.integers(0, 2))
    def migrate(self, data, layer, dst):
        live = self.table.live_pids()
        if live.size == 0:
            return
        pids = data.draw(st.lists(st.sampled_from(live.tolist()), min_size=1, max_size=5, unique=True))
        try:
            self.transfer.migrate(layer, pids, dst)
        except TierFullError:
            pass

    @rule(data=st.data(), reserve=st.integers(0, 2))
    def salience_and_schedule(self, data, reserve):
        live = self.table.live_pids()
        self.step += 1
        self.policy.on_step(self.step)
        if live.size:
            for layer in range(LAYOUT.num_layers):
                scores = np.asarray(data.draw(st.lists(st.floats(0, 0.5), min_size=live.size, max_size=live.size)),
                                    dtype=np.float32)
                self.policy.on_salience(layer, live, np.stack([scores, scores / 2], 1), self.step)
        try:
            plan = self.scheduler.plan(self.table, self.policy, self.step, reserve=reserve)
            for move in plan.moves:  # demotions first: they make the room
                self.transfer.migrate_many(move.layers, move.pids, move.dst)
        except TierFullError:
            return
        for layer in range(LAYOUT.num_layers):
            assert self.tiers[0].num_used(layer) <= self.tiers[0].capacity

    @rule(seq=consumes(seqs))
    def free(self, seq):
        if seq not in self.model:
            return
        self.table.free(seq)
        del self.model[seq]

    @invariant()
    def contents_match(self):
        TableMachine.ops += 1  # invariants run once after every operation
        for seq, kv in self.model.items():
            for layer in range(LAYOUT.num_layers):
                got = read_tokens(self.table, layer, seq)
                assert torch.equal(got.view(torch.int16), kv[layer].view(torch.int16))

    @invariant()
    def no_leak_no_double_use(self):
        holders = Counter(p for s in self.table.seqs.values() for p in s.pids)
        live = self.table.live_pids()
        assert set(live.tolist()) == set(holders)
        for pid, n in holders.items():
            assert self.table.ref[pid] == n
        for layer in range(LAYOUT.num_layers):
            for t, tier in enumerate(self.tiers):
                here = live[self.table.tier_of[layer, live] == t]
                slots = self.table.slot_of[layer, here]
                assert len(set(slots.tolist())) == slots.size  # no slot shared by two pages
                assert sorted(slots.tolist()) == sorted(tier.allocated_slots(layer).tolist())


TableMachine.ops = 0


def test_stateful_short():
    TableMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
    TableMachine.TestCase("runTest").runTest()


@pytest.mark.nightly
def test_stateful_long():
    """>= 10^5 operations (2,200 machines of up to 60 steps)."""
    from hypothesis.stateful import run_state_machine_as_test

    start, t0 = TableMachine.ops, time.time()
    run_state_machine_as_test(TableMachine, settings=settings(max_examples=2200, stateful_step_count=60,
                                                              deadline=None))
    ops = TableMachine.ops - start
    print(f"stateful: {ops} operations in {time.time() - t0:.0f} s")
    assert ops >= 100_000


def test_a_tier_refuses_a_bad_free_and_keeps_its_slots():
    """Freeing a slot twice in one call, or one never allocated, raises before anything is freed."""
    layout = KVLayout(num_layers=3, num_kv_heads=1, head_dim=4, page_size=4, dtype="float32")
    tier = DeviceTier(layout, 6, device="cpu")
    layers = np.array([0, 0, 1, 2, 2])
    slots = tier.alloc(layers).numpy()  # [5]
    before = [tier.num_free(layer) for layer in range(3)]
    for bad_layers, bad_slots in ((np.array([0, 0]), slots[[0, 0]]),  # the same slot of layer 0 twice
                                  (np.array([1]), np.array([(slots[2] + 1) % 6]))):  # not allocated
        with pytest.raises(KVTierError, match="not allocated"):
            tier.free(bad_layers, torch.from_numpy(bad_slots))
        assert [tier.num_free(layer) for layer in range(3)] == before
    tier.free(layers, torch.from_numpy(slots))  # each once: all back
    assert [tier.num_free(layer) for layer in range(3)] == [6, 6, 6]
    assert sorted(tier.alloc(np.zeros(6, dtype=np.int64)).tolist()) == list(range(6))
