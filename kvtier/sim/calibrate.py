"""Regenerate a calibration from bench JSONs: ``python -m kvtier.sim.calibrate --bench bench --out FILE``.

Measured rates are read as they are; each parameter group of :data:`~kvtier.sim.calibration.PARAMS` is fitted
(least squares on relative error) on its anchor rows, with :func:`kvtier.sim.validate.predict`, the function
validation uses, so the fit and the prediction cannot disagree about the formulas.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from kvtier.sim.calibration import DEFAULT, PARAMS, Calibration
from kvtier.sim.measured import Measured, measured_rows, read_bench
from kvtier.sim.validate import predict

GPU_NAMES = {"NVIDIA H200": "H200", "NVIDIA H100 80GB HBM3": "H100"}


def anchors_of(rows: list[Measured]) -> dict:
    """The rows each group is fitted on: all-HBM decode rows; the Llama-shape resident rows (the real SmolLM2 ones
    are held out); every topk row (its cost does not follow k, nor a model's shape: both models are needed to fit
    it, so none is held out); the serve decode-only row; the serve cold, radix-hit and one-session TTFTs."""
    def ids(pred):
        return [r.id for r in rows if pred(r)]
    return {
        "decode": ids(lambda r: r.kind == "decode" and r.case["scope"] == "all"),
        "tiered": ids(lambda r: r.kind == "decode" and r.case["scope"] == "resident" and r.case["model"] != "smollm2"),
        "recall": ids(lambda r: r.kind == "decode" and r.case["scope"] == "topk"),
        "serve": ids(lambda r: r.kind == "mixed" and not r.case["chunk"]),
        "prefill": ids(lambda r: r.id.startswith("serve") and r.kind == "prefill"),
    }


def fit_group(cal: Calibration, group: str, rows: list[Measured]) -> None:
    """Set ``cal.params[group]`` to the least-squares fit (relative error) of ``rows``' times; the prediction is
    linear in the group's parameters, so each column is the prediction with one parameter at 1, the rest at 0."""
    keys = PARAMS[group]
    y = np.array([r.ms for r in rows])

    def at(values):
        cal.params[group] = dict(zip(keys, values))
        return np.array([predict(r, cal) for r in rows])

    base = at([0.0] * len(keys))
    X = np.stack([at([float(i == j) for j in range(len(keys))]) - base for i in range(len(keys))], 1)  # [rows, p]
    theta = np.linalg.lstsq(X / y[:, None], (y - base) / y, rcond=None)[0]
    at(theta.tolist())


def attention_line(kernels: dict, kv: str) -> dict:
    """The decode kernel's ms = a + bytes / rate over every cell of ``kv`` (graph replay where measured)."""
    cells = [r for r in kernels["decode_grid"] if r["kv"] == kv]
    y = np.array([r["graph_ms"].get("triton", r["triton_ms"]) for r in cells])
    X = np.array([[1.0, r["kv_bytes"] / 1e6] for r in cells])
    a, per_MB = np.linalg.lstsq(X / y[:, None], np.ones_like(y), rcond=None)[0]
    return {"ms": float(a), "GBps": float(1 / per_MB)}  # 1 MB/ms = 1 GB/s


def pick_churn(e2e: dict) -> float:
    """1 - hit rate of the real SmolLM2's topk rows (its recall cache holds as many pages as the step picks), mean
    over them: the share of each step's picks that the previous steps' picks did not cover."""
    rows = [r for r in e2e["rows"] if r["model"] == "smollm2" and r.get("scope") == "topk"
            and r.get("recall_slots") and r["budget"] < 0.5]
    return float(np.mean([1 - r["hit_rate"] for r in rows]))


def calibrate(folder: str | Path) -> Calibration:
    """A calibration from the bench JSONs in ``folder`` (:data:`kvtier.sim.measured.BENCH_FILES`)."""
    b = read_bench(folder)
    copies: dict = {}
    for r in b["transfers"]["rows"]:
        copies.setdefault(r["method"], []).append([r["page_KiB"], r["pages"], r["h2d_GBps"]])
    redis = next(r for r in b["redis"]["rows"] if r["path"] == "RedisTier batched" and r["op"] == "read")
    cal = Calibration(
        gpu=GPU_NAMES.get(b["e2e"]["gpu"], b["e2e"]["gpu"]), hbm_GBps=b["e2e"]["hbm_read_GBps"],
        bf16_tflops=b["serve"]["tflops"], host_GBps=min(b["transfers"]["ceiling"].values()), page_copy_GBps=copies,
        nccl_GBps=b["disagg"]["prefill"]["link_GBps"], redis_read_GBps=redis["GB/s"],
        attention={kv: attention_line(b["kernels"], kv) for kv in ("bf16", "fp8")},
        pick_churn=pick_churn(b["e2e"]), source=str(folder))
    rows = measured_rows(b)
    cal.anchors = anchors_of(rows)
    for group in PARAMS:
        fit_group(cal, group, [r for r in rows if r.id in cal.anchors[group]])
    return cal


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m kvtier.sim.calibrate", description=__doc__.splitlines()[0])
    p.add_argument("--bench", default="bench", help="folder of the bench JSONs")
    p.add_argument("--out", default=str(DEFAULT), help="calibration file to write")
    a = p.parse_args(argv)
    calibrate(a.bench).save(a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
