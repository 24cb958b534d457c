"""kvtier: multi-tier paged KV caches for LLM inference research."""

from kvtier.layout import KVLayout
from kvtier.table import BlockTable

__all__ = ["BlockTable", "KVLayout"]
