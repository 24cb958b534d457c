"""Regenerate a calibration from bench JSONs: ``python -m kvtier.sim.calibrate --bench bench/results --gpu H100 --out FILE``.

Hardware rates are read as measured (:func:`kvtier.sim.measured.hardware_rates`, and the H200 host's link
benches). kvtier's engine parameters (:data:`~kvtier.sim.calibration.PARAMS`) are fitted on the kind's anchor
rows, the rows :mod:`kvtier.sim.split` does not hold out, in three stages: the decode group, then recall, then
prefill and serving together (a serve TTFT pays the scheduler's step, an ITL beside a chunk pays the chunk).
Each stage is least squares on relative error with :func:`kvtier.sim.measured.predict`, the function validation
uses, so the fit and the prediction cannot disagree about the formulas; a parameter the fit drives below zero is
held at zero and the rest refitted.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from kvtier.sim.calibration import NOISE_Z99, PARAMS, SHIPPED, Calibration
from kvtier.sim.hardware import ALLREDUCE_LATENCY_US
from kvtier.sim.measured import BENCH_DIR, Measured, hardware_rates, measured_rows, predict, read_json

STAGES = (("decode",), ("recall",), ("prefill", "serving"))


def fit(cal: Calibration, groups: tuple[str, ...], rows: list[Measured]) -> None:
    """Set the parameters of ``groups`` to the least-squares fit (relative error) of ``rows``' times; the
    prediction is affine in them, so each column is the prediction with one parameter at 1, the rest at 0."""
    keys = [(g, k) for g in groups for k in PARAMS[g]]
    y = np.array([r.ms for r in rows])

    def at(values) -> np.ndarray:
        for (g, k), v in zip(keys, values):
            cal.params[g][k] = float(v)
        return np.array([predict(r, cal) for r in rows])

    base = at(np.zeros(len(keys)))
    X = np.stack([at(np.eye(len(keys))[i]) - base for i in range(len(keys))], 1)  # [rows, params]
    free = np.ones(len(keys), bool)
    while True:
        theta = np.zeros(len(keys))
        theta[free] = np.linalg.lstsq(X[:, free] / y[:, None], (y - base) / y, rcond=None)[0]
        if (theta >= 0).all():
            break
        free &= theta > 0  # a cost below zero is no cost: hold it at 0, refit the rest
    at(theta)


def attention_lines(kernels: dict) -> dict:
    """Per KV dtype, the decode kernel's ms = a + bytes / rate over the kernel grid's cells (graph replay)."""
    out = {}
    for kv in ("bf16", "fp8"):
        cells = [r for r in kernels["decode_grid"] if r["kv"] == kv]
        y = np.array([r["graph_ms"].get("triton", r["triton_ms"]) for r in cells])
        X = np.array([[1.0, r["kv_bytes"] / 1e6] for r in cells])
        a, per_MB = np.linalg.lstsq(X / y[:, None], np.ones_like(y), rcond=None)[0]
        out[kv] = {"ms": float(a), "GBps": float(1 / per_MB)}  # 1 MB/ms = 1 GB/s
    return out


def pick_statistics(topk_hits: dict) -> dict:
    """Of the recall cache's picks on the real SmolLM2 (its run with a cache as big as the picks): ``churn``, the
    share of a step's picks the last step did not pick (1 - the LRU hit rate at that size), and ``reuse``, the
    share of those picked before in the run (1 - first picks / churn)."""
    r = next(r for r in topk_hits["rows"] if r["recall_slots"] == r["topk_pages"])
    churn = 1 - r["lru_hit_rate"]
    return {"churn": churn, "reuse": 1 - (1 - r["unbounded_hit_rate"]) / churn, "memory": topk_hits["args"]["steps"],
            "pages": r["topk_pages"], "context": topk_hits["args"]["context"]}


def allreduce_line(folder: Path, nccl_send_GBps: float) -> dict:
    """The all-reduce's alpha-beta line (:func:`kvtier.sim.hardware.allreduce_s`): ``bench.collectives``' fit over
    the largest GPU group it ran (``collectives.json``), or, where it has not run, the assumed latency
    (:data:`~kvtier.sim.hardware.ALLREDUCE_LATENCY_US`) at the measured NCCL send rate, ``source`` naming which."""
    path = folder / "collectives.json"
    if not path.exists():
        return {"latency_us": ALLREDUCE_LATENCY_US, "bus_GBps": nccl_send_GBps,
                "source": f"assumption: {ALLREDUCE_LATENCY_US:g} us, bus at the NCCL send rate (no {path.name}: "
                          "python -m bench.collectives on a multi-GPU host measures both)"}
    d = read_json(path)
    line = max(d["fits"], key=lambda f: f["gpus"])
    return {"latency_us": line["latency_us"], "bus_GBps": line["bus_GBps"],
            "source": f"measured: {path.name}, {line['gpus']} x {d['device']}"}


def calibrate(folder: str | Path, kind: str) -> Calibration:
    """A calibration of ``kind`` from the bench JSONs in ``folder``."""
    folder = Path(folder)

    def read(name: str) -> dict:
        return read_json(folder / name)
    transfers, disagg, redis, pool = (read(n) for n in ("transfers.json", "disagg.json", "redis_tier.json",
                                                        "mooncake_tier.json"))
    copies: dict = {}
    for r in transfers["rows"]:
        copies.setdefault(r["method"], []).append([r["page_KiB"], r["pages"], r["h2d_GBps"]])
    lines = attention_lines(read("kernels-s5.json"))

    def batched_read(tier: dict, path: str) -> float:
        return next(r["GB/s"] for r in tier["rows"] if r["path"] == path and r["op"] == "read")
    nccl = disagg["prefill"]["link_GBps"]
    cal = Calibration(gpu=kind, **hardware_rates(folder, kind), nvlink_GBps=nccl,
                      allreduce=allreduce_line(folder, nccl),
                      page_copy_GBps=copies, redis_read_GBps=batched_read(redis, "RedisTier batched"),
                      pool_read_GBps=batched_read(pool, "MooncakeTier batched"),
                      fp8_kv_x=lines["bf16"]["GBps"] / (2 * lines["fp8"]["GBps"]),
                      picks=pick_statistics(read("topk_hits-8k-s27.json")), source=str(folder))
    fit_engine(cal, measured_rows(folder, kind))
    return cal


def fit_engine(cal: Calibration, rows: list[Measured]) -> None:
    """Fit ``cal``'s engine parameters on the anchors of ``rows``; their step-time spread is its noise."""
    for groups in STAGES:
        fit(cal, groups, [r for r in rows if r.group in groups and not r.held_out])
    cal.anchors = {g: [r.id for r in rows if r.group == g and not r.held_out] for g in PARAMS}
    for g in PARAMS:
        spreads = [r.spread for r in rows if r.group == g and not r.held_out and r.spread > 1]
        cal.noise[g] = float(np.median(np.log(spreads)) / NOISE_Z99) if spreads else 0.0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m kvtier.sim.calibrate", description=__doc__.splitlines()[0])
    p.add_argument("--bench", default=BENCH_DIR, help="folder of the bench JSONs")
    p.add_argument("--gpu", default="H100", choices=sorted(SHIPPED), help="the GPU kind whose rows are fitted")
    p.add_argument("--out", default=None, help="calibration file to write (default: the shipped one of --gpu)")
    a = p.parse_args(argv)
    out = a.out or SHIPPED[a.gpu]
    calibrate(a.bench, a.gpu).save(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
