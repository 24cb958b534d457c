"""kvtier: multi-tier paged KV caches for LLM inference research.

The public API: a cache (:class:`TieredKVCache`) over a tier stack, a policy and a scheduler, run by
an :class:`Engine` on a model loaded with :func:`load_model`; :func:`run` runs a whole recipe;
:func:`offload` and :func:`cache_for` put a cache under Hugging Face ``generate`` in one line.
"""

from kvtier.budget import TokenBudget
from kvtier.cache import TieredKVCache
from kvtier.engine import Engine, EngineConfig
from kvtier.errors import ConfigError, KVTierError, MissingDependencyError
from kvtier.hook import install
from kvtier.kernels.registry import make_backend
from kvtier.layout import KVLayout
from kvtier.metrics import bytes_moved
from kvtier.models import kv_layout_for, load_model, tiny_llama
from kvtier.offload import cache_for, offload
from kvtier.policies import ASPE, LRU, Compose, Policy, SinkWindow
from kvtier.scheduler import LookaheadScheduler
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.table import BlockTable
from kvtier.tiers import DeviceTier, DiskTier, HostTier, MooncakeTier, RedisTier, Tier

__all__ = ["ASPE", "BlockTable", "ChunkedPrefill", "Compose", "ConfigError", "DeviceTier", "DiskTier", "Engine",
           "EngineConfig", "HostTier", "KVLayout", "KVTierError", "LRU", "LookaheadScheduler", "MissingDependencyError",
           "MooncakeTier", "Policy", "RedisTier", "SinkWindow", "Tier", "TieredKVCache", "TokenBudget", "bytes_moved",
           "cache_for", "install", "kv_layout_for", "load_model", "make_backend", "offload", "tiny_llama"]
