import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.policies import ASPE, LRU, PINNED, Compose, PageInfo, SinkWindow


def info(n_pages, seq_len, page=16, step=0):
    return PageInfo(np.arange(n_pages), np.arange(n_pages), np.full(n_pages, seq_len), page, step)


def test_sink_window_never_ranks_pins_below_others():
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(4, 64))
        seq_len = (n - 1) * 16 + int(rng.integers(1, 17))
        sinks, window = int(rng.integers(0, 40)), int(rng.integers(0, 200))
        pol = SinkWindow(sinks=sinks, window=window)
        pol.reset(3)
        i = info(n, seq_len)
        prio = np.broadcast_to(pol.priority(i), (3, n))
        pinned = i.in_sinks(sinks) | i.in_window(window)
        assert pinned[-1]  # the page being written is always pinned
        if sinks:
            assert pinned[0]
        if pinned.any() and (~pinned).any():
            assert prio[:, pinned].min() > prio[:, ~pinned].max()


def test_sink_window_exact_pages():
    pol = SinkWindow(sinks=4, window=32)
    pol.reset(1)
    prio = pol.priority(info(10, 160))[0]  # 10 full pages
    assert np.isinf(prio[[0, 8, 9]]).all() and np.isfinite(prio[1:8]).all()


def test_lru_orders_by_last_access():
    pol = LRU()
    pol.reset(2)
    pol.on_append(np.arange(5), step=0)
    for step, pid in enumerate([3, 1, 4, 0], start=1):
        pol.on_access(0, np.array([pid]), step)
    prio = pol.priority(info(5, 80))
    assert list(np.argsort(-prio[0], kind="stable")) == [0, 4, 1, 3, 2]
    assert (prio[1] == 0).all()  # layer 1 untouched since append


def planted_aspe(phi_values, **kw):
    pol = ASPE(sinks=4, window=16, obs_window=4, **kw)
    pol.reset(2)
    n = len(phi_values)
    pol.on_append(np.arange(n), step=0)
    for step in range(4):
        pol.on_step(step)
        for layer in range(2):
            scores = np.tile(np.asarray(phi_values, dtype=np.float32)[:, None] / 3, (1, 3))  # [n, 3 heads]
            pol.on_salience(layer, np.arange(n), scores, step)
    return pol


def test_aspe_demotes_lowest_phi_first_and_pins_sinks_window():
    phi = [0.01, 0.5, 0.02, 0.3, 0.05, 0.0002, 0.2, 0.9]
    pol = planted_aspe(phi, theta_evict=1e-3, theta_prefetch=1e-2)
    i = info(len(phi), 8 * 16)
    np.testing.assert_allclose(pol.phi(i.pids)[0], phi, rtol=1e-5)
    prio = pol.priority(i)
    assert prio[0, 0] == PINNED and prio[0, -1] == PINNED  # sink page, window page
    assert prio[0, 5] == -np.inf  # below theta_evict
    middle = np.arange(1, 7)
    ranked = middle[np.argsort(prio[0, middle])]
    assert list(ranked) == [5, 2, 4, 6, 3, 1]  # lowest Φ first
    assert pol.admit(i)[0].tolist() == [p > 1e-2 for p in phi]


def test_aspe_mean_over_observation_window_only():
    pol = ASPE(sinks=0, window=0, obs_window=2)
    pol.reset(1)
    pol.on_append(np.arange(2), 0)
    for step, s in enumerate([1.0, 0.2, 0.4]):
        pol.on_step(step)
        pol.on_salience(0, np.arange(2), np.array([[s], [s]]), step)
    np.testing.assert_allclose(pol.phi(np.arange(2))[0], [0.3, 0.3])  # steps 1 and 2 only


def test_aspe_per_layer_false_sums_layers():
    pol = planted_aspe([0.1, 0.2, 0.3], per_layer=False)
    np.testing.assert_allclose(pol.phi(np.arange(3))[0], [0.2, 0.4, 0.6], rtol=1e-5)


def test_compose_pins_from_one_rank_from_other():
    aspe = planted_aspe([0.5, 0.4, 0.3, 0.2, 0.1, 0.05])
    pol = Compose(rank=aspe, pins=[SinkWindow(sinks=40, window=0)])
    prio = pol.priority(info(6, 6 * 16 - 3))
    assert (prio[:, :3] == PINNED).all()  # pages 1, 2 pinned by SinkWindow's 40 sink tokens
    np.testing.assert_allclose(prio[:, 3], 0.2, rtol=1e-5)  # page 3 keeps ASPE's Φ
    assert pol.needs_salience and (pol.admit(info(6, 93))[0] == aspe.admit(info(6, 93))[0]).all()


@pytest.mark.parametrize("make,field", [
    (lambda: SinkWindow(window=-1), "policy.window"),
    (lambda: SinkWindow(sinks=-4), "policy.sinks"),
    (lambda: ASPE(window=-8), "policy.window"),
    (lambda: ASPE(obs_window=0), "policy.obs_window"),
    (lambda: ASPE(theta_evict=0.5, theta_prefetch=0.1), "policy.theta_evict"),
    (lambda: Compose(), "policy.rank"),
])
def test_bad_policy_config(make, field):
    with pytest.raises(ConfigError) as e:
        make()
    assert e.value.field == field
