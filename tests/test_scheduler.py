import numpy as np
import pytest
import torch

from kvtier import BlockTable, KVLayout
from kvtier.errors import ConfigError, TierFullError
from kvtier.policies import ASPE, LRU, SinkWindow
from kvtier.scheduler import LookaheadScheduler
from kvtier.mover import TransferEngine
from kvtier.tiers import DeviceTier, HostTier

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_size=4, dtype="float32")


def make(device_pages, host_pages=64):
    table = BlockTable(LAYOUT, [DeviceTier(LAYOUT, device_pages, device="cpu"), HostTier(LAYOUT, host_pages)])
    return table, TransferEngine(table)


def step(table, transfer, sched, policy, s, reserve=1):
    plan = sched.plan(table, policy, s, reserve=reserve)
    for move in plan.moves:  # demotions first: they make the room
        transfer.migrate_many(move.layers, move.pids, move.dst)
    return plan


def device_pids(table, layer=0):
    return set(table.live_pids()[table.tier_of[layer, table.live_pids()] == 0].tolist())


@pytest.mark.parametrize("policy", [LRU(), SinkWindow(sinks=4, window=8), ASPE(sinks=4, window=8)])
def test_capacity_never_exceeded_and_pins_stay(policy):
    rng = np.random.default_rng(1)
    table, transfer = make(device_pages=6)
    policy.reset(LAYOUT.num_layers)
    sched = LookaheadScheduler()
    table.add_sequence(0)
    for s in range(120):
        policy.on_step(s)
        new, _ = table.append(0, int(rng.integers(1, 4)))
        policy.on_append(np.asarray(new, dtype=np.int64), s)
        pids = table.pages(0)
        for layer in range(LAYOUT.num_layers):
            acc = rng.choice(pids, size=min(3, pids.size), replace=False)
            policy.on_access(layer, acc, s)
            policy.on_salience(layer, pids, rng.random((pids.size, 2)).astype(np.float32) * 0.05, s)
        step(table, transfer, sched, policy, s)
        for layer in range(LAYOUT.num_layers):
            assert table.tiers[0].num_used(layer) <= 6
        if isinstance(policy, (SinkWindow, ASPE)):
            from kvtier.scheduler import page_info
            info = page_info(table, s)
            pinned = info.pids[np.isinf(np.broadcast_to(policy.priority(info), (2, info.pids.size))[0])
                               & (np.broadcast_to(policy.priority(info), (2, info.pids.size))[0] > 0)]
            assert set(pinned.tolist()) <= device_pids(table)


def test_pinned_pages_never_demoted_even_under_pressure():
    table, transfer = make(device_pages=4)
    pol = LRU()
    pol.reset(2)
    table.add_sequence(0)
    new, _ = table.append(0, 16)  # 4 pages fill the device
    table.set_pinned(new[:2])
    pol.on_append(np.asarray(new), 0)
    for s in range(1, 10):
        new2, _ = table.append(0, 4)
        pol.on_append(np.asarray(new2), s)
        step(table, transfer, LookaheadScheduler(), pol, s)
        assert {new[0], new[1]} <= device_pids(table)


def test_demoted_page_predicted_salient_is_promoted_back():
    table, transfer = make(device_pages=5)
    pol = ASPE(sinks=0, window=4, obs_window=2, theta_evict=1e-3, theta_prefetch=1e-2)
    pol.reset(2)
    sched = LookaheadScheduler()
    table.add_sequence(0)
    new, _ = table.append(0, 32)  # 8 pages, only 5 fit on the device
    pol.on_append(np.asarray(new), 0)

    def observe(s, hot):
        pol.on_step(s)
        scores = np.full((8, 2), 0.02, dtype=np.float32)
        scores[hot] = 0.4
        for layer in range(2):
            pol.on_salience(layer, table.pages(0), scores, s)

    observe(0, hot=1)
    step(table, transfer, sched, pol, 0, reserve=0)
    assert new[1] in device_pids(table)
    for s in range(1, 4):  # page 1 goes cold, page 3 hot
        observe(s, hot=3)
        pol.on_salience(0, np.array([new[1]]), np.zeros((1, 2), np.float32), s)
        pol.on_salience(1, np.array([new[1]]), np.zeros((1, 2), np.float32), s)
        step(table, transfer, sched, pol, s, reserve=0)
    assert new[1] not in device_pids(table) and new[3] in device_pids(table)
    for s in range(4, 7):  # page 1 predicted salient again: recalled
        observe(s, hot=1)
        step(table, transfer, sched, pol, s, reserve=0)
    assert new[1] in device_pids(table)
    assert transfer.pages_moved["host->device"] >= 2


