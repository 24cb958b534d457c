"""Which pages a decode step finds in HBM: kvtier's own policy objects placing one long sequence's pages, fed
the statistics of a synthetic attention pattern.

:class:`AttentionPattern`: each step attends the sink pages, the recent window and ``k`` middle pages; a share
``churn`` of the middle picks is replaced every step, each replacement drawn from the pages picked in the last
``memory`` steps with probability ``reuse`` (attention returning to what it read before), else from any middle
page. kvtier measured both on its recall cache's own picks on the real SmolLM2 at 8k (bench.topk_hits:
churn = 1 - the hit rate of a cache as big as the picks, reuse = the share of the new picks an unbounded cache
held; :func:`kvtier.sim.calibrate.pick_statistics`); the scenarios read them from the calibration.

:func:`place` runs the policy as the cache does: ``on_step``, ``on_append`` for each new page, ``on_access`` and
``on_salience`` for the attended pages, then the scheduler keeps the ``hbm_pages`` best by ``priority`` (pages
off HBM only where ``admit``; ``-inf`` demoted even with room). A step's picks are looked up before its own
placement (the placement of step t serves step t + 1: a prefetch one step ahead).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtier.errors import ConfigError
from kvtier.policies.base import EVICT, PageInfo, Policy


@dataclass
class AttentionPattern:
    pages: int  # the sequence's pages at the first step
    k: int  # middle pages attended per step
    churn: float = 0.25  # share of the middle picks replaced per step
    reuse: float = 0.0  # probability a replacement is a page picked in the last `memory` steps
    memory: int = 64
    spread: float = 1.0  # sigma of the lognormal attention mass of an attended page (salience varies per step)
    sink_pages: int = 1
    window_pages: int = 4
    page_size: int = 16
    seed: int = 0

    def __post_init__(self):
        if not (0 <= self.churn <= 1 and 0 <= self.reuse <= 1):
            raise ConfigError("attention", f"churn and reuse must be in [0, 1], got {self.churn}, {self.reuse}")
        if not 0 < self.k <= self.pages - self.sink_pages - self.window_pages:
            raise ConfigError("attention.k", f"must be in [1, {self.pages - self.sink_pages - self.window_pages}]")


@dataclass
class Placement:
    hit_rate: float  # attended pages found in HBM / attended pages
    promoted_per_step: float  # pages moved into HBM per step / pages attended per step
    attended_per_step: float  # pages
    steps: int


def place(policy: Policy, pattern: AttentionPattern, hbm_pages: int, steps: int) -> Placement:
    """Run ``steps`` decode steps of one sequence (one new token each) with ``hbm_pages`` of HBM."""
    if hbm_pages < pattern.sink_pages + pattern.window_pages + 1:
        raise ConfigError("hbm_pages", f"must hold the sinks, the window and one page, got {hbm_pages}")
    rng, P = np.random.default_rng(pattern.seed), pattern.page_size
    n = pattern.pages
    policy.reset(1)
    policy.on_append(np.arange(n), 0)
    picks = rng.choice(np.arange(pattern.sink_pages, n - pattern.window_pages), pattern.k, replace=False)
    recent = [picks]
    in_hbm = np.zeros(n, bool)  # start warm: the sinks, the window and the current picks, then the newest pages
    in_hbm[np.concatenate([np.arange(pattern.sink_pages), picks, np.arange(n - pattern.window_pages, n)])] = True
    in_hbm[np.flatnonzero(~in_hbm)[::-1][:max(0, hbm_pages - int(in_hbm.sum()))]] = True
    hits = attended = promoted = 0
    for step in range(1, steps + 1):
        policy.on_step(step)
        length = n * P - P + 1 + step  # tokens; a new page every P steps
        if -(-length // P) > n:
            in_hbm = np.append(in_hbm, True)  # the page being written is always on the device
            policy.on_append(np.array([n]), step)
            n += 1
        picks = _next_picks(rng, pattern, picks, recent, np.arange(pattern.sink_pages, n - pattern.window_pages))
        seen = np.unique(np.concatenate([np.arange(pattern.sink_pages), picks,
                                         np.arange(n - pattern.window_pages, n)]))
        hits, attended = hits + int(in_hbm[seen].sum()), attended + seen.size
        mass = rng.lognormal(0.0, pattern.spread, seen.size)
        salience = (mass / mass.sum())[:, None]  # [n, N_kv = 1]: the step's attention mass per page
        policy.on_access(0, seen, step)
        policy.on_salience(0, seen, salience, step)
        keep = _placement(policy, n, P, step, in_hbm, hbm_pages, length)
        promoted += int((keep & ~in_hbm).sum())
        in_hbm = keep
        recent = (recent + [picks])[-pattern.memory:]
    return Placement(hits / attended, promoted / attended, attended / steps, steps)


def _next_picks(rng, pattern: AttentionPattern, picks: np.ndarray, recent: list, middle: np.ndarray) -> np.ndarray:
    """The step's middle picks: ``churn`` of the last ones replaced, from the recent picks (``reuse``) or anywhere."""
    out = picks.copy()
    swap = np.flatnonzero(rng.random(out.size) < pattern.churn)
    pool_recent = np.unique(np.concatenate(recent))
    for i in swap:
        pool = pool_recent if rng.random() < pattern.reuse else middle
        for _ in range(8):  # a page not already picked
            cand = pool[rng.integers(pool.size)]
            if cand not in out:
                out[i] = cand
                break
    return out


def _placement(policy: Policy, n: int, page_size: int, step: int, in_hbm: np.ndarray, room: int,
               length: int) -> np.ndarray:
    """The scheduler's choice: the ``room`` pages of best priority, off-HBM pages only if admitted."""
    info = PageInfo(pids=np.arange(n), logical=np.arange(n), seq_len=np.full(n, length), page_size=page_size, step=step)
    prio = np.asarray(policy.priority(info), dtype=np.float64).min(0)  # [n]
    admit = np.asarray(policy.admit(info)).all(0)
    prio = np.where(in_hbm | admit, prio, -np.inf)
    prio[n - 1] = np.inf  # the page being written
    order = np.argpartition(-prio, min(room, n) - 1)[:room]
    keep = np.zeros(n, bool)
    keep[order[prio[order] > EVICT]] = True
    return keep
