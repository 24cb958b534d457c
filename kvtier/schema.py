"""The recipe's schema: typed dataclasses that Hydra merges every recipe into (``config.yaml``'s first
default), each checking its own ranges. Nodes built from a ``_target_`` (model, policy, scope, tiers,
kernel, task, logger) are open: their keys go to the target's constructor (:mod:`kvtier.build`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from kvtier.budget import check_mode
from kvtier.checks import parse_bytes
from kvtier.engine.config import EngineConfig
from kvtier.errors import ConfigError


BUDGET_SIZING = ("tokens", "size", "fraction")  # the budget's keys, in the order they are read


@dataclass
class Budget:
    """Device-tier KV per sequence: ``tokens``, else ``size`` (bytes over all layers, "64MiB"), else
    ``fraction`` of the task's context, in (0, 1]."""

    tokens: Optional[int] = None
    size: Optional[str] = None
    fraction: Optional[float] = 0.25

    def __post_init__(self):
        if self.fraction is not None and not 0 < self.fraction <= 1:  # nan too
            raise ConfigError("budget.fraction", f"must be in (0, 1], got {self.fraction}")

    @property
    def key(self) -> str:
        """The setting in force: ``budget.tokens``, else ``budget.size``, else ``budget.fraction``."""
        return "budget." + next((k for k in BUDGET_SIZING[:-1] if getattr(self, k) is not None), BUDGET_SIZING[-1])

    def tokens_for(self, context: int, token_bytes: int) -> int:
        """Device tokens for a task of ``context`` tokens, each ``token_bytes`` of KV over all layers."""
        tokens = self.tokens if self.tokens is not None else int((self.fraction or 0) * context) \
            if self.size is None else parse_bytes(self.size, "budget.size") // token_bytes
        if not 1 <= tokens <= context:
            raise ConfigError(self.key, f"{getattr(self, self.key[7:])} gives {tokens} device tokens; the task's "
                                        f"context is {context}: give it 1 to {context}")
        return tokens


@dataclass
class Tiers:
    stack: Dict[str, Any] = MISSING  # device first; each a _target_ tier, lower ones sized by fraction or size


@dataclass
class Scheduler:
    placement: Any = MISSING  # the migration planner (_target_)
    prefill: Any = MISSING  # the prompt chunker (_target_)


@dataclass
class Cache:
    """What each decode step attends: ``attend_budget`` makes the budget also the keys each decode step
    attends (:mod:`kvtier.budget`: ``sinks`` + middle pages + a ``window``, null: the rest of it). A
    scope's options are its own node's (``scope.pages``, ...; the keys that were here: :data:`MOVED`)."""

    sinks: int = 4
    fidelity: bool = True
    attend_budget: bool = False
    window: Optional[int] = 64
    mode: str = "continuous"
    exact_prefill: bool = False
    dense_layers: int = 0

    def __post_init__(self):
        if self.sinks < 0:
            raise ConfigError("cache.sinks", f"must be >= 0, got {self.sinks}")
        check_mode(self.mode)


@dataclass
class Recipe:
    model: Any = MISSING
    tiers: Tiers = MISSING
    policy: Any = MISSING
    scheduler: Scheduler = MISSING
    kernel: Any = MISSING
    task: Any = MISSING
    logger: Any = MISSING
    scope: Any = MISSING  # which pages a decode step attends (_target_: a kvtier.scopes.Scope)
    page_size: int = 16
    kv_dtype: Optional[str] = None  # None: the model's dtype; "fp8_e4m3" / "int8": 8-bit pages with scales (quant.py)
    budget: Budget = field(default_factory=Budget)
    cache: Cache = field(default_factory=Cache)
    engine: EngineConfig = field(default_factory=EngineConfig)
    progress: bool = True
    cpu_threads: Optional[int] = 1
    method: Optional[str] = None  # None: kvtier's engine; "kvpress:<press>": kvpress's press (kvtier/eval/kvpress.py)

    def __post_init__(self):
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ConfigError("cpu_threads", f"must be >= 1 (or null: torch's default), got {self.cpu_threads}")


ConfigStore.instance().store(name="kvtier_schema", node=Recipe)

# keys that left the schema -> where they live now (the topk scope owns its options)
MOVED = {"cache.topk_pages": "scope.pages", **{f"cache.{k}": f"scope.{k}" for k in
                                               ("rank", "per_head", "query_rows", "policy_share", "recall_slots")}}


def unknown_key(parent: str, leaf: str, hint: str = "") -> ConfigError:
    """The error for ``parent.leaf``, a key the recipe lacks: where it moved, else a spelling hint."""
    key = f"{parent}.{leaf}" if parent else leaf
    if key in MOVED:
        return ConfigError(key, f"moved to {MOVED[key]}, an option of the topk scope: kvtier-run scope=topk "
                                f"{MOVED[key]}=...")
    return ConfigError(parent or leaf, f"has no key {leaf!r}; check its spelling (kvtier-run --cfg job prints "
                                       f"every key){hint}")


def check_schema(cfg) -> Recipe:
    """``cfg`` (its hydra node aside) as a :class:`Recipe`; ConfigError names a key that is unknown (added
    by ``+key=``), unset or out of range."""
    try:
        plain = OmegaConf.to_container(cfg)
        return OmegaConf.to_object(OmegaConf.merge(Recipe, {k: v for k, v in plain.items() if k != "hydra"}))
    except MissingMandatoryValue as e:
        raise ConfigError(str(e.full_key), f"has no value; set it, e.g. kvtier-run {e.full_key}=...") from None
    except OmegaConfBaseException as e:
        parent, _, leaf = str(e.full_key).rpartition(".")
        raise unknown_key(parent, leaf) from None