def three_tiers(window: int, tokens: int):
    """A device of 3 pages, a host of 2 and a slow tier of 16; one sequence of ``tokens``; SinkWindow(0, window)."""
    table = BlockTable(LAYOUT, [DeviceTier(LAYOUT, 3, device="cpu"), HostTier(LAYOUT, 2, name="host"),
                                HostTier(LAYOUT, 16, name="slow")])
    pol = SinkWindow(sinks=0, window=window)
    pol.reset(2)
    table.add_sequence(0)
    table.append(0, tokens)
    return table, TransferEngine(table), pol


def test_demotion_cascades_to_lower_tier_when_full():
    table, transfer, pol = three_tiers(4, 12)
    for s in range(6):
        table.append(0, 4)
        step(table, transfer, LookaheadScheduler(), pol, s)
        for layer in range(2):
            assert table.tiers[0].num_used(layer) <= 3 and table.tiers[1].num_used(layer) <= 2
    assert transfer.pages_moved["host->slow"] > 0


def test_demotions_past_a_lower_tiers_room_go_further_down():
    """Eight pages fill a device of 3, a host of 2 and the tier below; the window moves to the last three pages.
    Three pages leave the device for a full host that holds only two: both go down, and so does the lowest-ranked
    of the three, straight from the device (the cascade raised TierFullError here before)."""
    table, transfer, pol = three_tiers(12, 32)
    pids = table.pages(0)
    assert table.tier_of[:, pids].tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]] * 2
    step(table, transfer, LookaheadScheduler(), pol, 0, reserve=0)
    assert table.tier_of[:, pids].tolist() == [[2, 1, 1, 2, 2, 0, 0, 0]] * 2
    assert dict(transfer.pages_moved) == {"host->slow": 4, "device->slow": 2, "device->host": 4, "slow->device": 6}


class Ranked(LRU):
    """Priorities fixed per logical page (higher first); every page may be promoted."""

    def __init__(self, by_page):
        super().__init__()
        self.by_page = np.asarray(by_page, dtype=float)

    def priority(self, info):
        return self.by_page[info.logical][None, :]

    def admit(self, info):
        return np.ones((1, info.pids.size), dtype=bool)


def test_a_swap_waits_when_the_host_is_full():
    """The device holds 5 of 8 pages and a full host the other 3; the policy now ranks two host pages above two
    device pages: the swap cannot happen (no host slot for the demoted pages), so the pages stay where they are
    (it raised TierFullError 'raise its capacity' before); with room for the reserve gone, it still raises."""
    table, transfer = make(device_pages=5, host_pages=3)
    table.add_sequence(0)
    table.append(0, 32)  # 8 pages
    first = Ranked([9, 8, 7, 6, 5, 4, 3, 2])  # pages 0-4 on the device, 5-7 on the host
    first.reset(2)
    step(table, transfer, LookaheadScheduler(), first, 0, reserve=0)
    pids = table.pages(0)
    assert device_pids(table) == set(pids[:5].tolist()) and table.tiers[1].num_free(0) == 0
    swap = Ranked([9, 8, 7, 1, 0, 6, 5, 2])  # pages 5 and 6 now above pages 3 and 4
    swap.reset(2)
    plan = step(table, transfer, LookaheadScheduler(), swap, 1, reserve=0)
    assert plan.num_pages() == 0 and device_pids(table) == set(pids[:5].tolist())
    with pytest.raises(TierFullError, match="raise its capacity"):
        LookaheadScheduler().plan(table, swap, 2, reserve=2)  # two device slots must be freed: nowhere to go


def test_bad_scheduler_config():
    with pytest.raises(ConfigError) as e:
        LookaheadScheduler(max_moves_per_step=0)
    assert e.value.field == "scheduler.placement.max_moves_per_step"


