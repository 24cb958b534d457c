"""Routing: which instance prefills a request.

- ``least_loaded``: the instance with the fewest tokens of work: prompt tokens queued, and the prompt and output
  tokens of the requests it decodes (the cache is not looked at).
- ``round_robin``: the instances in turn.
- ``cache_aware`` (Mooncake's conductor, Qin et al. FAST'25, sec. 6): the instance with the least estimated
  time to the first token: the prompt tokens queued there and the request's own uncached tokens at that
  instance's prefill rate, plus reading its cached prefix from where it is (that instance's own tiers, or the
  shared pool) over the link it crosses, after what is queued on that link.
"""

from __future__ import annotations

from itertools import count

from kvtier.errors import ConfigError

ROUTES = ("least_loaded", "round_robin", "cache_aware")


class Router:
    def __init__(self, policy: str = "least_loaded"):
        if policy not in ROUTES:
            raise ConfigError("router.policy", f"use one of {ROUTES}, got {policy!r}")
        self.policy = policy
        self._turn = count()

    def route(self, prefixes, front: list, req, now: float) -> tuple:
        """``(estimated TTFT s, instance, prefix blocks, loads)`` of the chosen ``front`` instance, as
        :meth:`kvtier.sim.prefixes.Prefixes.plan` gives it."""
        pooled = prefixes.pooled(req)
        if self.policy == "least_loaded":
            inst = min(front, key=lambda i: (i.queued + i.assigned, i.index))
            return prefixes.plan(inst, req, now, pooled)
        if self.policy == "round_robin":
            return prefixes.plan(front[next(self._turn) % len(front)], req, now, pooled)
        best = None
        for inst, hbm in zip(front, prefixes.hbm_runs(req)):  # in index order: the first of equal estimates wins
            plan = prefixes.plan(inst, req, now, pooled, hbm)
            if best is None or plan[0] < best[0]:
                best = plan
        return best
