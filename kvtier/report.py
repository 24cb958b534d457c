"""What a run reports: per-cache records, the metrics dict, metrics.json, and the loggers
(``console``: a rich table; ``wandb``: the table plus an offline W&B run inside the run folder;
``none``: nothing beyond metrics.json).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from kvtier.errors import ConfigError, KVTierError, MissingDependencyError
from kvtier.eval.fidelity import FidelityStats
from kvtier.metrics import percentile
from kvtier.redact import argv_redacted, redacted

WANDB_MODES = ("offline", "disabled")
SCORES = ("perplexity", "accuracy", "score", "goodput_rps")  # score: a benchmark's own 0-100 (RULER, LongBench)


@dataclass
class CacheRecord:
    """What one engine did, kept once the engine itself (and its page pools) is gone."""

    attended_pages: int
    resident_pages: int
    fetch_s: float
    fidelity_s: float  # time of the fidelity pass, left out of TTFT/TPOT
    fetched_bytes: dict  # link -> bytes copied to the device for attention
    migrated_bytes: dict  # link -> bytes moved by the scheduler
    migrated_pages: dict  # link -> pages moved by the scheduler
    occupancy: list  # [(step, {tier: pages in use, mean over layers})]
    offloaded_fraction: float  # live pages off the device at the end, mean over layers
    fidelity_calls: list  # FidelityStats.calls (empty unless the cache measured fidelity)
    dropped_pages: int = 0  # (layer, page)s freed for good, left of their sliding window
    dropped_bytes: int = 0
    attended_per_step: list = field(default_factory=list)  # keys attended per decode step (per layer, sequence)
    compressed_pages: int = 0  # (layer, page)s dropped by mode "once" at the end of the prefill
    ttft_s: list = field(default_factory=list)  # per prefilled sequence
    tpot_s: list = field(default_factory=list)  # per decode step
    recall_copied: int = 0  # pages the recall cache copied in after a layer read them from the host
    fetched_ahead: int = 0  # pages it copied in ahead of their layer (a predictor), ...
    predicted: int = 0  # ... of which the layer picked
    recall_landed: int = 0  # pages admitted from the landing slot the decode kernel wrote them to (no copy)
    kv_bytes_per_token: float = 0.0  # K/V page bytes a token takes (every layer)
    stats_bytes_per_token: float = 0.0  # device bytes of key statistics (the recall sketch) a stored token takes

    @classmethod
    def of(cls, cache) -> "CacheRecord":
        where = cache.table.tier_of[:, cache.table.live_pids()]  # [L, live]
        held = where[where >= 0]  # not dropped
        off = float((held != 0).mean()) if held.size else 0.0
        stats = cache.stats
        attended, resident = cache.page_counts()
        recall = getattr(cache, "recall", None)
        counts = [int(c) for c in (recall.copied, recall.prefetched, recall.predicted, recall.landed)] \
            if recall is not None else [0, 0, 0, 0]
        return cls(attended, resident, stats.fetch_s, stats.fidelity_s,
                   dict(stats.fetched_bytes), dict(cache.transfer.bytes_moved),  # apart: fetches, migrations
                   dict(cache.transfer.pages_moved), list(stats.occupancy), off,
                   list(cache.fidelity.calls) if cache.fidelity is not None else [], stats.dropped_pages,
                   stats.dropped_bytes, stats.attended_per_step(), stats.compressed_pages, list(cache.ttft_s),
                   list(cache.tpot_s), *counts, cache.kv_bytes_per_token, cache.stats_bytes_per_token)


def collect(plan, result: dict, records: list[CacheRecord], wall_s: float, cfg, run_dir) -> dict:
    """The run's metrics: identity, the task's score, systems figures over all caches, the config;
    ``partial`` is true when the run was interrupted, or stopped by a tier's ``fault`` (its error, else null),
    and the figures cover what finished."""
    tpot = [x for r in records for x in r.tpot_s]
    attended = sum(r.attended_pages for r in records)
    migrated, fetched, pages = Counter(), Counter(), Counter()
    for r in records:
        migrated.update(r.migrated_bytes)
        fetched.update(r.fetched_bytes)
        pages.update(r.migrated_pages)
    steps, series, offset = [], {}, 0
    for r in records:
        for step, occ in r.occupancy:
            steps.append(offset + step)
            for tier, n in occ.items():
                series.setdefault(tier, []).append(n)
        offset = steps[-1] + 1 if steps else offset
    return {
        **identity(plan, result, wall_s, cfg, run_dir), "capacity_pages": plan.capacities,
        "samples": result.get("samples", len(records)),
        "tier1_hit_rate": sum(r.resident_pages for r in records) / attended if attended else 1.0,
        "bytes_moved": dict(migrated + fetched), "bytes_moved_total": sum((migrated + fetched).values()),
        "bytes_migrated_total": sum(migrated.values()), "bytes_fetched_total": sum(fetched.values()),
        "pages_migrated": dict(pages),
        "dropped_pages": sum(r.dropped_pages for r in records), "dropped_bytes": sum(r.dropped_bytes for r in records),
        "compressed_pages": sum(r.compressed_pages for r in records),
        "recall_pages_copied": sum(r.recall_copied for r in records),
        "recall_pages_landed": sum(r.recall_landed for r in records),
        "pages_fetched_ahead": (ahead := sum(r.fetched_ahead for r in records)),
        "predictor_accuracy": sum(r.predicted for r in records) / ahead if ahead else float("nan"),
        "attended_tokens_per_step": _mean([x for r in records for x in r.attended_per_step]),
        "attended_tokens_per_step_max": max([x for r in records for x in r.attended_per_step], default=float("nan")),
        "offloaded_fraction": float(np.mean([r.offloaded_fraction for r in records])) if records else 0.0,
        "kv_bytes_per_token": records[0].kv_bytes_per_token if records else float("nan"),
        "stats_bytes_per_token": records[0].stats_bytes_per_token if records else float("nan"),
        "ttft_s": _mean([x for r in records for x in r.ttft_s]),
        "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
        "decode_steps": len(tpot), "stall_s": sum(r.fetch_s for r in records),
        "fidelity_s": sum(r.fidelity_s for r in records),
        "peak_pages": {tier: max(v) for tier, v in series.items()},
        **FidelityStats([c for r in records for c in r.fidelity_calls]).summary(),
        "occupancy": {"step": steps, "pages": series},
    }


def identity(plan, result: dict, wall_s: float, cfg, run_dir) -> dict:
    """What names and scores a run: its labels and ``method`` (:func:`method_of`, or ``kvpress:<press>``), the task's
    score, the budget, the wall time, the task's result and the config."""
    from omegaconf import OmegaConf

    score = next(k for k in SCORES if k in result)
    return {
        **plan.labels, "method": plan.labels.get("method") or method_of(plan.labels["scope"], plan.labels["policy"],
                                                                         cfg.cache),
        "task": result["task"], "run_name": Path(run_dir).name, "partial": result.get("partial", False),
        "fault": result.get("fault"), "score_name": score, score: result[score], "budget_tokens": plan.budget_tokens,
        "budget_fraction": plan.budget_fraction, "context_tokens": result["context_tokens"],
        "samples": result.get("samples"), "wall_s": wall_s, "task_result": result,
        "config": redacted(OmegaConf.to_container(cfg, resolve=True)),  # no password of a store URL
    }


