"""Serving on the fast engine: radix prefix cache, request scheduler, trace replay."""

from kvtier.serve.radix import PrefixMatch, RadixCache

__all__ = ["PrefixMatch", "RadixCache"]
