"""Serving on the engine: request scheduler (over the engine's radix prefix cache, :mod:`kvtier.radix`), trace replay."""

from kvtier.serve.scheduler import Request, ServeScheduler
from kvtier.serve.task import ServeTrace

__all__ = ["Request", "ServeScheduler", "ServeTrace"]
