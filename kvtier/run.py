"""kvtier-run: run a recipe (or a Hydra multirun sweep of recipes) and report its metrics.

Recipes are read from ``recipes/`` at the repository root, found next to this package in a
checkout or an editable install (``pip install -e .``, what ``make`` does). ``KVTIER_RECIPES=DIR``
points at another copy (e.g. for a wheel install); Hydra's ``--config-dir DIR`` adds a folder of
your own group options (``DIR/policy/mine.yaml`` -> ``policy=mine``) on top of the packaged ones.

Every job's config is validated before Hydra writes anything (:class:`ValidateFirst`), so a bad
recipe leaves no output folder content; each run then writes ``metrics.json`` into its folder.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from pathlib import Path

import hydra
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ValueType
from hydra.experimental.callback import Callback
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
        with _progress(cfg.progress) as bar:
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


class ValidateFirst(Callback):
    """Hydra callback: validate every job's config before Hydra makes a folder or writes a file."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        validate(config)

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        for job in sweep_configs(config):
            validate(job)


def sweep_configs(config: DictConfig):
    """The config of every job of a multirun, composed as Hydra's basic sweeper will compose it."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    loader = GlobalHydra.instance().config_loader()
    params = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
    parsed = OverridesParser.create(config_loader=loader).parse_overrides(params + list(config.hydra.overrides.task))
    for batch in BasicSweeper.split_arguments(parsed, None):
        for overrides in batch:
            yield loader.load_sweep_config(config, list(overrides))


def check_choices(args: list[str]) -> None:
    """ConfigError naming the group when an override picks an option no recipe folder holds.

    Runs before Hydra, whose own error for this names a file rather than the config key.
    """
    dirs = [RECIPES, *map(Path, _flag_values(args, ("--config-dir", "-cd")))]
    groups = {p.name for p in RECIPES.iterdir() if p.is_dir()}
    try:
        overrides = OverridesParser.create().parse_overrides([a for a in args if "=" in a and not a.startswith("-")])
    except Exception:
        return  # malformed: Hydra explains it
    for o in overrides:
        group = o.key_or_group
        if group not in groups or o.is_delete() or o.value_type == ValueType.GLOB_CHOICE_SWEEP:
            continue
        options = sorted({f.stem for d in dirs for f in (d / group).glob("*.yaml")})
        values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
        for value in values:
            if value not in options and value != "null":
                raise ConfigError(group, f"unknown {group} {value!r}; use one of {options}")


def _flag_values(args: list[str], flags: tuple[str, ...]) -> list[str]:
    out = []
    for i, a in enumerate(args):
        if a in flags and i + 1 < len(args):
            out.append(args[i + 1])
        out += [a.split("=", 1)[1] for f in flags if a.startswith(f + "=")]
    return out


@hydra.main(version_base="1.3", config_path=str(RECIPES), config_name="config")
def _job(cfg: DictConfig) -> dict:
    return execute(cfg, HydraConfig.get().runtime.output_dir)


def main() -> None:
    """Console script ``kvtier-run [-m] [group=option ...] [key=value ...]`` (Hydra's command line)."""
    check_choices(sys.argv[1:])
    _job()


if __name__ == "__main__":
    main()
