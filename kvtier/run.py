"""kvtier-run: run a recipe (or a Hydra multirun sweep of recipes) and report its metrics.

Recipes ship inside the package (``kvtier/recipes``); ``--config-dir DIR`` adds a folder of your own
group options on top (``DIR/policy/mine.yaml`` -> ``policy=mine``, any ``_target_`` class).

Every job's config (each one of a sweep) is composed with Hydra's public compose API and checked
(:func:`kvtier.build.plan`) before Hydra makes a folder. A run's folder is named after its config
plus a hash of the whole resolved config, and is never reused. A run that fails leaves no folder;
Ctrl-C writes ``metrics.json`` over what finished, marked ``"partial": true``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import hydra
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from kvtier.build import RECIPES, SIZING, EngineFactory, build, build_model, label, plan
from kvtier.errors import ConfigError, Interrupted, KVTierError, MissingDependencyError, TierFailed
from kvtier.redact import prints_redacted, redact_file, redact_logs, redact_tracebacks, redacted
from kvtier.eval.kvpress import KNOBS, press_name, run_press
from kvtier.report import collect, identity, write_json
from kvtier.schema import BUDGET_SIZING, unknown_key
from kvtier.tiers.disk import check_folder

LAUNCHERS = {  # hydra/launcher option -> (the package that ships it, kvtier's extra)
    "joblib": ("hydra-joblib-launcher", "sweep"), "ray": ("hydra-ray-launcher", "ray"),
    "ray_aws": ("hydra-ray-launcher", "ray"), "submitit_local": ("hydra-submitit-launcher", "submitit"),
    "submitit_slurm": ("hydra-submitit-launcher", "submitit"),
}
log = logging.getLogger(__name__)


def run_name(root: DictConfig) -> str:
    """``<policy>-<scope>-<tiers>-<budget>-<hash>``: readable, and unique per resolved config."""
    cfg = OmegaConf.masked_copy(root, [k for k in root if k != "hydra"])
    digest = hashlib.sha1(json.dumps(OmegaConf.to_container(cfg, resolve=True), sort_keys=True, default=str)
                          .encode()).hexdigest()[:8]
    b = cfg.budget
    budget = f"tok{b.tokens}" if b.tokens is not None else f"size{b.size}" if b.size is not None else f"frac{b.fraction}"
    if cfg.get("method"):  # kvpress's press: no policy, scope nor tiers
        return f"{cfg.method.replace(':', '-')}-{budget}-{digest}"
    return f"{label(cfg.policy)}-{label(cfg.scope)}-{'_'.join(cfg.tiers.stack)}-{budget}-{digest}"


_MADE: set[Path] = set()  # folders this process made (absolute): the only ones a failed run removes


def claim(path: str | Path) -> Path:
    """``path``, or with ``-2``, ``-3``... when that exists: the first that this process makes itself
    (``mkdir`` is atomic, so two processes started together never get the same folder)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for candidate in itertools.chain([path], (Path(f"{path}-{i}") for i in itertools.count(2))):
        with contextlib.suppress(FileExistsError):
            candidate.mkdir()
            _MADE.add(candidate.absolute())
            return candidate


def run_dir(root: DictConfig) -> str:
    """``outputs/<task>/<run_name>`` (made by :func:`claim`, Hydra resolves it once per run)."""
    return str(claim(f"outputs/{label(root.task)}/{run_name(root)}"))


def job_dir(root: DictConfig) -> str:
    """A sweep job's folder inside the sweep's: ``<job number>-<run_name>`` (made by :func:`claim`)."""
    sweep = Path(str(root.hydra.sweep.dir))
    return claim(sweep / f"{root.hydra.job.num}-{run_name(root)}").name


OmegaConf.register_new_resolver("kvtier.run_dir", lambda *, _root_: run_dir(_root_), replace=True)
OmegaConf.register_new_resolver("kvtier.job_dir", lambda *, _root_: job_dir(_root_), replace=True)
OmegaConf.register_new_resolver("kvtier.device", lambda d: ("cuda" if torch.cuda.is_available() else "cpu")
                                if d == "auto" else d, replace=True)


