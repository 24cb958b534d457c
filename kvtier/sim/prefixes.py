"""A cluster's prefix lookups: where a request's leading blocks are, seen from one instance (its HBM prefix cache,
its lower tiers, the KV pool shared by every instance), whether reading them into its HBM beats recomputing them,
and where a prefilled prompt's blocks are kept. The caches are :mod:`kvtier.sim.pool`'s; the router
(:mod:`kvtier.sim.routing`) weighs each instance by :meth:`Prefixes.plan`; the cluster performs the reads.
"""

from __future__ import annotations

from kvtier.serve.trace import BLOCK
from kvtier.sim.hardware import Link
from kvtier.sim.pool import Holders, Tiers
from kvtier.sim.workload import SimRequest


def prefix_blocks(req: SimRequest) -> tuple:
    """The blocks of ``req``'s prompt a cache can serve (its last token is always computed)."""
    return req.blocks[:(req.prompt - 1) // BLOCK]


def hbm_hit(inst, req: SimRequest) -> int:
    """The leading run of ``req``'s blocks in the HBM prefix cache of ``inst`` (0 without one)."""
    return inst.tiers.caches[0].match(prefix_blocks(req)) if inst.tiers is not None else 0


class Prefixes:
    """The prefix caches of a cluster together: ``holders``, the front instances' HBM caches (a bit each), and the
    shared pool of tiers ``levels`` (fastest first, none: no pool), each read over its link or else the ``nic``."""

    def __init__(self, holders: Holders, levels: tuple = (), nic: Link | None = None):
        self.holders, self.levels, self.nic = holders, levels, nic
        self.pool = Tiers(list(levels)) if levels else None

    def hbm_runs(self, req: SimRequest) -> list[int]:
        """Per front instance, the leading run of ``req``'s blocks in its HBM prefix cache."""
        return self.holders.runs(prefix_blocks(req))

    def pooled(self, req: SimRequest) -> list[int]:
        """Per level of the shared pool, the blocks of ``req``'s leading run there (none without a pool)."""
        return self.pool.match(prefix_blocks(req)) if self.pool is not None else []

    def plan(self, inst, req: SimRequest, now: float, pooled: list[int], hbm: int | None = None) -> tuple:
        """Where ``req``'s leading blocks are seen from ``inst``: its HBM, its lower tiers (read over their link),
        then ``pooled`` (:meth:`pooled`: what the shared pool holds, read over the NIC); whether reading the ones
        not in its HBM beats recomputing them. ``(estimated TTFT s, inst, prefix blocks, loads)``, loads
        ``[(source, blocks, link, over its own host link)]``; ``hbm``: the prompt's leading run in its HBM, when the
        caller has it (:meth:`hbm_runs`)."""
        loads = []
        hbm = hbm_hit(inst, req) if hbm is None else hbm
        reach = hbm
        if len(inst.spec.prefix) > 1:
            local = inst.tiers.match(prefix_blocks(req), hbm)
            for tier, k in zip(inst.spec.prefix[1:], local[1:]):
                if k:
                    loads.append((tier.name, k, tier.link, True))
            reach = sum(local)
        pool = sum(pooled)
        if pool > reach:  # the pool's run goes further: its blocks past ours, from its levels in proportion
            for tier, k in zip(self.levels, pooled):
                take = round((pool - reach) * k / pool)
                if take:
                    loads.append((f"pool {tier.name}", take, tier.link or self.nic, False))
            reach = pool
        load_s = 0.0
        for _, k, link, own in loads:
            free = inst.host_free_s if own else inst.ingress_free_s
            load_s = max(load_s, max(free - now, 0.0) + link.seconds(k * inst.block_bytes))
        if loads and load_s * 1e3 < (reach - hbm) * BLOCK * inst.token_ms:
            return (inst.queued + req.prompt - reach * BLOCK) * inst.token_ms / 1e3 + load_s, inst, reach, loads
        return (inst.queued + req.prompt - hbm * BLOCK) * inst.token_ms / 1e3, inst, hbm, ()

    def keep(self, inst, req: SimRequest) -> int:
        """A prefilled prompt's whole blocks enter the first tier of ``inst`` and the pool; the blocks new to the
        pool."""
        full = req.blocks[:req.prompt // BLOCK]
        if inst.tiers is not None:
            inst.tiers.touch(full)
        if self.pool is None:
            return 0
        new = len(full) - self.pool.caches[0].match(full)
        self.pool.touch(full)
        return max(new, 0)
