"""Config -> objects. :func:`validate` checks a whole recipe at the boundary (types, ranges, registry
names, budget vs context vs kernel) without loading a model or touching a file; the builders then
make every object with ``hydra.utils.instantiate`` from the ``_target_`` of its config node.

A ConfigError names the config key to change (``budget.tokens``, ``policy``, ``tiers.stack.disk.path``).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from kvtier.cache import SCOPES, TieredKVCache
from kvtier.errors import ConfigError
from kvtier.eval import TASKS
from kvtier.hook import install
from kvtier.kernels.flashinfer import FlashInferBackend
from kvtier.kernels.registry import BACKENDS
from kvtier.layout import KVLayout
from kvtier.models import MODEL_DTYPES, SMOLLM2_NAME, cache_dir, kv_layout_for, smollm2_gguf_path
from kvtier.policies import POLICIES, Policy
from kvtier.report import LOGGERS, WANDB_MODES, CacheRecord
from kvtier.tiers import DeviceTier, DiskTier, HostTier, RemoteTier, Tier
from kvtier.tiers.remote import start_local_server

TIER_CLASSES = (DeviceTier, HostTier, DiskTier, RemoteTier)
LOCAL_STORE = "local"  # tiers.stack.<remote>.address that starts a page server for the run


def budget_tag(tokens, fraction) -> str:
    """The budget part of a run name: ``tok256`` or ``frac0.25``."""
    return f"tok{tokens}" if tokens is not None else f"frac{fraction}"


def auto_device(device: str) -> str:
    """``auto`` -> ``cuda`` when a GPU is present, else ``cpu``; any other value unchanged."""
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


OmegaConf.register_new_resolver("kvtier.budget_tag", budget_tag, replace=True)
OmegaConf.register_new_resolver("kvtier.device", auto_device, replace=True)


@dataclass(frozen=True)
class Plan:
    """What validation worked out: the task's context and every tier's capacity in pages."""

    context_tokens: int
    budget_tokens: int
    capacities: dict  # tier key -> pages per layer (device first)

    @property
    def budget_fraction(self) -> float:
        return self.budget_tokens / self.context_tokens


# -- validation -------------------------------------------------------------------------------

def validate(cfg: DictConfig) -> Plan:
    """Check the whole recipe; raise ConfigError naming the first bad key. Builds only cheap objects."""
    _choice(cfg.get("scope"), SCOPES, "scope")
    page_size = cfg.get("page_size")
    if not _is_int(page_size) or page_size < 1 or page_size & (page_size - 1):
        raise ConfigError("page_size", f"must be a power of two number of tokens, e.g. 16; got {page_size!r}")
    if not isinstance(cfg.get("progress"), bool):
        raise ConfigError("progress", f"must be true or false, got {cfg.get('progress')!r}")
    threads = cfg.get("cpu_threads")
    if threads is not None and (not _is_int(threads) or threads < 1):
        raise ConfigError("cpu_threads", f"must be a positive number of threads or null, got {threads!r}")
    device = _validate_model(cfg.model)
    policy = _validate_policy(cfg.policy)
    _validate_kernel(cfg.kernel, device, page_size, policy)
    prefill = build_prefill(cfg)
    _instantiate(cfg.scheduler.placement, "scheduler.placement")
    task = build_task(cfg)
    context, extra = task_context(task)
    budget = _validate_budget(cfg.budget, context, page_size, prefill.chunk_size, policy)
    _validate_cache(cfg.cache)
    capacities = _validate_tiers(cfg.tiers, -(-budget // page_size), -(-(context + extra) // page_size))
    _validate_logger(cfg.logger)
    return Plan(context, budget, capacities)


def task_context(task) -> tuple[int, int]:
    """``(context tokens, tokens generated after it)`` of a task."""
    context = getattr(task, "context_tokens", None) or task.length
    return context, getattr(task, "max_new_tokens", 0)


def _locate(path: str):
    """The object a dotted ``_target_`` path names, or None."""
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name, None)
    except (ImportError, ValueError):
        return None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _choice(value, allowed, field: str) -> None:
    if value not in allowed:
        raise ConfigError(field, f"unknown {field} {value!r}; use one of {sorted(allowed)}")


def _node(cfg: DictConfig, field: str) -> DictConfig:
    if not isinstance(cfg, DictConfig) or "name" not in cfg:
        raise ConfigError(field, f"must be a config group with a name, got {cfg!r}")
    return cfg


def _validate_model(model: DictConfig) -> torch.device:
    _node(model, "model")
    if model.get("dtype") not in MODEL_DTYPES:
        raise ConfigError("model.dtype", f"unsupported dtype {model.get('dtype')!r}; use one of {sorted(MODEL_DTYPES)}")
    try:
        device = torch.device(model.device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError("model.device", f"{model.device!r} is not a torch device ({e}); use auto, cpu or cuda") \
            from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("model.device", "cuda was asked for but no GPU is visible; use model.device=cpu")
    if OmegaConf.is_missing(model, "path"):
        raise ConfigError("model.path", "set it to a local Hugging Face model folder, e.g. model.path=/models/llama")
    path = model.get("path")
    if path in (None, "smollm2"):
        if not (cache_dir() / "models" / SMOLLM2_NAME / "config.json").is_file():
            smollm2_gguf_path()  # raises ConfigError("model.path") with the pip command when missing
    elif not (Path(str(path)).expanduser() / "config.json").is_file():
        raise ConfigError("model.path", f"{path!r} holds no config.json; pass a local Hugging Face model folder "
                                        "or 'smollm2'")
    _check_keys(model, "model", drop=("name",))
    return device


def _validate_policy(node: DictConfig) -> Policy:
    _node(node, "policy")
    _check_policy_names(node, "policy")
    return build_policy(node)


def _check_policy_names(node, field: str) -> None:
    """Every policy node (the policy and the parts of a combinator) names a registered policy."""
    if isinstance(node, DictConfig):
        if "_target_" in node and "name" in node:
            _choice(node.name, POLICIES, field)
        for key, child in node.items():
            _check_policy_names(child, f"{field}.{key}")
    elif OmegaConf.is_list(node):
        for i, child in enumerate(node):
            _check_policy_names(child, f"{field}.{i}")


def _validate_kernel(node: DictConfig, device: torch.device, page_size: int, policy: Policy) -> None:
    _choice(_node(node, "kernel").name, BACKENDS, "kernel")
    if node.name == "flashinfer":
        if device.type != "cuda" or importlib.util.find_spec("flashinfer") is None:
            raise ConfigError("kernel", "kernel=flashinfer needs a GPU and pip install 'kvtier[gpu]'; use kernel=torch")
        if policy.needs_salience and not FlashInferBackend.supports_salience:
            raise ConfigError("kernel", f"policy '{policy.name}' needs page salience, which FlashInfer does not give; "
                                        "use kernel=triton or kernel=torch")
    if node.name == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError("kernel", "kernel=triton on the CPU runs only under TRITON_INTERPRET=1 (slow); "
                                        "use kernel=torch")
        from kvtier.kernels.triton_prefill import check_page_size

        check_page_size(page_size)
    _check_keys(node, "kernel")


def _validate_budget(budget: DictConfig, context: int, page_size: int, chunk: int, policy: Policy) -> int:
    """Device-tier tokens per sequence: ``budget.tokens``, else ``budget.fraction`` of the context."""
    tokens, fraction = budget.get("tokens"), budget.get("fraction")
    if tokens is None and fraction is None:
        raise ConfigError("budget", "set budget.tokens (device tokens per sequence) or budget.fraction "
                                    "(of the context)")
    if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                 or not 0 < fraction <= 1):
        raise ConfigError("budget.fraction", f"must be in (0, 1], got {fraction!r}")
    if tokens is not None:
        if not _is_int(tokens) or tokens < 1:
            raise ConfigError("budget.tokens", f"must be a positive number of tokens, got {tokens!r}")
        if tokens > context:
            raise ConfigError("budget.tokens", f"{tokens} is larger than the task's context of {context} tokens; "
                                               f"use at most {context} (or budget.fraction=1)")
    field = "budget.tokens" if tokens is not None else "budget.fraction"
    tokens = tokens if tokens is not None else max(1, int(fraction * context))
    pages = -(-tokens // page_size)
    need = _pinned_pages(policy, page_size) + -(-min(chunk, context) // page_size) + 1
    if pages < need:
        raise ConfigError(field, f"a budget of {tokens} tokens ({pages} x {page_size}-token pages) cannot hold "
                                 f"the pages policy '{policy.name}' pins plus a prefill chunk of {chunk} tokens "
                                 f"({need} pages); raise the budget to {need * page_size} tokens, or lower "
                                 "scheduler.prefill.chunk_size or the policy's sinks/window")
    return tokens


def _pinned_pages(policy: Policy, page_size: int) -> int:
    """Most pages a policy (or any part of a combinator) pins: its sinks, its window and the page being written."""
    parts = getattr(policy, "parts", [policy])
    sinks = max(getattr(p, "sinks", 0) for p in parts)
    window = max(getattr(p, "window", 0) for p in parts)
    return -(-sinks // page_size) + -(-window // page_size) + 1


def _validate_cache(node: DictConfig) -> None:
    if _locate(node._target_) is not TieredKVCache:
        raise ConfigError("cache._target_", f"must be kvtier.cache.TieredKVCache, got {node._target_!r}")
    _check_keys(node, "cache")
    for flag in ("merge", "fidelity"):
        if not isinstance(node.get(flag, False), bool):
            raise ConfigError(f"cache.{flag}", f"must be true or false, got {node.get(flag)!r}")
    topk = node.get("topk_pages")
    if topk is not None and (not _is_int(topk) or topk < 1):
        raise ConfigError("cache.topk_pages", f"must be a positive number of pages or null, got {topk!r}")
    if not _is_int(node.sinks) or node.sinks < 0:
        raise ConfigError("cache.sinks", f"must be an integer >= 0, got {node.sinks!r}")


def _validate_tiers(node: DictConfig, device_pages: int, context_pages: int) -> dict:
    """Capacity of each tier: the budget for the first (device), ``fraction`` of the context for the rest."""
    stack = _node(node, "tiers").get("stack")
    if not isinstance(stack, DictConfig) or len(stack) == 0:
        raise ConfigError("tiers.stack", "must map tier names to tier configs, the device tier first")
    allowed = [f"{c.__module__.rsplit('.', 1)[0]}.{c.__name__}" for c in TIER_CLASSES]
    capacities = {}
    for i, (key, spec) in enumerate(stack.items()):
        field = f"tiers.stack.{key}"
        target = spec.get("_target_") if isinstance(spec, DictConfig) else None
        cls = _locate(target) if isinstance(target, str) else None
        if cls not in TIER_CLASSES:
            raise ConfigError(f"{field}._target_", f"unknown tier {target!r}; use one of {allowed}")
        if "capacity" in spec or "layout" in spec or "name" in spec:
            raise ConfigError(field, "capacity, layout and name come from the budget, the model and the key; "
                                     "size a lower tier with fraction")
        if i == 0:
            if "fraction" in spec:
                raise ConfigError(f"{field}.fraction", "the device tier's size is the budget; set budget.tokens "
                                                       "or budget.fraction")
            capacities[key] = device_pages
        else:
            fraction = spec.get("fraction", 1.0)
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or fraction <= 0:
                raise ConfigError(f"{field}.fraction", f"must be a positive share of the context, got {fraction!r}")
            capacities[key] = max(1, math.ceil(fraction * context_pages))
        _check_keys(spec, field, drop=("fraction",), given=("layout", "capacity", "name"))
        if cls is DiskTier and not isinstance(spec.get("path"), str):
            raise ConfigError(f"{field}.path", "must be a folder (relative paths live in the run folder)")
    lower = list(capacities)[1:]
    if lower and sum(capacities[k] for k in lower) < context_pages:
        raise ConfigError(f"tiers.stack.{lower[-1]}.fraction", f"the tiers below the device hold "
                                                              f"{sum(capacities[k] for k in lower)} pages, the context "
                                                              f"needs {context_pages}; raise a fraction")
    if not lower and device_pages < context_pages:
        raise ConfigError("tiers.stack", "a device tier alone must hold the whole context; add a host tier "
                                         "or set budget.fraction=1")
    return capacities


def _validate_logger(node: DictConfig) -> None:
    _choice(_node(node, "logger").name, LOGGERS, "logger")
    if "mode" in node:
        _choice(node.mode, WANDB_MODES, "logger.mode")
    _check_keys(node, "logger")


def _check_keys(node: DictConfig, field: str, drop=(), given=()) -> None:
    """Every key of a ``_target_`` node is a parameter of its target (or one of ``drop``)."""
    if "_target_" not in node:
        raise ConfigError(f"{field}._target_", "missing: name the class or function to build")
    target = _locate(node._target_)
    if target is None:
        raise ConfigError(f"{field}._target_", f"{node._target_!r} is not importable")
    params = inspect.signature(target).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        allowed = [p for p in params if p not in given]
        for key in node:
            if not key.startswith("_") and key not in drop and key not in params:
                raise ConfigError(f"{field}.{key}", f"{node._target_} has no parameter {key!r}; its parameters are "
                                                    f"{allowed}")


# -- builders ---------------------------------------------------------------------------------

def _instantiate(node: DictConfig, field: str, drop=(), **kwargs):
    """``instantiate(node, **kwargs)`` without the ``drop`` keys; errors name the key under ``field``."""
    _check_keys(node, field, drop=drop, given=tuple(kwargs))
    conf = OmegaConf.to_container(node, resolve=True)
    for key in drop:
        conf.pop(key, None)
    try:  # objects (layout, tiers) go to the partial: instantiate would turn them into configs
        return instantiate(conf, _partial_=True, _convert_="all")(**kwargs)
    except (ConfigError, InstantiationException) as e:
        cause = e
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__
        if cause is None:
            raise ConfigError(field, str(e)) from e
        name = cause.field if cause.field.startswith(field) else f"{field}.{cause.field.rsplit('.', 1)[-1]}"
        raise ConfigError(name, str(cause).split(": ", 1)[-1]) from None


def build_policy(node: DictConfig) -> Policy:
    return _instantiate(node, "policy")


def build_prefill(cfg: DictConfig):
    return _instantiate(cfg.scheduler.prefill, "scheduler.prefill")


def build_task(cfg: DictConfig):
    """The task object; its ``name`` picks the registered class (``kvtier.eval.TASKS``)."""
    _choice(_node(cfg.task, "task").name, TASKS, "task")
    task = _instantiate(cfg.task, "task", drop=("name",))
    if not isinstance(task, TASKS[cfg.task.name]):
        raise ConfigError("task._target_", f"task {cfg.task.name!r} is {TASKS[cfg.task.name].__name__}, "
                                           f"not {type(task).__name__}")
    return task


_LOADED: dict = {}  # one loaded model, reused by the jobs of a multirun in this process


def build_model(cfg: DictConfig):
    """``(model, tokenizer)`` with kvtier's attention hook installed, and its KVLayout."""
    key = OmegaConf.to_yaml(cfg.model, resolve=True)
    if key not in _LOADED:
        _LOADED.clear()
        _LOADED[key] = _instantiate(cfg.model, "model", drop=("name",))
    model, tokenizer = _LOADED[key]
    model.set_attn_implementation(install())
    layout = kv_layout_for(model.config, page_size=cfg.page_size, dtype=model.dtype)
    return model, tokenizer, layout


