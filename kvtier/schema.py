"""The recipe's schema: typed dataclasses that Hydra merges every recipe into (``config.yaml``'s first
default), each checking its own ranges. Nodes built from a ``_target_`` (model, policy, tiers, kernel,
task, logger) are open: their keys go to the target's constructor (:mod:`kvtier.build`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from kvtier.checks import check_cache_options, parse_bytes
from kvtier.engine.config import EngineConfig
from kvtier.errors import ConfigError


class Scope(str, Enum):
    """Which pages attention reads: ``all`` (exact), ``resident`` (device pages), ``topk`` (Quest pages)."""

    all = "all"
    resident = "resident"
    topk = "topk"


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
        return "budget." + next((k for k in ("tokens", "size") if getattr(self, k) is not None), "fraction")

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
    attends (:mod:`kvtier.budget`: ``sinks`` + middle pages + a ``window``, null: the rest of it); the
    ``topk`` scope's options (``topk_pages``, ``rank``, ``per_head``, ``query_rows``, ``policy_share``)."""

    topk_pages: Optional[int] = None
    sinks: int = 4
    fidelity: bool = True
    attend_budget: bool = False
    window: Optional[int] = 64
    mode: str = "continuous"
    exact_prefill: bool = False
    rank: str = "quest"
    per_head: bool = False
    query_rows: int = 1
    policy_share: float = 0.0
    recall_slots: int = 0
    dense_layers: int = 0

    def __post_init__(self):
        if self.topk_pages is not None and self.topk_pages < 1 or self.sinks < 0:
            raise ConfigError("cache", f"topk_pages must be >= 1 (or null) and sinks >= 0, got {self.topk_pages} "
                                       f"and {self.sinks}")
        check_cache_options(self.mode, self.rank, self.query_rows, self.policy_share)


@dataclass
class Recipe:
    model: Any = MISSING
    tiers: Tiers = MISSING
    policy: Any = MISSING
    scheduler: Scheduler = MISSING
    kernel: Any = MISSING
    task: Any = MISSING
    logger: Any = MISSING
    scope: Scope = Scope.resident
    page_size: int = 16
    kv_dtype: Optional[str] = None  # None: the model's dtype; "fp8_e4m3": FP8 pages with per-page scales
    budget: Budget = field(default_factory=Budget)
    cache: Cache = field(default_factory=Cache)
    engine: EngineConfig = field(default_factory=EngineConfig)
    progress: bool = True
    cpu_threads: Optional[int] = 1

    def __post_init__(self):
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ConfigError("cpu_threads", f"must be >= 1 (or null: torch's default), got {self.cpu_threads}")


ConfigStore.instance().store(name="kvtier_schema", node=Recipe)


def check_schema(cfg) -> Recipe:
    """``cfg`` (its hydra node aside) as a :class:`Recipe`; ConfigError names a key that is unknown (added
    by ``+key=``), unset or out of range."""
    try:
        plain = OmegaConf.to_container(cfg, enum_to_str=True)
        return OmegaConf.to_object(OmegaConf.merge(Recipe, {k: v for k, v in plain.items() if k != "hydra"}))
    except MissingMandatoryValue as e:
        raise ConfigError(str(e.full_key), f"has no value; set it, e.g. kvtier-run {e.full_key}=...") from None
    except OmegaConfBaseException as e:
        parent, _, leaf = str(e.full_key).rpartition(".")
        raise ConfigError(parent or leaf, f"has no key {leaf!r}; check its spelling (kvtier-run --cfg job "
                                          "prints every key)") from None
