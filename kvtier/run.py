"""kvtier-run: run a recipe (or a Hydra multirun sweep of recipes) and report its metrics.

Recipes are read from ``recipes/`` at the repository root, found next to this package in a
checkout or an editable install (``pip install -e .``, what ``make`` does). ``KVTIER_RECIPES=DIR``
points at another copy (e.g. for a wheel install); Hydra's ``--config-dir DIR`` adds a folder of
your own group options (``DIR/policy/mine.yaml`` -> ``policy=mine``) on top of the packaged ones.

Every job's config (each one of a sweep) is validated before Hydra makes a folder, so a bad recipe
writes nothing; each run then writes ``metrics.json`` into its folder. Validation composes the
configs with Hydra 1.3's own (internal) composer and basic sweeper, exactly as the run will.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from pathlib import Path

import hydra
import torch
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import MissingConfigException
from hydra.types import RunMode
from omegaconf import DictConfig
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from kvtier.build import CacheFactory, build_logger, build_model, build_prefill, build_task, validate
from kvtier.engine import Engine
from kvtier.errors import ConfigError
from kvtier.report import collect, write_json

RECIPES = Path(os.environ.get("KVTIER_RECIPES") or Path(__file__).resolve().parents[1] / "recipes")
log = logging.getLogger(__name__)


def execute(cfg: DictConfig, run_dir: str | Path) -> dict:
    """Validate ``cfg``, build everything, run the task, write ``run_dir/metrics.json``, log; the metrics."""
    t0 = time.perf_counter()
    plan = validate(cfg)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    log.info("run folder: %s", run_dir)
    model, tokenizer, layout = build_model(cfg)
    engine = Engine(model, build_prefill(cfg))
    task = build_task(cfg)
    make_cache = CacheFactory(cfg, plan, layout, run_dir)
    try:
        with _progress(cfg.progress) as bar, _cpu_threads(cfg.cpu_threads):
            result = task.run(engine, make_cache, tokenizer, progress=bar)
    finally:
        make_cache.close()
    metrics = collect(cfg, plan, result, make_cache.records, engine, time.perf_counter() - t0)
    write_json(metrics, run_dir / "metrics.json")
    build_logger(cfg).log(metrics, run_dir)
    return metrics


@contextlib.contextmanager
def _progress(enabled: bool):
    if not enabled:
        yield None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn())
    with Progress(*columns) as progress:
        yield progress


@contextlib.contextmanager
def _cpu_threads(n: int | None):
    """torch's intra-op CPU threads set to ``n`` (None: unchanged) for the block."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def job_configs(args: list[str]):
    """The config of every job ``kvtier-run args`` will run (one, or each of a multirun sweep),
    composed as Hydra will compose them; a missing group option is a ConfigError naming the group."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra._internal.utils import get_args_parser

    opts = get_args_parser().parse_args(args)
    if opts.help or opts.hydra_help or opts.cfg or opts.info or opts.shell_completion:
        return  # nothing runs
    overrides = list(opts.overrides)
    if opts.config_dir:
        overrides.append(f"hydra.searchpath=[file://{Path(opts.config_dir).absolute()}]")
    name = opts.config_name or "config"
    with initialize_config_dir(str(RECIPES), version_base="1.3"), _group_errors():
        hydra_ = GlobalHydra.instance().hydra
        master = hydra_.compose_config(name, overrides, run_mode=RunMode.MULTIRUN, with_log_configuration=False)
        if not (opts.multirun or master.hydra.mode == RunMode.MULTIRUN):
            yield hydra_.compose_config(name, overrides, run_mode=RunMode.RUN, with_log_configuration=False)
            return
        loader = GlobalHydra.instance().config_loader()
        params = [f"{k}={v}" for k, v in (master.hydra.sweeper.get("params") or {}).items()]
        parser = OverridesParser.create(config_loader=loader)
        parsed = parser.parse_overrides(params + list(master.hydra.overrides.task))
        for batch in BasicSweeper.split_arguments(parsed, None):
            for job in batch:
                yield loader.load_sweep_config(master, list(job))


@contextlib.contextmanager
def _group_errors():
    """Hydra's error for a missing group option (``policy=nope``) as a ConfigError naming the group."""
    try:
        yield
    except MissingConfigException as e:
        group, _, option = (e.missing_cfg_file or "").rpartition("/")
        if not group or e.options is None:
            raise
        raise ConfigError(group, f"unknown {group} {option!r}; use one of {sorted(e.options)}") from None


@hydra.main(version_base="1.3", config_path=str(RECIPES), config_name="config")
def _job(cfg: DictConfig) -> dict:
    return execute(cfg, HydraConfig.get().runtime.output_dir)


def main() -> None:
    """Console script ``kvtier-run [-m] [group=option ...] [key=value ...]`` (Hydra's command line).

    Every job's config is validated before Hydra starts, so a bad one writes nothing.
    """
    for cfg in job_configs(sys.argv[1:]):
        validate(cfg)
    _job()


if __name__ == "__main__":
    main()