def build_logger(cfg: DictConfig):
    return _instantiate(cfg.logger, "logger")


class CacheFactory:
    """``make_cache()`` for a task: a fresh TieredKVCache per call, every part built from the config.

    Keeps a :class:`~kvtier.report.CacheRecord` of every cache it made (taken when the next one is
    made, or at :meth:`close`, after the task closed it). Disk tiers get a folder per cache; a
    ``local`` remote address starts one page server for the whole run (stopped by :meth:`close`).
    """

    def __init__(self, cfg: DictConfig, plan: Plan, layout: KVLayout, run_dir: Path):
        self.cfg, self.plan, self.layout, self.run_dir = cfg, plan, layout, Path(run_dir)
        self.records: list[CacheRecord] = []
        self._last: TieredKVCache | None = None
        self._resources = contextlib.ExitStack()
        self._stores: dict[str, str] = {}
        for key, spec in cfg.tiers.stack.items():
            if _locate(spec._target_) is RemoteTier and spec.get("address") == LOCAL_STORE:
                nbytes = 2 * layout.num_layers * plan.capacities[key] * layout.page_bytes  # room for two caches
                proc, self._stores[key] = start_local_server(nbytes)
                self._resources.callback(_stop, proc)

    def __call__(self) -> TieredKVCache:
        self._record_last()
        tiers = [self._tier(key, spec) for key, spec in self.cfg.tiers.stack.items()]
        policy = build_policy(self.cfg.policy)
        scheduler = _instantiate(self.cfg.scheduler.placement, "scheduler.placement")
        backend = _instantiate(self.cfg.kernel, "kernel")
        topk = self.cfg.cache.topk_pages or self.plan.capacities[next(iter(self.plan.capacities))]
        self._last = _instantiate(self.cfg.cache, "cache", layout=self.layout, tiers=tiers, policy=policy,
                                  scheduler=scheduler, backend=backend, topk_pages=topk)
        return self._last

    def _tier(self, key: str, spec: DictConfig) -> Tier:
        extra = {}
        cls = _locate(spec._target_)
        if cls is DiskTier:
            extra["path"] = self.run_dir / Path(spec.path).expanduser() / f"cache-{len(self.records)}"
        if key in self._stores:
            extra["address"] = self._stores[key]
        return _instantiate(spec, f"tiers.stack.{key}", drop=("fraction",), layout=self.layout,
                            capacity=self.plan.capacities[key], name=key, **extra)

    def _record_last(self) -> None:
        if self._last is not None:
            self.records.append(CacheRecord.of(self._last))
            self._last = None

    def close(self) -> None:
        """Record the last cache, close it (idempotent) and stop any page server."""
        last = self._last
        self._record_last()
        if last is not None:
            last.close()
        self._resources.close()


def _stop(proc) -> None:
    proc.terminate()
    proc.wait()