def test_order_ranks_is_the_flags_then_priority_order():
    """Each layer's place of a page: flags ascending, priority descending, ties to the earlier page (a lexsort),
    whether the priority is one row for every layer or one per layer, with equal and distinct layers."""
    from kvtier.scheduler.lookahead import order_ranks

    rng = np.random.default_rng(0)
    for _ in range(100):
        L, n = int(rng.integers(1, 6)), int(rng.integers(1, 40))
        rows = rng.integers(0, 4, (int(rng.choice([1, L])), n)).astype(float)  # ties on purpose
        rows[rng.random(rows.shape) < 0.1] = np.inf
        flags = rng.integers(0, 4, (L, n)).astype(np.int8)
        if rng.random() < 0.5:
            flags[:] = flags[0]
        prio = np.broadcast_to(rows, (L, n))
        for layer, rank in enumerate(order_ranks(rows, flags)):
            order = np.lexsort((np.arange(n), -prio[layer], flags[layer]))  # last key first
            assert (rank[order] == np.arange(n)).all()


def test_the_best_candidates_are_the_first_in_rank_order():
    """The plan's keep set, found by each row's k-th largest priority, equals ``cand & (rank < limit)`` from the
    full sort, with tied priorities, pinned pages (+inf or not), -inf non-candidates and limits above and below the
    count."""
    from kvtier.scheduler.lookahead import best_candidates, order_ranks

    rng = np.random.default_rng(1)
    for _ in range(300):
        u, n = int(rng.integers(1, 5)), int(rng.integers(1, 60))
        prio = rng.integers(0, 5, (u, n)).astype(float)  # ties on purpose
        prio[rng.random(prio.shape) < 0.1] = np.inf
        prio[rng.random(prio.shape) < 0.1] = -np.inf
        pinned = (rng.random((u, n)) < 0.2) | (prio == np.inf)
        cand = (rng.random((u, n)) < 0.8) & (prio > -np.inf)
        limit = rng.integers(0, n + 2, u)
        rank = order_ranks(prio, (2 * ~cand + ~pinned).astype(np.int8))
        assert (best_candidates(prio, cand, pinned, limit) == (cand & (rank < limit[:, None]))).all()


def test_layers_in_different_places_are_planned_apart_under_one_priority_row():
    """One priority row for every layer: layers whose pages sit alike are planned once, but a layer whose pages
    sit elsewhere (layer 1's best pages moved to the host by hand) gets its own plan: only it promotes them."""
    table, transfer = make(device_pages=5)
    table.add_sequence(0)
    table.append(0, 32)  # 8 pages
    policy = Ranked([9, 8, 7, 6, 5, 4, 3, 2])
    policy.reset(2)
    step(table, transfer, LookaheadScheduler(), policy, 0, reserve=0)
    pids = table.pages(0)
    best = set(pids[:4].tolist()) | {int(pids[-1])}  # and the page being written
    assert device_pids(table, 0) == device_pids(table, 1) == best
    assert LookaheadScheduler().plan(table, policy, 1, reserve=0).num_pages() == 0  # nothing to do in either layer
    transfer.migrate(1, pids[:2], 1)  # layer 1 only: its two best pages to the host
    plan = LookaheadScheduler().plan(table, policy, 2, reserve=0)
    assert not plan.demote
    assert [(sorted(set(m.layers.tolist())), sorted(m.pids.tolist())) for m in plan.promote] == \
        [([1], sorted(pids[:2].tolist()))]


def test_a_scheduler_without_the_ranking_fails_when_the_engine_is_built():
    """A placement scheduler written to the signature before the step's Ranking (plan(table, policy, step,
    reserve)) is named at construction, not met as a TypeError in the first step."""
    from kvtier.engine import Engine
    from kvtier.scheduler.base import MigrationPlan, Scheduler

    class Old(Scheduler):
        def plan(self, table, policy, step, reserve=0):
            return MigrationPlan(step)

    with pytest.raises(ConfigError) as e:
        Engine(None, LAYOUT, [DeviceTier(LAYOUT, 8, device="cpu"), HostTier(LAYOUT, 8)], LRU(), scheduler=Old())
    assert e.value.field == "scheduler.placement" and "ranking" in str(e.value)


def test_a_move_of_one_layer_names_it_once():
    """A scheduler (a user's too) may give a Move one layer for all its pids; the mover gets one per pid."""
    from kvtier.scheduler import Move
    from kvtier.scheduler.base import pairs

    move = Move(1, [3, 4], 0)
    layers, pids = pairs([move, Move(np.array([0]), np.array([5]), 0)])
    assert layers.tolist() == [1, 1, 0] and pids.tolist() == [3, 4, 5]
