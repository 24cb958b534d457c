"""Serving on the engine: radix prefix cache, request scheduler, trace replay."""

from kvtier.serve.radix import PrefixMatch, RadixCache
from kvtier.serve.scheduler import Request, ServeScheduler
from kvtier.serve.task import ServeTrace

__all__ = ["PrefixMatch", "RadixCache", "Request", "ServeScheduler", "ServeTrace"]
