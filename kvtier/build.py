"""Recipe -> objects. :func:`plan` checks a composed recipe before any weights load or any file is
written: every ``_target_`` node is built (or, for tiers, model and kernel, checked) by its own
constructor, and :mod:`kvtier.checks` relates them. Any class a ``_target_`` names works, kvtier's or
the user's. A ConfigError names the recipe key to change (``budget.tokens``, ``tiers.stack.disk.path``).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from kvtier.budget import TokenBudget
from kvtier.checks import (budget_tokens, check_device_room, check_positions, check_stack, device_pages_needed,
                           tier_pages)
from kvtier.errors import ConfigError
from kvtier.hook import install
from kvtier.kernels.registry import make_backend
from kvtier.models import MODEL_DTYPES, kv_layout_for, load_config
from kvtier.report import CacheRecord
from kvtier.schema import check_schema
from kvtier.tiers.disk import check_folder
from kvtier.tiers.remote import parse_address, start_local_server

LOCAL_STORE = "local"  # tiers.stack.<remote>.address that starts a page server for the run


@dataclass(frozen=True)
class Plan:
    """What :func:`plan` worked out: labels for reports, the context, every tier's pages per layer."""

    labels: dict  # group -> label (policy, scope, tiers, kernel, task, model)
    context_tokens: int
    budget_tokens: int
    capacities: dict  # tier key -> pages per layer (device first)
    layout: object  # KVLayout

    @property
    def budget_fraction(self) -> float:
        return self.budget_tokens / self.context_tokens


def target_of(node, field: str):
    """The class or function a ``_target_`` node names."""
    if not isinstance(node, DictConfig) or "_target_" not in node:
        raise ConfigError(field, "must be a config node with a _target_ naming the class to build")
    module, _, name = str(node._target_).rpartition(".")
    try:
        found = importlib.import_module(module)
    except (ImportError, ValueError) as e:
        raise ConfigError(f"{field}._target_", f"{node._target_!r} is not importable ({e}); check the module "
                                               "path, or put your module on PYTHONPATH") from None
    if not hasattr(found, name):
        raise ConfigError(f"{field}._target_", f"{module} has no {name!r}; it offers "
                                               f"{getattr(found, '__all__', None) or sorted(vars(found))}")
    return getattr(found, name)


def build(node, field: str, **given):
    """``node``'s ``_target_`` called with its keys plus ``given``; a bad key or value is a ConfigError."""
    target = target_of(node, field)
    params = inspect.signature(target).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        for key in node:
            if not key.startswith("_") and key not in params:
                allowed = [p for p in params if p not in given]
                raise ConfigError(field, f"{node._target_} has no parameter {key!r}; its parameters are {allowed}")
    try:  # objects (layout, tiers) go to the partial: instantiate would turn them into configs
        return instantiate(OmegaConf.to_container(node, resolve=True), _partial_=True, _convert_="all")(**given)
    except (ConfigError, InstantiationException) as e:
        cause = e
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise ConfigError(field, str(e.__cause__ or e)) from e
        key = cause.field.rsplit(".", 1)[-1]
        raise ConfigError(cause.field if cause.field.startswith(field) else f"{field}.{key}",
                          str(cause).split(": ", 1)[-1]) from None


def label(node) -> str:
    """A short name for reports: the node's ``name``, its model folder, or its target's ``name``."""
    if "name" in node:
        return str(node.name)
    if "path" in node:
        return Path(str(node.path)).name
    target = target_of(node, "")
    return getattr(target, "name", None) or target.__name__


