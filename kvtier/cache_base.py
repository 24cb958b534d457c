"""The attention hook's link to the engine: the active ``past_key_values``, the forward's padding mask, and the
cache the engine's own forward passes to the model's attention modules."""

from __future__ import annotations

import contextvars

import torch

from kvtier.compat import PagedCacheBase

ACTIVE_CACHE: contextvars.ContextVar = contextvars.ContextVar("kvtier_cache", default=None)
# the forward's 2-D attention mask [B, seen + new tokens] (bool), handed from the hook's mask function to the
# TieredKVCache that opens the forward's step (which takes it: None until the next forward's mask function)
STEP_MASK: contextvars.ContextVar = contextvars.ContextVar("kvtier_step_mask", default=None)


class PassCache(PagedCacheBase):
    """The ``past_key_values`` the attention modules see during an engine step: ``update`` stores the
    K/V, the hook's ``attend`` reads the pages (both on the engine)."""

    def __init__(self, engine):
        super().__init__(engine.layout)
        self.engine, self.layout = engine, engine.layout

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.engine.store(layer_idx, key_states, value_states)
        return key_states, value_states

    def attend(self, layer: int, query: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
        return self.engine.attend(layer, query, scaling)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0
