"""Evaluation tasks over a TieredKVCache: streaming perplexity, passkey retrieval, needle in real text.

Every task is a small validated dataclass with ``run(engine, make_cache, tokenizer, progress=None)``
returning a dict with ``task``, its score (``perplexity`` or ``accuracy``), ``samples`` and
``context_tokens``. ``make_cache`` builds a fresh TieredKVCache per sample; tasks never build tiers.
"""

from __future__ import annotations

import dataclasses

from kvtier.errors import ConfigError
from kvtier.eval.needle import Needle
from kvtier.eval.passkey import Passkey
from kvtier.eval.perplexity import Perplexity

TASKS = {"perplexity": Perplexity, "passkey": Passkey, "needle": Needle}


def build_task(name: str, config: dict | None = None):
    """The task ``name`` with fields from ``config``; ConfigError names an unknown task or field."""
    if name not in TASKS:
        raise ConfigError("task", f"unknown task {name!r}; use one of {sorted(TASKS)}")
    cls = TASKS[name]
    allowed = [f.name for f in dataclasses.fields(cls)]
    for key in config or {}:
        if key not in allowed:
            raise ConfigError(f"task.{key}", f"task {name!r} has no field {key!r}; its fields are {allowed}")
    return cls(**(config or {}))


__all__ = ["Needle", "Passkey", "Perplexity", "TASKS", "build_task"]
