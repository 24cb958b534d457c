"""Recipe -> objects. :func:`plan` checks a composed recipe before any weights load or any file is
written: the schema's dataclasses check their ranges, each ``_target_`` node is built (tiers and model:
its keys checked) by its own constructor, which checks its arguments, and :mod:`kvtier.checks` relates
them. Any class a ``_target_`` names works, kvtier's or the user's.

The tier stack is sized by one rule (:func:`size_stack`) and built by one builder (:func:`build_stack`), for the
recipes (:func:`plan`, :class:`EngineFactory`) and for the Python door (:func:`kvtier.offload.cache_for`)."""

from __future__ import annotations

import importlib
import inspect
import math
import re
from pathlib import Path
from typing import Callable, NamedTuple, Optional

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from kvtier.budget import TokenBudget
from kvtier.checks import (check_dense_layers, check_device_room, check_kernel, check_max_context, check_memory,
                           check_partial_budget, check_positions, check_recall_room, check_stack, device_pages_needed,
                           graphs_for, pay_for_key_stats, tier_pages)
from kvtier.errors import ConfigError
from kvtier.hook import use_hook
from kvtier.layout import KVLayout
from kvtier.models import check_load_args, kv_layout_for, load_config
from kvtier.policies.base import Policy
from kvtier.report import CacheRecord
from kvtier.schema import check_schema
from kvtier.scopes import All, Resident, Scope
from kvtier.tiers.base import Tier
from kvtier.tiers.memory import HostTier, MemoryTier, default_device
from kvtier.tiers.redis import LOCAL_STORE
from kvtier.tiers.redis_server import LocalRedis

RECIPES = Path(__file__).resolve().parent / "recipes"  # the recipes kvtier ships (Hydra's config folder)
SIZING = ("size", "fraction")  # a lower tier's size keys, in the order kvtier.checks.tier_pages reads them


class Plan(NamedTuple):
    """What :func:`plan` worked out: labels for reports, the context, every tier's pages per layer."""

    labels: dict  # group -> label (policy, scope, tiers, kernel, task, model)
    context_tokens: int
    budget_tokens: int
    capacities: dict  # tier key -> pages per layer (device first)
    layout: KVLayout | None
    needs_model: bool = True  # False: the task loads no model (a simulator: kvtier.sim); run.execute skips it

    @property
    def budget_fraction(self) -> float:
        return self.budget_tokens / self.context_tokens if self.context_tokens else float("nan")


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


def build(node, field: str, call: bool = True, kind: type | None = None, **given):
    """``node``'s ``_target_`` called with its keys plus ``given`` (``call=False``: its keys checked only);
    with ``kind``, the target must be a subclass of it."""
    target = target_of(node, field)
    if kind is not None and not (isinstance(target, type) and issubclass(target, kind)):
        public = f"{kind.__module__.rpartition('.')[0]}.{kind.__name__}"
        raise ConfigError(f"{field}._target_", f"{node._target_} is not a {kind.__name__}: {field.split('.')[0]} "
                                               f"takes a subclass of {public}")
    try:
        signature = inspect.signature(target)
    except (ValueError, TypeError):  # a builtin whose arguments Python cannot list
        raise ConfigError(f"{field}._target_", f"{node._target_} is not a class kvtier can build (its arguments "
                                               "cannot be read)") from None
    for key in (k for k in node if k in given):  # what kvtier gives the constructor itself
        sizing = f": size it with {field}.fraction or {field}.size (the device tier: with budget.*)" \
            if key == "capacity" else ""
        raise ConfigError(f"{field}.{key}", f"is not a recipe key: kvtier sets it{sizing}")
    try:
        signature.bind_partial(**given, **{k: None for k in node if not k.startswith("_")})
    except TypeError as e:
        unknown = re.search(r"unexpected keyword argument '(\w+)'", str(e))
        raise ConfigError(f"{field}.{unknown[1]}" if unknown else field,
                          f"{str(e).split('() ')[-1]}: {node._target_} takes {list(signature.parameters)}, "
                          f"kvtier gives {list(given)}") from None
    check_flags(signature, node, field)
    if not call:
        return target
    try:  # objects (layout, tiers) go to the partial: instantiate would turn them into configs
        return instantiate(OmegaConf.to_container(node, resolve=True), _partial_=True, _convert_="all")(**given)
    except (ValueError, InstantiationException) as e:  # a ValueError (ConfigError too) from the constructor, or
        cause = e.__cause__ if isinstance(e, InstantiationException) else e  # a nested node's constructor failed
        if not isinstance(cause, ConfigError):
            raise ConfigError(field, str(cause or e)) from e
        key = cause.field if cause.field.startswith(field) else f"{field}.{cause.field.rsplit('.', 1)[-1]}"
        raise ConfigError(key, str(cause).split(": ", 1)[-1]) from None


