"""Placement policies, one dataclass per file; ``POLICIES`` maps recipe names to classes.

A scored policy (:mod:`kvtier.policies.scored`) is a scorer over :class:`PageStats` plus sinks and
a recent window pinned: StreamingLLM (:class:`SinkWindow`), :class:`H2O`, :class:`TOVA`,
:class:`SnapKV`, :class:`Knorm`, :class:`Quest`, :class:`ExpectedAttention`, :class:`ASPE`.
Each name is imported on first use (:mod:`kvtier.lazy`): :mod:`kvtier.policies.base` alone needs no torch.
"""

from kvtier.lazy import lazy_exports

lazy_exports(__name__, {
    "kvtier.policies.aspe": ("ASPE",),
    "kvtier.policies.base": ("EVICT", "PINNED", "PageInfo", "Policy"),
    "kvtier.policies.compose": ("Compose",),
    "kvtier.policies.expected_attention": ("ExpectedAttention",),
    "kvtier.policies.h2o": ("H2O",),
    "kvtier.policies.knorm": ("Knorm",),
    "kvtier.policies.lru": ("LRU",),
    "kvtier.policies.quest": ("Quest",),
    "kvtier.policies.registry": ("POLICIES",),
    "kvtier.policies.scored": ("ScoredPolicy", "Scorer"),
    "kvtier.policies.sink_window": ("SinkWindow",),
    "kvtier.policies.snapkv": ("SnapKV",),
    "kvtier.policies.stats": ("PageStats",),
    "kvtier.policies.tova": ("TOVA",),
})
