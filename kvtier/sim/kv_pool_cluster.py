"""A cluster with a shared KV pool and cache-aware routing (Mooncake's store and conductor, Qin et al. FAST'25):
``gpus`` H100s as TP-``tp`` Llama-3-70B instances (FP8 KV pages, chunked prefill beside decode) serving a
Mooncake trace open loop, the trace tiled to ``requests`` (:func:`kvtier.sim.workload.trace_workload`) and its
arrivals scaled so that the prompts' prefill, uncached, would load the instances to ``load``.

Where a prompt's prefix KV can come from (``placement``):

- ``hbm``: each instance's own HBM prefix cache (``prefix_share`` of its KV room), nothing else;
- ``local``: that, then the instance's node's DRAM and SSD (read over its pinned host links, and the SSDs);
- ``pool``: the HBM cache, then one pool of every node's DRAM and SSD shared by all instances (read over the
  reading node's NIC);

and the ideal, one unbounded cache shared by all (:func:`kvtier.sim.workload.prefix_hit_ideal`). ``router``:
``least_loaded`` or ``cache_aware`` (:mod:`kvtier.sim.routing`). Sizes and links kvtier did not measure are the
assumptions of :mod:`kvtier.sim.setups`. ``python -m kvtier.sim.kv_pool_cluster --json PATH`` runs one
configuration (``--all``: every placement under both routers) and writes its figures and wall time.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier.errors import ConfigError
from kvtier.serve.trace import BLOCK
from kvtier.sim.calibration import Calibration, load_calibration
from kvtier.sim.cluster import Cluster, ClusterSpec, InstanceSpec
from kvtier.sim.hardware import Link
from kvtier.sim.pool import Tier
from kvtier.sim.routing import ROUTES
from kvtier.sim.setups import DRAM_KV_GIB, NIC_GBPS, SSD_GBPS, SSD_KV_GIB, kv_room_tokens, seed_costs
from kvtier.sim.workload import prefix_hit_ideal, trace_workload

PLACEMENTS = ("hbm", "local", "pool")
GPUS_PER_NODE = 8


@dataclass
class KVPoolCluster:
    cal: Calibration
    requests: int = 100_000
    gpus: int = 128
    tp: int = 8
    load: float = 0.8  # arrivals' prefill, uncached, over the instances' prefill capacity
    chunk: int = 8192
    prefix_share: float = 0.25  # of an instance's KV room held for its HBM prefix cache
    trace: str = "conversation"
    pool_GBps: float = NIC_GBPS  # per node; kvtier's own Mooncake tier measured cal.pool_read_GBps (TCP, one box)
    seed: int = 0

    def __post_init__(self):
        if self.gpus % self.tp or GPUS_PER_NODE % self.tp:
            raise ConfigError("cluster.tp", f"tp must divide a node's {GPUS_PER_NODE} GPUs and gpus ({self.gpus})")
        self.costs = seed_costs(self.cal, True, tp=self.tp, fp8_kv=True)
        self.room = kv_room_tokens(self.costs)
        self.instances = self.gpus // self.tp
        sample = trace_workload(self.trace, min(self.requests, 2000))
        prefill_s = float(np.mean([self.costs.prompt_ms(r.prompt, 0, self.chunk) for r in sample])) / 1e3
        self.rate = self.load * self.instances / prefill_s  # requests/s
        trace_rate = len(sample) / max(sample[-1].arrival_s, 1e-9)
        self.workload = trace_workload(self.trace, self.requests, self.rate / trace_rate)

    def spec(self, placement: str, router: str) -> ClusterSpec:
        if placement not in PLACEMENTS:
            raise ConfigError("placement", f"use one of {PLACEMENTS}, got {placement!r}")
        share = self.tp / GPUS_PER_NODE  # an instance's share of its node
        block = BLOCK * self.costs.token_bytes() * self.tp
        blocks = lambda gib: max(1, int(gib * 2**30 / block))  # noqa: E731
        hbm = Tier("HBM", max(1, int(self.room * self.prefix_share) // BLOCK))
        prefix, pool = (hbm,), ()
        if placement == "local":  # the instance's share of its node's DRAM and SSD, for it alone
            prefix += (Tier("DRAM", blocks(DRAM_KV_GIB * share), Link("host", self.cal.host_GBps * self.tp)),
                       Tier("SSD", blocks(SSD_KV_GIB * share), Link("ssd", SSD_GBPS * share)))
        elif placement == "pool":  # every node's DRAM and SSD, for all; an SSD read is also the SSDs' rate
            nodes = self.gpus / GPUS_PER_NODE
            pool = (Tier("DRAM", blocks(DRAM_KV_GIB * nodes)),
                    Tier("SSD", blocks(SSD_KV_GIB * nodes), Link("ssd", min(SSD_GBPS, self.pool_GBps) * share)))
        inst = InstanceSpec("both", self.costs, int(self.room * (1 - self.prefix_share)), max_batch=512,
                            token_budget=self.chunk, prefix=prefix)
        return ClusterSpec([inst] * self.instances, pool=pool, nic=Link("NIC", self.pool_GBps * share) if pool
                           else None, router=router)

    def run_one(self, placement: str = "pool", router: str = "cache_aware") -> dict:
        """One configuration's summary, with its wall and CPU seconds (simulation and summary)."""
        wall, cpu = time.perf_counter(), time.process_time()
        cluster = Cluster(self.spec(placement, router), self.workload, seed=self.seed)
        ledger = cluster.run()
        s = ledger.summary()
        return {"placement": placement, "router": router, **s, "rate_rps": self.rate,
                "iterations": sum(i.iters for i in ledger.instances), "events": cluster.q.popped,
                "wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}

    def run(self, out_dir: Path | None = None) -> dict:
        """Every placement under both routers, and the ideal cache's hit rate."""
        rows = [self.run_one(p, r) for p in PLACEMENTS for r in ROUTES if r != "round_robin"]
        return {"ideal_prefix_hit": prefix_hit_ideal(self.workload), "rows": rows}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m kvtier.sim.kv_pool_cluster", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--gpus", type=int, default=128)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--load", type=float, default=0.8)
    p.add_argument("--placement", default="pool", choices=PLACEMENTS)
    p.add_argument("--router", default="cache_aware", choices=ROUTES)
    p.add_argument("--pool-GBps", type=float, default=NIC_GBPS, help="pool reads per node, GB/s")
    p.add_argument("--all", action="store_true", help="every placement under both routers")
    p.add_argument("--calibration", default=None, help="H100 (default), H200 or a calibration JSON")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    wall, cpu = time.perf_counter(), time.process_time()
    scenario = KVPoolCluster(load_calibration(a.calibration), a.requests, a.gpus, a.tp, a.load,
                             pool_GBps=a.pool_GBps)
    built = {"workload_wall_s": time.perf_counter() - wall, "workload_cpu_s": time.process_time() - cpu}
    out = scenario.run() if a.all else {"ideal_prefix_hit": prefix_hit_ideal(scenario.workload),
                                        "rows": [scenario.run_one(a.placement, a.router)]}
    out |= built | {"requests": a.requests, "gpus": a.gpus, "tp": a.tp, "instances": scenario.instances,
                    "rate_rps": scenario.rate, "peak_rss_MiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                    / 1024}
    for r in out["rows"]:
        print(f"{r['placement']:5s} {r['router']:12s} prefix hit {r['prefix_hit']:.1%} (read {r['prefix_read']:.1%})"
              f"  TTFT p50 {r['ttft_p50_s']:.2f} s p99 {r['ttft_p99_s']:.2f} s  ITL p50 {r['itl_p50_ms']:.1f} ms "
              f"p99 {r['itl_p99_ms']:.1f} ms  {r['output_tok_s']:,.0f} tok/s  wall {r['wall_s']:.1f} s "
              f"(cpu {r['cpu_s']:.1f} s)")
    print(f"ideal shared cache: prefix hit {out['ideal_prefix_hit']:.1%}; workload built in "
          f"{out['workload_wall_s']:.1f} s; {a.requests:,} requests at {scenario.rate:.1f} req/s on {a.gpus} GPUs")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
