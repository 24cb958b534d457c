"""The one engine: sequences in rows, a step that plans, runs and feeds back (:mod:`kvtier.engine.engine`)."""

from kvtier.engine.config import EngineConfig
from kvtier.engine.engine import Engine

__all__ = ["Engine", "EngineConfig"]
