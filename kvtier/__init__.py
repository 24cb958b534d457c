"""kvtier: multi-tier paged KV caches for LLM inference research.

The public API: a cache (:class:`TieredKVCache`) over a tier stack, a policy and a scheduler, run by
an :class:`Engine` on a model loaded with :func:`load_model`; :func:`run` runs a whole recipe;
:func:`offload` and :func:`cache_for` put a cache under Hugging Face ``generate`` in one line.

Each name is imported on first use (:mod:`kvtier.lazy`): the simulator (:mod:`kvtier.sim`) runs without
torch or transformers.
"""

from kvtier.lazy import lazy_exports

lazy_exports(__name__, {
    "kvtier.budget": ("TokenBudget",),
    "kvtier.cache": ("TieredKVCache",),
    "kvtier.engine": ("Engine", "EngineConfig"),
    "kvtier.errors": ("ConfigError", "KVTierError", "MissingDependencyError"),
    "kvtier.hook": ("install",),
    "kvtier.kernels.registry": ("make_backend",),
    "kvtier.layout": ("KVLayout",),
    "kvtier.metrics": ("bytes_moved",),
    "kvtier.models": ("kv_layout_for", "load_model", "tiny_llama"),
    "kvtier.offload": ("cache_for", "offload"),
    "kvtier.policies": ("ASPE", "LRU", "Compose", "Policy", "SinkWindow"),
    "kvtier.scheduler": ("LookaheadScheduler",),
    "kvtier.scheduler.chunked_prefill": ("ChunkedPrefill",),
    "kvtier.table": ("BlockTable",),
    "kvtier.tiers": ("DeviceTier", "DiskTier", "HostTier", "MooncakeTier", "RedisTier", "Tier"),
})