FLAG_KINDS = (bool, "bool", "bool | None", "Optional[bool]", Optional[bool], bool | None)  # a flag's annotations


def check_flags(signature: inspect.Signature, node: DictConfig, field: str) -> None:
    """Each key of ``node`` whose parameter is annotated ``bool`` (``bool | None``) holds true or false (or null)."""
    for key, value in node.items():
        param = signature.parameters.get(key)
        kind = param.annotation if param is not None else None
        if kind in FLAG_KINDS and not isinstance(value, bool) and not (value is None and kind not in (bool, "bool")):
            raise ConfigError(f"{field}.{key}", f"must be true or false{'' if kind in (bool, 'bool') else ' or null'}"
                                                f", got {value!r}")


def label(node) -> str:
    """A short name for reports: the node's ``name``, its model folder or Hub id, or its target's ``name``."""
    if "name" in node or "path" in node or "id" in node:
        return str(node.name) if "name" in node else Path(str(node.get("id") or node.path)).name
    return getattr(target := target_of(node, ""), "name", None) or target.__name__


def plan(cfg: DictConfig) -> Plan:
    """Check the whole recipe (no weights loaded, nothing written); ConfigError names the first bad key."""
    recipe = check_schema(cfg)
    policy, task = build(cfg.policy, "policy", kind=Policy), build(cfg.task, "task")
    scope = build(cfg.scope, "scope", call=False, kind=Scope)
    if not getattr(task, "needs_model", True):  # nothing of the model, tiers or cache is built
        return Plan({"task": task.name}, 0, 0, {}, None, needs_model=False)
    build(cfg.model, "model", call=False)  # the model's device first: other nodes read it
    model = cfg.model
    check_load_args(model.get("dtype"), model.get("device", "cpu"), model.get("attn_implementation", "sdpa"))
    prefill = build(cfg.scheduler.prefill, "scheduler.prefill")
    build(cfg.scheduler.placement, "scheduler.placement")
    build(cfg.logger, "logger")
    kernel = build(cfg.kernel, "kernel")
    _, config = load_config(cfg.model.get("path"), cfg.model.get("id"), cfg.model.get("revision", "main"))
    layout = kv_layout_for(config, page_size=recipe.page_size, dtype=cfg.model.dtype, kv_dtype=recipe.kv_dtype)
    check_positions(task, config)
    check_max_context(recipe.engine.max_context, task, layout.page_size)
    check_dense_layers(cfg.cache.dense_layers, layout.num_layers)
    fidelity = cfg.cache.fidelity and not issubclass(scope, All)
    graphs_for(recipe.engine.graphs, cfg.model.get("device", "cpu"), not kernel.can.captures, fidelity)
    context = task.context_tokens
    chunk = min(prefill.chunk_size, getattr(task, "prompt_tokens", context))  # the longest prefill step
    page_bytes = layout.num_layers * layout.page_bytes  # one page of every layer
    budget = recipe.budget.tokens_for(context, -(-page_bytes // layout.page_size))
    if recipe.method is not None:  # kvpress's press on the model: no tiers, policy, scope nor engine
        return plan_press(recipe.method, task, context, budget, label(cfg.model), cfg.cache)
    check_partial_budget(budget, context, label(cfg.scope), recipe.budget.key)
    check_kernel(kernel, policy, scope, layout, len(cfg.tiers.stack) > 1, bool(cfg.cache.attend_budget), fidelity,
                 cfg.cache.dense_layers)
    rows = getattr(task, "max_batch", recipe.engine.max_batch)  # the engine's rows (a serving task sets its own)
    capacities = size_stack(cfg.tiers.stack, layout, policy, lambda pages: build_scope(cfg, pages), budget,
                            context + task.new_tokens, recipe.budget.key, rows=rows, chunk=chunk,
                            attended=attend_budget(cfg, budget, layout.page_size),
                            give=budget_for(recipe.budget, task, layout.page_size, page_bytes))
    for key, spec in cfg.tiers.stack.items():
        tier, node = target_of(spec, f"tiers.stack.{key}"), OmegaConf.to_container(unsized(spec), resolve=True)
        settings = inspect.signature(tier).bind_partial(layout=layout, capacity=capacities[key], name=key,
                                                        **{k: v for k, v in node.items() if not k.startswith("_")})
        settings.apply_defaults()  # a relative disk path: checked from here, where the run's folder will be
        tier.check_settings(f"tiers.stack.{key}", **settings.arguments)
    labels = {"policy": label(cfg.policy), "scope": label(cfg.scope), "tiers": "_".join(capacities),
              "kernel": kernel.name, "task": task.name, "model": label(cfg.model)}
    return Plan(labels, context, budget, capacities, layout)


def plan_press(method: str, task, context: int, budget: int, model: str, cache) -> Plan:
    """The plan of a ``method=kvpress:<press>`` run: the press keeps ``budget`` KV pairs of the prompt in every layer
    (:mod:`kvtier.eval.kvpress`); MissingDependencyError names ``make compare-env`` where kvpress is not importable."""
    from kvtier.eval import Perplexity
    from kvtier.eval.kvpress import KNOBS, load_kvpress, press_name

    press = press_name(method, "method")
    for key in KNOBS.get(press, {}).values():
        if cache[key] is None:
            raise ConfigError(f"cache.{key}", f"{method} takes its {key} from cache.{key}; set it (kvpress's: 64 "
                                              f"for the window, 4 for the sinks)")
    if not (isinstance(task, Perplexity) or hasattr(task, "run_with")):
        raise ConfigError("method", f"a kvpress press compresses a prompt once; task {task.name} has none to "
                                    "compress: use perplexity, passkey, needle, ruler, longbench or infinitebench")
    load_kvpress()
    labels = {"method": method, "policy": press, "scope": "kvpress", "tiers": "none", "kernel": "eager",
              "task": task.name, "model": model}
    return Plan(labels, context, budget, {}, None)


def budget_for(budget, task, page_size: int, page_bytes: int):
    """``give(pages)`` for :func:`~kvtier.checks.check_device_room`: the setting of the budget's key in force that
    gives the device ``pages`` pages of the task's context (or why none can)."""
    def give(pages: int) -> str:
        tokens, context = (pages - 1) * page_size + 1, task.context_tokens
        if tokens > context:
            return f"that is more than the task's whole context (task.{task.context_key}={context} tokens): give it " \
                   f"a longer one{f', or smaller pages (page_size={page_size})' if page_size >= context else ''}"
        if budget.key == "budget.fraction":
            least = math.ceil(tokens / context * 1000) / 1000
            return f"set budget.fraction >= {least:g} ({tokens} of the {context} tokens of task.{task.context_key}; " \
                   f"{budget.fraction:g} gives {int(budget.fraction * context)})"
        if budget.key == "budget.size":
            nbytes = tokens * -(-page_bytes // page_size)
            return f"set budget.size >= {math.ceil(nbytes / 2**20 * 100) / 100:g}MiB ({nbytes} bytes, {tokens} tokens)"
        return f"set budget.tokens >= {tokens}"
    return give


def unsized(spec: DictConfig) -> DictConfig:
    """A tier node without the size keys (they size it; its constructor takes a capacity in pages)."""
    return OmegaConf.create({k: v for k, v in OmegaConf.to_container(spec, resolve=True).items() if k not in SIZING})


def size_stack(stack: DictConfig, layout: KVLayout, policy: Policy, scope_for: Callable[[int], Scope],
               budget_tokens: int, context_tokens: int, key: str, *, copies: int = 1, rows: int = 1, chunk: int = 0,
               attended: TokenBudget | None = None, give=None) -> dict:
    """Pages per layer of each tier of ``stack`` (tier key -> pages, device first): the one sizing rule.

    The device tier holds ``budget_tokens`` (the setting ``key``) in whole pages for each of ``copies`` sequences
    (a recipe: one pool for all its rows; ``generate``'s cache: each row its own), or under a token budget each step
    attends (``attended``, recipes' ``cache.attend_budget``) what the scope needs for it; the key statistics the
    scope keeps there (``scope_for(device pages per copy)``) and, with several engine ``rows``, the scratch slot
    their idle rows write are paid out of it. Each tier below holds its ``size``, else its ``fraction`` of the
    ``context_tokens`` (prompt and new tokens), per copy. Checked: the device holds what each copy pins and writes
    (``chunk`` tokens at once; ``give(pages)`` names the setting of ``key`` that gives it ``pages``), the stack the
    context, the memory tiers what is free, the device the scope's recall slots."""
    P, page_bytes = layout.page_size, layout.num_layers * layout.page_bytes  # page_bytes: one page of every layer
    pages, budget_pages = layout.pages_for(context_tokens), layout.pages_for(budget_tokens)
    capacities, in_memory = {}, {}  # in_memory: the key sizing a tier held in memory -> (bytes, device)
    for name, spec in stack.items():
        field = f"tiers.stack.{name}"
        tier = build(unsized(spec), field, call=False, kind=Tier, layout=layout, capacity=1, name=name)
        if not capacities and any(spec.get(k) is not None for k in SIZING):
            raise ConfigError(field, f"the device's size is the budget: set {key} instead")
        if capacities:
            capacities[name] = copies * tier_pages(spec, field, pages, page_bytes)
        else:
            kind = type(scope_for(budget_pages)) if attended is not None else None
            device = _device_pages(kind, budget_pages, attended, pages, device_pages_needed(policy, P, chunk))
            scope = scope_for(device)
            capacities[name] = pay_for_key_stats(copies * device, scope, layout, copies * context_tokens, key)
        if issubclass(tier, MemoryTier):
            sizing = key if len(capacities) == 1 else f"{field}.{SIZING[spec.get('size') is None]}"
            place = "cpu" if issubclass(tier, HostTier) else spec.get("device") or default_device()
            in_memory[sizing] = (capacities[name] * page_bytes, place)
    device, scratch = next(iter(capacities.values())), int(rows > 1)
    check_device_room(device, policy, P, chunk, key, copies, scratch, "the scratch slot of the batch's idle rows",
                      give=give if device == copies * budget_pages else None, settable=False)  # the budget's
    check_stack(capacities, copies * pages)
    check_memory(in_memory)
    check_recall_room(device - scratch, policy, P, scope, rows)
    return capacities


def build_stack(stack: DictConfig, layout: KVLayout, capacities: dict, place: Callable[[str, DictConfig], None]) -> list:
    """The tiers of ``stack`` (device first), each built from its node with its pages from ``capacities``;
    ``place(key, node)`` sets where a tier keeps its pages (a disk tier's ``path``, a ``local`` remote's ``url``)
    on its node. A tier that fails to build closes those built before it."""
    made = []
    try:
        for key, spec in stack.items():
            node = unsized(spec)
            place(key, node)
            made.append(build(node, f"tiers.stack.{key}", layout=layout, capacity=capacities[key], name=key))
    except BaseException:
        for tier in made:
            tier.close()
        raise
    return made


def build_scope(cfg: DictConfig, device_pages: int) -> Scope:
    """The recipe's scope; a ``pages: null`` (topk's default) is the device tier's pages."""
    node = OmegaConf.create(OmegaConf.to_container(cfg.scope, resolve=True))
    if node.get("pages", 0) is None:
        node.pages = device_pages
    return build(node, "scope", kind=Scope)


def _device_pages(scope: type[Scope] | None, budget_pages: int, attended: TokenBudget | None, context_pages: int,
                  chunk_room: int) -> int:
    """The device tier's pages: the budget's; under ``cache.attend_budget`` what a continuous
    ``resident`` step attends (and at least the room a prefill chunk needs), else the whole context
    (``topk`` recalls from any tier; ``once`` keeps what it compressed to)."""
    if attended is None:
        return budget_pages
    if issubclass(scope, Resident) and attended.mode == "continuous":
        return max(attended.step_pages, chunk_room)
    return context_pages


def attend_budget(cfg: DictConfig, budget: int, page_size: int) -> TokenBudget | None:
    """The token budget each decode step attends (``cache.attend_budget``), or None.

    ``cache.window`` null: StreamingLLM's, every budget token after the sinks."""
    c = cfg.cache
    if not c.attend_budget:
        return None
    try:
        return TokenBudget(budget, c.sinks, budget - c.sinks if c.window is None else c.window, page_size, c.mode)
    except ConfigError as e:  # the budget's tokens are the budget.* keys' (checked); sinks and window are the cache's
        if e.field != "budget":
            raise
        raise ConfigError("cache.window", f"the budget's {budget} tokens cannot hold cache.sinks={c.sinks} + "
                                          f"cache.window={c.window}: lower cache.window (or cache.sinks), or raise "
                                          "the budget") from None


_LOADED: dict = {}  # one loaded model, reused by the jobs of a multirun in this process


def build_model(cfg: DictConfig, attention: str | None = None):
    """``(model, tokenizer)`` with kvtier's attention hook installed (or Hugging Face's ``attention``)."""
    key = OmegaConf.to_yaml(cfg.model, resolve=True)
    if key not in _LOADED:
        _LOADED.clear()
        _LOADED[key] = build(cfg.model, "model")
    model, tokenizer = _LOADED[key]
    if attention is None:
        use_hook(model)
    else:
        model.set_attn_implementation(attention)
    return model, tokenizer


class EngineFactory:
    """``make_engine()`` for a task: a fresh :class:`~kvtier.engine.Engine` per call (one per sample), every part
    built from the config: tiers, policy, scheduler, kernel, scope, the token budget and the engine's settings.

    Keeps a :class:`~kvtier.report.CacheRecord` of every engine it made (taken, and the engine closed, when the
    next one is made or at :meth:`close`). Disk tiers get a folder per engine; a ``local`` remote url starts
    one redis-server on loopback for the whole run (stopped by :meth:`close`).
    """

    def __init__(self, cfg: DictConfig, plan_: Plan, run_dir: Path, model):
        self.cfg, self.plan, self.run_dir, self.model = cfg, plan_, Path(run_dir), model
        self.records: list[CacheRecord] = []
        self._last, self._servers, self._stores = None, [], {}
        for key, spec in cfg.tiers.stack.items():
            if spec.get("url") == LOCAL_STORE:
                server = LocalRedis()
                self._servers.append(server)
                self._stores[key] = server.url

    def __call__(self, **engine_settings):
        """A fresh engine; ``engine_settings`` override the recipe's ``engine`` group (a task's own batch size)."""
        from kvtier.engine import Engine, EngineConfig

        self._retire()
        tiers = build_stack(self.cfg.tiers.stack, self.plan.layout, self.plan.capacities, self._place)
        c = self.cfg
        attended = attend_budget(c, self.plan.budget_tokens, self.plan.layout.page_size)
        engine_cfg = EngineConfig(**{**OmegaConf.to_container(c.engine, resolve=True), **engine_settings})
        scope = build_scope(c, next(iter(self.plan.capacities.values())))
        self._last = Engine(self.model, self.plan.layout, tiers, build(c.policy, "policy"), scope,
                            build(c.scheduler.placement, "scheduler.placement"), build(c.kernel, "kernel"),
                            build(c.scheduler.prefill, "scheduler.prefill"), budget=attended,
                            exact_prefill=c.cache.exact_prefill, dense_layers=c.cache.dense_layers,
                            fidelity=c.cache.fidelity, config=engine_cfg)
        return self._last

    def _place(self, key: str, node: DictConfig) -> None:
        """A disk tier's folder under the run's, one per engine; a ``local`` remote's url: the run's server."""
        if key in self._stores:
            node.url = self._stores[key]
        if "path" in node:
            node.path = str(self.run_dir / Path(node.path).expanduser() / f"cache-{len(self.records)}")

    def _retire(self) -> None:
        """Record the last engine made, then close it (closing twice is harmless)."""
        if self._last is not None:
            self.records.append(CacheRecord.of(self._last))
            self._last.close()
            self._last = None

    def close(self) -> None:
        """Retire the last engine and stop any local redis-server."""
        self._retire()
        for server in self._servers:
            server.stop()
        self._servers = []