def plan(cfg: DictConfig) -> Plan:
    """Check the whole recipe (no weights loaded, nothing written); ConfigError names the first bad key."""
    check_schema(cfg)
    policy = build(cfg.policy, "policy")
    prefill = build(cfg.scheduler.prefill, "scheduler.prefill")
    build(cfg.scheduler.placement, "scheduler.placement")
    task = build(cfg.task, "task")
    build(cfg.logger, "logger")
    if cfg.cache.topk_pages is not None and cfg.cache.topk_pages < 1 or cfg.cache.sinks < 0:
        raise ConfigError("cache", "topk_pages must be >= 1 (or null) and sinks >= 0")
    layout, config = _model(cfg)
    check_positions(task, config)
    _check_kernel(cfg, policy)
    context, pages = task.context_tokens, layout.pages_for(task.context_tokens + task.new_tokens)
    page_bytes = layout.num_layers * layout.page_bytes  # one page of every layer
    budget = budget_tokens(cfg.budget, context, -(-page_bytes // layout.page_size))
    attended = attend_budget(cfg, budget, layout.page_size)
    stack = cfg.tiers.stack
    capacities = {}
    for i, (key, spec) in enumerate(stack.items()):
        field = f"tiers.stack.{key}"
        target_of(spec, field)
        if {"capacity", "layout", "name"} & set(spec):
            raise ConfigError(field, "capacity, layout and name come from the budget, the model and the key; "
                                     "size a lower tier with fraction or size")
        if i == 0 and (spec.get("fraction") is not None or spec.get("size") is not None):
            raise ConfigError(field, "the device tier's size is the budget: set budget.tokens, budget.size "
                                     "or budget.fraction")
        chunk_room = device_pages_needed(policy, layout.page_size, min(prefill.chunk_size, context))
        capacities[key] = tier_pages(spec, key, pages, page_bytes) if i else \
            _device_pages(cfg, layout.pages_for(budget), attended, pages, chunk_room)
        if "path" in spec:  # a disk tier: relative paths live in the run folder
            check_folder(spec.path if Path(spec.path).is_absolute() else ".", f"{field}.path")
        if spec.get("address", LOCAL_STORE) != LOCAL_STORE:
            parse_address(spec.address, f"{field}.address")
    device = next(iter(capacities))
    check_device_room(capacities[device], policy, layout.page_size, min(prefill.chunk_size, context),
                      next(f"budget.{k}" for k in ("tokens", "size", "fraction") if cfg.budget[k] is not None))
    check_stack(capacities, pages)
    labels = {"policy": label(cfg.policy), "scope": cfg.scope.value, "tiers": "_".join(stack),
              "kernel": label(cfg.kernel), "task": task.name, "model": label(cfg.model)}
    return Plan(labels, context, budget, capacities, layout)


def _device_pages(cfg: DictConfig, budget_pages: int, attended: TokenBudget | None, context_pages: int,
                  chunk_room: int) -> int:
    """The device tier's pages: the budget's; under ``cache.attend_budget`` what a continuous
    ``resident`` step attends (and at least the room a prefill chunk needs), else the whole context
    (``topk`` recalls from any tier; ``once`` keeps what it compressed to)."""
    if attended is None:
        return budget_pages
    if cfg.scope.value == "resident" and attended.mode == "continuous":
        return max(attended.step_pages, chunk_room)
    return context_pages


def attend_budget(cfg: DictConfig, budget: int, page_size: int) -> TokenBudget | None:
    """The token budget each decode step attends (``cache.attend_budget``), or None.

    ``cache.window`` null: StreamingLLM's, every budget token after the sinks."""
    c = cfg.cache
    if not c.attend_budget:
        return None
    return TokenBudget(budget, c.sinks, budget - c.sinks if c.window is None else c.window, page_size, c.mode)


def _model(cfg: DictConfig):
    """``(KVLayout, HF config)`` of the model node (a loader taking ``path``, ``dtype``, ``device``), no weights."""
    model = cfg.model
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
    _, config = load_config(model.path)
    return kv_layout_for(config, page_size=cfg.page_size, dtype=model.dtype), config


def _check_kernel(cfg: DictConfig, policy) -> None:
    """kvtier's GPU kernels need what this machine has; a salience policy needs a kernel that gives it."""
    if target_of(cfg.kernel, "kernel") is not make_backend:
        return
    name, cuda = cfg.kernel.get("name"), torch.device(cfg.model.get("device", "cpu")).type == "cuda"
    if name == "flashinfer" and (not cuda or importlib.util.find_spec("flashinfer") is None):
        raise ConfigError("kernel", "kernel=flashinfer needs a GPU and pip install 'kvtier[gpu]'; use kernel=torch")
    if name == "flashinfer" and policy.needs_salience:
        raise ConfigError("kernel", f"policy '{policy.name}' needs page salience, which FlashInfer does not give; "
                                    "use kernel=triton or kernel=torch")
    if name == "triton" and not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("kernel", "kernel=triton on the CPU runs only under TRITON_INTERPRET=1 (slow); "
                                    "use kernel=torch")
    if name not in ("flashinfer", "triton"):
        make_backend(name)  # the registry's own check of the name


_LOADED: dict = {}  # one loaded model, reused by the jobs of a multirun in this process


def build_model(cfg: DictConfig, plan_: Plan):
    """``(model, tokenizer)`` with kvtier's attention hook installed, and its KVLayout."""
    key = OmegaConf.to_yaml(cfg.model, resolve=True)
    if key not in _LOADED:
        _LOADED.clear()
        _LOADED[key] = build(cfg.model, "model")
    model, tokenizer = _LOADED[key]
    model.set_attn_implementation(install())
    return model, tokenizer, plan_.layout


class CacheFactory:
    """``make_cache()`` for a task: a fresh TieredKVCache per call, every part built from the config.

    Keeps a :class:`~kvtier.report.CacheRecord` of every cache it made (taken when the next one is
    made, or at :meth:`close`). Disk tiers get a folder per cache; a ``local`` remote address starts
    one page server for the whole run (stopped by :meth:`close`).
    """

    def __init__(self, cfg: DictConfig, plan_: Plan, layout, run_dir: Path):
        self.cfg, self.plan, self.layout, self.run_dir = cfg, plan_, layout, Path(run_dir)
        self.records: list[CacheRecord] = []
        self._last = None
        self._resources = contextlib.ExitStack()
        self._stores: dict[str, str] = {}
        for key, spec in cfg.tiers.stack.items():
            if spec.get("address") == LOCAL_STORE:
                nbytes = 2 * layout.num_layers * plan_.capacities[key] * layout.page_bytes  # room for two caches
                proc, self._stores[key] = start_local_server(nbytes)
                self._resources.callback(_stop, proc)

    def __call__(self):
        self._record_last()
        tiers = [self._tier(key, spec) for key, spec in self.cfg.tiers.stack.items()]
        topk = self.cfg.cache.topk_pages or next(iter(self.plan.capacities.values()))
        attended = attend_budget(self.cfg, self.plan.budget_tokens, self.layout.page_size)
        node = OmegaConf.masked_copy(self.cfg.cache, [k for k in self.cfg.cache
                                                      if k not in ("attend_budget", "window")])
        budget = {} if attended is None else {"budget": attended.tokens, "window": attended.window}
        self._last = build(node, "cache", layout=self.layout, tiers=tiers, **budget,
                           policy=build(self.cfg.policy, "policy"),
                           scheduler=build(self.cfg.scheduler.placement, "scheduler.placement"),
                           backend=build(self.cfg.kernel, "kernel"), scope=self.cfg.scope.value, topk_pages=topk)
        return self._last

    def _tier(self, key: str, spec: DictConfig):
        extra = {"address": self._stores[key]} if key in self._stores else {}
        if "path" in spec:
            extra["path"] = self.run_dir / Path(spec.path).expanduser() / f"cache-{len(self.records)}"
        node = OmegaConf.create({k: v for k, v in OmegaConf.to_container(spec, resolve=True).items()
                                 if k not in ("fraction", "size")})
        return build(node, f"tiers.stack.{key}", layout=self.layout, capacity=self.plan.capacities[key], name=key,
                     **extra)

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
