"""The recipe's schema: typed dataclasses that Hydra merges every recipe into (``config.yaml``'s first
default), so an unknown or mistyped top-level key fails when the config is composed. Nodes built from a
``_target_`` (model, policy, tiers, kernel, task, logger) are open: their keys are checked against the
target's own parameters when it is built (:mod:`kvtier.build`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from kvtier.errors import ConfigError


class Scope(str, Enum):
    """Which pages attention reads: ``all`` (exact), ``resident`` (device pages), ``topk`` (Quest pages)."""

    all = "all"
    resident = "resident"
    topk = "topk"


@dataclass
class Budget:
    """Device-tier KV per sequence: ``tokens``, else ``size`` (bytes, e.g. "64MiB"), else ``fraction`` of
    the task's context, in (0, 1]."""

    tokens: Optional[int] = None
    size: Optional[str] = None
    fraction: Optional[float] = 0.25


@dataclass
class Tiers:
    """The tier stack, device first; each entry a ``_target_`` tier sized by ``fraction`` or ``size``."""

    stack: Dict[str, Any] = MISSING


@dataclass
class Scheduler:
    placement: Any = MISSING  # the migration planner (_target_)
    prefill: Any = MISSING  # the prompt chunker (_target_)


@dataclass
class Cache:
    """TieredKVCache's arguments; ``attend_budget`` makes the budget also the keys each decode step
    attends (:mod:`kvtier.budget`: ``sinks`` + middle pages + a ``window``, null: the rest of it)."""

    _target_: str = "kvtier.cache.TieredKVCache"
    merge: bool = False
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
    budget: Budget = field(default_factory=Budget)
    cache: Cache = field(default_factory=Cache)
    progress: bool = True
    cpu_threads: Optional[int] = 1


ConfigStore.instance().store(name="kvtier_schema", node=Recipe)


def check_schema(cfg) -> None:
    """ConfigError unless ``cfg`` (hydra node aside) fits :class:`Recipe`: catches keys added by ``+key=``."""
    try:
        plain = OmegaConf.to_container(cfg, enum_to_str=True)
        OmegaConf.merge(OmegaConf.structured(Recipe), {k: v for k, v in plain.items() if k != "hydra"})
    except OmegaConfBaseException as e:
        parent, _, leaf = str(e.full_key).rpartition(".")
        raise ConfigError(parent or leaf, f"has no key {leaf!r}; check its spelling (kvtier-run --cfg job "
                                          "prints every key)") from None