def execute(cfg: DictConfig, run_dir: str | Path) -> dict:
    """Check ``cfg``, build everything, run the task, write ``run_dir/metrics.json``, log; the metrics.

    Nothing is written when a check fails; a run that fails later removes the ``run_dir`` it made (never
    one another process made). On Ctrl-C (or SIGTERM, under :func:`main`) the finished part is written,
    marked partial, and KeyboardInterrupt is raised again; on a tier's fault too, and TierFailed is raised.
    """
    t0 = time.perf_counter()
    plan_ = plan(cfg)
    run_dir = Path(run_dir)
    with contextlib.suppress(FileExistsError):
        run_dir.mkdir(parents=True)
        _MADE.add(run_dir.absolute())
    for saved in [*run_dir.glob(".hydra/*.yaml"), run_dir.parent / "multirun.yaml"]:  # Hydra's copies of the config
        if saved.is_file():
            redact_file(saved)
    log.info("run folder: %s", run_dir)
    try:
        if not plan_.needs_model:  # a task that loads no model (kvtier.sim): it writes its result, no logger
            result = build(cfg.task, "task").run(run_dir)
            metrics = {**plan_.labels, "run_name": run_dir.name, "wall_s": time.perf_counter() - t0,
                       "task_result": result, "config": redacted(OmegaConf.to_container(cfg, resolve=True))}
        elif cfg.method:  # kvpress's press (eager attention: ObservedAttention reads the prefill's weights)
            model, tokenizer = build_model(cfg, attention="eager")
            with _progress(cfg.progress) as bar, _cpu_threads(cfg.cpu_threads):
                result = run_press(build(cfg.task, "task"), press_name(cfg.method, "method"), plan_.budget_tokens,
                                   model, tokenizer, cfg.cache.sinks, cfg.cache.window, progress=bar)
            metrics = press_metrics(plan_, result, time.perf_counter() - t0, cfg, run_dir)
        else:
            model, tokenizer = build_model(cfg)
            make_engine = EngineFactory(cfg, plan_, run_dir, model)
            try:
                with _progress(cfg.progress) as bar, _cpu_threads(cfg.cpu_threads):
                    result = build(cfg.task, "task").run(make_engine, tokenizer, progress=bar)
            finally:
                make_engine.close()
            metrics = collect(plan_, result, make_engine.records, time.perf_counter() - t0, cfg, run_dir)
    except (Interrupted, TierFailed) as stop:
        metrics = press_metrics(plan_, stop.result, time.perf_counter() - t0, cfg, run_dir) if cfg.method else \
            collect(plan_, stop.result, make_engine.records, time.perf_counter() - t0, cfg, run_dir)
        path, failed = save_metrics(metrics, run_dir)
        where = f"partial results in {path or 'stdout'}" + (f" ({failed})" if failed else "")
        if isinstance(stop, TierFailed):
            raise TierFailed(stop.result, stop.fault, where) from None
        raise KeyboardInterrupt(where) from None
    except BaseException:
        remove_made(run_dir)
        raise
    path, failed = save_metrics(metrics, run_dir)
    if failed:
        raise KVTierError(f"{failed}; the run's metrics are kept in {path or 'stdout (printed above)'}")
    if plan_.needs_model:
        build(cfg.logger, "logger").log(metrics, run_dir)
    return metrics


def press_metrics(plan_, result: dict, wall_s: float, cfg: DictConfig, run_dir: Path) -> dict:
    """A kvpress run's metrics: what names and scores it (:func:`kvtier.report.identity`) and the KV pairs kept per
    layer (no engine ran: no tier, page or step figures)."""
    kept = [r["kept_tokens"] for r in result.get("records", [])]  # a partial result has no mean yet
    return {**identity(plan_, result, wall_s, cfg, run_dir),
            "kept_tokens": result.get("kept_tokens", sum(kept) / len(kept) if kept else float("nan"))}


def remove_made(run_dir: Path) -> None:
    """Remove ``run_dir`` if this process made it (never a folder another process made)."""
    if run_dir.absolute() in _MADE:
        shutil.rmtree(run_dir, ignore_errors=True)
        _MADE.discard(run_dir.absolute())


