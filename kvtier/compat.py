"""The one place that knows how transformers 5.x changed (5.2 .. newest 5.x).

- ``Cache.update(key, value, layer_idx[, cache_kwargs])``: 5.2 passes cache_kwargs, later
  releases do not.
- ``Cache.get_mask_sizes``: 5.2 takes ``cache_position`` (a tensor), later releases take
  ``query_length`` (an int).
- Attention and mask functions are registered by name; a mask function must be registered
  for a custom attention name or masks silently become None.
- ``generate`` expands each prompt into ``max(num_beams, num_return_sequences)`` rows
  (``repeat_interleave``) before the first forward, and beam search calls ``Cache.reorder_cache(beam_idx)``
  after every step (a model's own ``_reorder_cache`` first, where it has one).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface

ATTN_NAME = "kvtier"


def query_length(query_or_position) -> int:
    """Number of new query tokens from 5.2's ``cache_position`` tensor or a later ``query_length``."""
    if isinstance(query_or_position, torch.Tensor):
        return int(query_or_position.shape[-1])
    return int(query_or_position)


class PagedLayer(CacheLayerMixin):
    """Placeholder layer: storage lives in kvtier's tiers, so HF's per-layer tensors stay empty."""

    is_compileable = False

    def __init__(self, cache, layer_idx: int, is_sliding: bool = False):
        super().__init__()
        self.cache, self.layer_idx, self.is_sliding = cache, layer_idx, is_sliding
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states):
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        return self.cache.update(key_states, value_states, self.layer_idx)

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.cache.get_seq_length()

    def get_mask_sizes(self, query, *args, **kwargs) -> tuple[int, int]:
        return self.cache.get_mask_sizes(query, self.layer_idx)

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return -1

    def reset(self):
        raise NotImplementedError("reset a TieredKVCache by building a new one")


class PagedCacheBase(Cache):
    """A transformers Cache whose layers are kvtier pages; subclasses implement ``update``.

    One layer per layer of ``layout``; HF reads ``is_sliding`` of each (the layout's window).
    """

    def __init__(self, layout):
        super().__init__(layers=[PagedLayer(self, i, layout.window(i) > 0) for i in range(layout.num_layers)])

    def get_mask_sizes(self, query, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length(query), 0

    @property
    def is_compileable(self) -> bool:
        return False


def register_attention(attention_fn, mask_fn) -> None:
    """Register ``attn_implementation="kvtier"`` and its mask function (idempotent)."""
    AttentionInterface.register(ATTN_NAME, attention_fn)
    AttentionMaskInterface.register(ATTN_NAME, mask_fn)  # the global mapping: a local entry is ignored