def method_of(scope: str, policy: str, cache) -> str:
    """A kvtier run's method as ``bench.policy_study`` names its configurations: ``exact`` (scope all, the full
    cache), else ``<scope>:<policy>``, ``once:<policy>`` where the budget compresses once after the prefill
    (``cache.mode``)."""
    if scope == "all":
        return "exact"
    once = cache.get("attend_budget") and cache.get("mode") == "once"
    return f"{'once' if once else scope}:{policy}"


def _mean(values: list) -> float:
    return float(np.mean(values)) if values else float("nan")


def write_json(metrics: dict, path: Path) -> Path:
    """Write ``metrics`` to ``path`` atomically (a temporary file, synced, renamed; removed if the write
    fails); NaN and inf become null (strict JSON)."""
    path = Path(path)
    tmp = path.with_suffix(".json.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(_finite(metrics), indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:  # a full disk, a killed write: no truncated file left behind
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise KVTierError(f"cannot write {path} ({e.strerror or e}); free space there, or run elsewhere") from e
        raise
    return path


def _finite(x):
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def metrics_table(m: dict) -> Table:
    """The headline figures as a two-column rich table."""
    t = Table(title=f"kvtier · {m['task']} · {m['policy']} · scope {m['scope']} · {m['tiers']} · {m['kernel']}")
    t.add_column("metric", style="bold")
    t.add_column("value", justify="right")
    score, serving = m[m["score_name"]], m["score_name"] == "goodput_rps"
    engine = not serving and "tier1_hit_rate" in m  # a kvpress run has no engine, tiers nor pages
    t.add_row(m["score_name"], f"{score:.4f}" if m["score_name"] == "perplexity" else
              f"{score:.3f} req/s" if serving else f"{score:.2f} / 100" if m["score_name"] == "score" else
              f"{score:.1%}")
    for group, value in m.get("task_result", {}).get("per_group", {}).items():  # a benchmark's subtasks or datasets
        t.add_row(f"  {group}", f"{value:.2f}")
    if serving:
        _serving_rows(t, m["task_result"])
    t.add_row("budget", f"{m['budget_tokens']} tokens ({m['budget_fraction']:.2f} of {m['context_tokens']:g})")
    if "kept_tokens" in m:
        t.add_row("KV pairs kept per layer (kvpress)", f"{m['kept_tokens']:g}")
    if engine:  # a serve_trace run's cache figures are its engine's, in its rows above
        t.add_row("tier-1 hit rate", f"{m['tier1_hit_rate']:.1%}")
        if np.isfinite(m.get("attended_tokens_per_step", float("nan"))):
            t.add_row("keys attended per decode step mean / max", f"{m['attended_tokens_per_step']:.1f} / "
                                                                   f"{m['attended_tokens_per_step_max']:g}")
        t.add_row("offloaded fraction", f"{m['offloaded_fraction']:.1%}")
        if m.get("stats_bytes_per_token"):
            t.add_row("device bytes a token: K/V pages / key statistics",
                      f"{m['kv_bytes_per_token']:,.0f} / {m['stats_bytes_per_token']:,.0f} "
                      f"({m['stats_bytes_per_token'] / m['kv_bytes_per_token']:.1%})")
    if m.get("recall_pages_copied") or m.get("recall_pages_landed") or m.get("pages_fetched_ahead"):
        ahead = f"{m['pages_fetched_ahead']} ({m['predictor_accuracy']:.1%})" if m["pages_fetched_ahead"] else "0"
        t.add_row("recall pages copied / landed / ahead (picked)",
                  f"{m['recall_pages_copied']} / {m.get('recall_pages_landed', 0)} / {ahead}")
    if engine:
        for link, n in sorted(m["bytes_moved"].items()):
            t.add_row(f"bytes moved {link}", _mib(n))
        t.add_row("bytes moved total", _mib(m["bytes_moved_total"]))
    if m.get("dropped_pages"):
        t.add_row("dropped (left of sliding windows)", f"{m['dropped_pages']} pages, {_mib(m['dropped_bytes'])}")
    if "attention_mass_recall" in m:
        t.add_row("attention-mass recall mean / p10", f"{m['attention_mass_recall']:.1%} / "
                                                       f"{m['attention_mass_recall_p10']:.1%}")
        t.add_row("attention output rel. err mean / p90", f"{m['attention_rel_err']:.2e} / "
                                                           f"{m['attention_rel_err_p90']:.2e}")
    if engine:
        t.add_row("stall (fetch wait)", f"{m['stall_s']:.3f} s")
        t.add_row("TTFT", f"{m['ttft_s'] * 1e3:.1f} ms")
        t.add_row("TPOT p50 / p99", f"{m['tpot_p50_s'] * 1e3:.1f} / {m['tpot_p99_s'] * 1e3:.1f} ms")
        t.add_row("peak pages per tier", " · ".join(f"{k} {v:.1f}" for k, v in m["peak_pages"].items()))
    t.add_row("wall", f"{m['wall_s']:.1f} s")
    return t


def _serving_rows(t: Table, r: dict) -> None:
    """A serve_trace run's figures (kvtier.serve.replay.summarize)."""
    ms = lambda k: f"{r[k + '_p50_s'] * 1e3:.1f} / {r[k + '_p99_s'] * 1e3:.1f} ms"  # noqa: E731
    t.add_row("requests met both SLOs", f"{r['slo_met_fraction']:.1%} (TTFT < {r['slo_ttft_s'] * 1e3:g} ms, "
                                         f"ITL p99 < {r['slo_itl_s'] * 1e3:g} ms)")
    for name, key in (("TTFT", "ttft"), ("ITL", "itl"), ("E2E", "e2e")):
        t.add_row(f"{name} p50 / p99", ms(key))
    t.add_row("prefix hit (prompt tokens)", f"{r['prefix_hit_tokens']:.1%}")
    t.add_row("preemptions swap / recompute", f"{r['preemptions']['swap']} / {r['preemptions']['recompute']}")
    t.add_row("peak requests decoding", str(r["peak_running"]))
    t.add_row("decode pages read from the device", f"{r['decode_hit_rate']:.1%}")
    occ = r["occupancy"]["pages"]
    t.add_row("peak pages per tier (layer 0)", " · ".join(f"{k} {max(v, default=0)}" for k, v in occ.items()))


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


# -- loggers (the ``logger`` config group) ---------------------------------------------------

@dataclass
class NullLogger:
    """Logs nothing: metrics.json is the whole output."""

    name: str = "none"

    def log(self, metrics: dict, run_dir: Path) -> None:
        pass


@dataclass
class ConsoleLogger:
    """Prints the metrics table and where metrics.json is."""

    name: str = "console"

    def log(self, metrics: dict, run_dir: Path) -> None:
        console = Console()
        console.print(metrics_table(metrics))
        console.print(f"metrics: {Path(run_dir) / 'metrics.json'}")


@dataclass
class WandbLogger(ConsoleLogger):
    """The console table, then a W&B run of the config, the scalars and the occupancy series.

    Every W&B file (run, cache, config, staging) lives in ``<run_dir>/wandb``; ``mode`` is
    ``offline`` (no network: upload later with ``wandb sync``) or ``disabled`` (no W&B at all).
    """

    name: str = "wandb"
    mode: str = "offline"
    project: str = "kvtier"

    def __post_init__(self):
        if importlib.util.find_spec("wandb") is None:
            raise MissingDependencyError("wandb", "wandb", "logger=wandb")
        if self.mode not in WANDB_MODES:
            raise ConfigError("logger.mode", f"unknown mode {self.mode!r}; use one of {list(WANDB_MODES)}")

    def log(self, metrics: dict, run_dir: Path) -> None:
        super().log(metrics, run_dir)
        if self.mode == "disabled":
            return
        run_dir = Path(run_dir).absolute()
        home = run_dir / "wandb"
        env = {"WANDB_MODE": self.mode, "WANDB_DIR": str(run_dir), "WANDB_SILENT": "true",
               **{f"WANDB_{k}_DIR": str(home / k.lower()) for k in ("CACHE", "CONFIG", "DATA", "ARTIFACT")}}
        with _environ(env), argv_redacted():  # the run's metadata records the command line
            import wandb

            run = wandb.init(project=self.project, name=metrics["run_name"], dir=run_dir, mode=self.mode,
                             config=metrics["config"])
            occ = metrics.get("occupancy", {"step": []})  # none for a kvpress run
            for i, step in enumerate(occ["step"]):
                run.log({f"occupancy/{tier}": v[i] for tier, v in occ["pages"].items()}, step=step)
            run.summary.update(_scalars(metrics))
            sync_dir = run.settings.sync_dir
            run.finish()
            wandb.teardown()
        Console().print(f"W&B {self.mode} run: {sync_dir}  (upload: wandb sync {sync_dir})")


def _scalars(metrics: dict) -> dict:
    """Numbers of the metrics, nested dicts flattened as ``key/sub``."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = v
        elif isinstance(v, dict) and k in ("bytes_moved", "pages_migrated", "peak_pages", "capacity_pages"):
            out.update({f"{k}/{sub}": n for sub, n in v.items()})
    return out


@contextlib.contextmanager
def _environ(values: dict):
    """Set environment variables for the duration of the block, then restore them."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