def save_metrics(metrics: dict, run_dir: Path) -> tuple[Path | None, str]:
    """``run_dir/metrics.json``: ``(its path, "")``. When that write fails (a full disk, the folder gone), the run's
    metrics are not lost: they go to a file of their own in the system's temp folder (else the working folder,
    else the home folder, else to stdout: path None), the folder this run made is removed (no half folder), and
    the second element says what failed."""
    try:
        return write_json(metrics, run_dir / "metrics.json"), ""
    except KVTierError as e:
        failed = str(e)
    remove_made(run_dir)
    for place in (tempfile.gettempdir(), Path.cwd(), Path.home()):
        try:
            fd, name = tempfile.mkstemp(prefix=f"kvtier-{run_dir.name}-", suffix="-metrics.json", dir=place)
        except OSError:
            continue
        os.close(fd)
        try:
            return write_json(metrics, Path(name)), failed
        except KVTierError:
            Path(name).unlink(missing_ok=True)
    print(json.dumps(metrics, default=str))
    return None, failed


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


def _args(argv: list[str]) -> argparse.Namespace:
    """The part of Hydra's command line that decides which jobs run."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("-m", "--multirun", action="store_true")
    p.add_argument("-cd", "--config-dir")
    p.add_argument("-cn", "--config-name", default="config")
    p.add_argument("overrides", nargs="*")
    return p.parse_known_args(argv)[0]


def job_configs(argv: list[str]):
    """The config of every job ``kvtier-run argv`` runs (one, or each of a sweep's), composed with
    Hydra's public API; a config Hydra refuses is a ConfigError naming the key."""
    opts = _args(argv)
    if any(a in argv for a in ("--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "--shell-completion")):
        return
    overrides = list(opts.overrides)
    if opts.config_dir:
        overrides.append(f"hydra.searchpath=[file://{Path(opts.config_dir).absolute()}]")
    with initialize_config_dir(str(RECIPES), version_base="1.3"), composing():
        parser = OverridesParser.create()
        fixed = [o.input_line for o in parser.parse_overrides(overrides) if not o.is_sweep_override()]
        head = compose(opts.config_name, overrides=fixed, return_hydra_config=True)
        given = {o.get_key_element() for o in parser.parse_overrides(overrides)}  # the command line wins
        params = [f"{k}={v}" for k, v in (head.hydra.sweeper.get("params") or {}).items() if k not in given]
        multirun = opts.multirun or str(head.hydra.mode) == "RunMode.MULTIRUN"
        axes = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override()
                else [o.input_line] for o in parser.parse_overrides((params if multirun else []) + overrides)]
        jobs = [(compose(opts.config_name, overrides=list(job)), job) for job in itertools.product(*axes)]
        check_read(jobs)
        check_launch(head, multirun)
        yield from (cfg for cfg, _ in jobs)


def check_launch(head: DictConfig, multirun: bool) -> None:
    """What Hydra needs before any job starts: the run's (or sweep's) folder can be made, and a Slurm launcher has
    Slurm to submit to."""
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    raw = str(OmegaConf.to_container(head.hydra.sweep if multirun else head.hydra.run, resolve=False)["dir"])
    try:  # kvtier's own folder (claimed when resolved) is made under the working folder
        folder = "outputs" if "kvtier.run_dir" in raw else OmegaConf.select(head, key, throw_on_resolution_failure=True)
    except OmegaConfBaseException:  # resolved by Hydra at launch only (${hydra:...})
        folder = None
    if folder is not None:
        check_folder(folder, key)
    launcher = str(head.hydra.launcher.get("_target_", "")) if multirun else ""
    if launcher.endswith("SlurmLauncher") and not (shutil.which("srun") and shutil.which("sbatch")):
        raise ConfigError("hydra/launcher", "submitit_slurm submits the sweep's jobs with Slurm's sbatch and srun, "
                                            "which are not on PATH here; run it on a Slurm login node, or use "
                                            "hydra/launcher=submitit_local or joblib on this machine")


NOT_READ_WITHOUT_MODEL = ("model", "tiers", "policy", "scope", "scheduler", "kernel", "logger", "page_size", "kv_dtype",
                          "budget", "cache", "engine")  # what a task that loads no model (kvtier.sim) never reads


NOT_READ_BY_PRESS = ("tiers", "policy", "scope", "scheduler", "kernel", "engine")  # what a kvpress run never reads


BUDGET_KEYS = ("cache.window", "cache.mode", "cache.sinks")  # read by the token budget (cache.attend_budget)


def check_read(jobs: list[tuple[DictConfig, tuple[str, ...]]]) -> None:
    """A command-line setting that no job of a run or sweep reads would change nothing (a sweep of identical runs),
    so it is refused by name (:func:`unread` says why). ``jobs``: each job's config and override lines."""
    reasons: dict[str, str | None] = {}  # key -> why the jobs so far leave it unread; None: one reads it
    for cfg, overrides in jobs:
        for line in overrides:
            key, _, value = line.lstrip("+~").partition("=")
            why = unread(cfg, key, None if line.startswith("~") or value in ("", "null") else value)
            reasons[key] = why if reasons.get(key, why) is not None else None
    for key, why in reasons.items():
        if why:
            raise ConfigError(key, f"this setting would change nothing: {why}")


def unread(cfg: DictConfig, key: str, value: str | None) -> str | None:
    """Why ``key`` (set to ``value``, None: cleared) is read by nothing in ``cfg``, or None: a task that loads no
    model reads only its own keys; a key read before it sizes the same thing (``budget.tokens`` before
    ``budget.size`` before ``budget.fraction``, a tier's ``size`` before its ``fraction``); the token budget's keys
    without the token budget (unless another node interpolates them, as topk's ``scope.sinks``);
    ``cache.exact_prefill`` where the scope's prefill attends every page anyway (all, topk); a kvpress run
    (``method``) reads none of the engine's groups, and of ``cache`` only its press's knobs."""
    if not getattr(build(cfg.task, "task", call=False), "needs_model", True):
        if key.split(".")[0].split("/")[0] in NOT_READ_WITHOUT_MODEL:
            return f"task {cfg.task._target_.rpartition('.')[2]} loads no model and reads only its task.* keys"
        return None
    for group in [tuple(f"budget.{k}" for k in BUDGET_SIZING),
                  *(tuple(f"tiers.stack.{name}.{k}" for k in SIZING) for name in list(cfg.tiers.stack)[1:])]:
        if key in group[1:] and value is not None:
            first = next((k for k in group[:group.index(key)] if OmegaConf.select(cfg, k) is not None), None)
            if first is not None:
                return f"{first}={OmegaConf.select(cfg, first)} is read first ({' > '.join(group)}); " \
                       f"add {first}=null to size by {key}"
    if cfg.get("method"):  # kvpress's press: the model, task, budget and the press's own cache settings
        press = press_name(cfg.method, "method")
        top, reads = key.split(".")[0].split("/")[0], sorted(f"cache.{k}" for k in KNOBS.get(press, {}).values())
        if top in NOT_READ_BY_PRESS or top == "cache" and key not in reads:
            return f"method={cfg.method} runs kvpress's press, which reads none of kvtier's " \
                   f"{', '.join(NOT_READ_BY_PRESS)}, and of cache.* only {', '.join(reads) or 'nothing'}"
        return None
    if key == "cache.exact_prefill" and \
            not getattr(build(cfg.scope, "scope", call=False), "device_only", False):
        return f"scope {cfg.scope._target_.rpartition('.')[2]} prefills over every page already; only a scope " \
               f"whose prefill reads the device's pages alone (resident) reads it"
    if key in BUDGET_KEYS and not cfg.cache.attend_budget and \
            f"${{{key}}}" not in json.dumps(OmegaConf.to_container(cfg, resolve=False), default=str):
        return "only the token budget reads it; add cache.attend_budget=true"
    return None


@contextlib.contextmanager
def composing():
    """Hydra's and OmegaConf's composition errors as ConfigErrors naming a key that exists."""
    try:
        yield
    except MissingConfigException as e:
        group, _, option = (e.missing_cfg_file or "").rpartition("/")
        if group == "hydra/launcher" and option in LAUNCHERS:
            raise MissingDependencyError(*LAUNCHERS[option], f"hydra/launcher={option}") from None
        if not group or e.options is None:
            raise ConfigError("defaults", str(e)) from None
        raise ConfigError(group, f"unknown {group} {option!r}; use one of {sorted(e.options)} or add "
                                 f"{group}/{option}.yaml to a --config-dir") from None
    except yaml.YAMLError as e:  # a recipe file of the user's that is not YAML
        mark = getattr(e, "problem_mark", None)
        where = f"{mark.name} line {mark.line + 1}" if mark else "a recipe file"
        group = Path(mark.name).parent.name if mark else ""
        raise ConfigError(group if group and (RECIPES / group).is_dir() else "defaults",
                          f"{where} is not valid YAML ({getattr(e, 'problem', None) or e})") from None
    except (HydraException, OmegaConfBaseException) as e:
        cause = e.__cause__ if isinstance(e.__cause__, OmegaConfBaseException) else e
        key = getattr(cause, "full_key", None) or ""
        parent, _, leaf = str(key).rpartition(".")
        if "not in" in str(cause):
            options = GlobalHydra.instance().config_loader().get_group_options(parent) if parent else []
            pick = f"; or pick another {parent}: {', '.join(options)}" if options else ""
            raise unknown_key(parent, leaf, pick) from None
        message = str(cause).splitlines()[0]
        given = re.match(r"Value '(.*)' is not a valid bool", message)
        raise ConfigError(str(key) or "config", f"must be true or false, got {given[1]!r}" if given else message) \
            from None


class _JobError(BaseException):
    """A KVTierError inside a Hydra job, carried past Hydra's own error report to :func:`main`."""


@hydra.main(version_base="1.3", config_path=str(RECIPES), config_name="config")
def _job(cfg: DictConfig) -> dict:
    try:
        return execute(cfg, HydraConfig.get().runtime.output_dir)
    except KVTierError as e:
        raise _JobError(e) from e


EXIT_TIER_FAULT = 3  # a tier failed under the run: partial results written, the tier and its fault named


def main() -> None:
    """Console script ``kvtier-run [-m] [group=option ...] [key=value ...]`` (Hydra's command line).

    Every job is checked before Hydra starts. A config error or a missing extra prints one line and
    exits 2; a tier failing under the run writes the partial result and exits 3 with one line naming
    the tier and its fault; another error kvtier raises on purpose (a tier that cannot be made, a result
    that cannot be written) exits 1 with its line; Ctrl-C exits 130 and SIGTERM 143, each with one line,
    after writing the finished part; any other error keeps its traceback.
    """
    redact_logs()  # Hydra's and kvtier's log lines (the overrides of each job among them) hold no password
    redact_tracebacks()
    config_dir = _args(sys.argv[1:]).config_dir
    if config_dir:  # the user's modules beside their recipes import by name (_target_: mine.MyPolicy)
        sys.path.insert(0, str(Path(config_dir).absolute()))
    stopped = []

    def terminate(signum, frame):  # SIGTERM (Slurm, Kubernetes) stops the run as Ctrl-C does
        stopped.append(signum)
        signal.default_int_handler(signum, frame)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        with prints_redacted():  # what Hydra prints itself (--cfg job) too
            for cfg in job_configs(sys.argv[1:]):
                plan(cfg)
            _job()
    except (ConfigError, MissingDependencyError) as e:
        _exit(2, f"error: {e}")
    except _JobError as e:  # a KVTierError: its message says what to change
        error = e.args[0]
        _exit(2 if isinstance(error, (ConfigError, MissingDependencyError)) else
              EXIT_TIER_FAULT if isinstance(error, TierFailed) else 1, f"error: {error}")
    except KeyboardInterrupt as e:
        _exit(128 + (stopped[0] if stopped else signal.SIGINT), f"{'terminated' if stopped else 'interrupted'}"
                                                              f"{'; ' + str(e) if str(e) else ''}")
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit(code: int, line: str) -> None:
    print(f"kvtier-run: {line}", file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    main()
