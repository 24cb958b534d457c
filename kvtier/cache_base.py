"""The attention hook's link to the engine: the active ``past_key_values`` and the one the engine's own
forward passes to the model's attention modules."""

from __future__ import annotations

import contextvars

import torch

from kvtier.compat import PagedCacheBase

ACTIVE_CACHE: contextvars.ContextVar = contextvars.ContextVar("kvtier_cache", default=None)


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
