"""Evaluation tasks over kvtier's engine: streaming perplexity, passkey retrieval, needle in real text, and the
benchmarks papers report (RULER, LongBench v1/v2, InfiniteBench; :mod:`kvtier.eval.generation` is their common loop).

Every task is a small validated dataclass with ``run(make_engine, tokenizer, progress=None)`` returning a dict
with ``task``, its score (``perplexity``, ``accuracy``, or a benchmark's own 0-100 ``score`` with ``per_group``),
``samples`` and ``context_tokens``. ``make_engine`` builds a fresh engine per sample; tasks never build tiers.
"""

from __future__ import annotations

import dataclasses

from kvtier.errors import ConfigError
from kvtier.eval.needle import Needle
from kvtier.eval.passkey import Passkey
from kvtier.eval.infinitebench import InfiniteBench
from kvtier.eval.longbench import LongBench
from kvtier.eval.perplexity import Perplexity
from kvtier.eval.ruler import Ruler

TASKS = {"perplexity": Perplexity, "passkey": Passkey, "needle": Needle, "ruler": Ruler, "longbench": LongBench,
         "infinitebench": InfiniteBench}


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


__all__ = ["InfiniteBench", "LongBench", "Needle", "Passkey", "Perplexity", "Ruler", "TASKS", "build_task"]
