"""The attention hook: ``attn_implementation="kvtier"`` routes a model's attention to its TieredKVCache."""

from __future__ import annotations

import weakref
from typing import Callable

import torch

from kvtier.cache_base import ACTIVE_CACHE, STEP_MASK
from kvtier.compat import ATTN_NAME, register_attention
from kvtier.errors import ConfigError
from kvtier.support import check_attention_call


def kvtier_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """query ``[B, H, q, D]`` -> ``([B, q, H, D], None)`` over the cache's pages of ``module.layer_idx``.

    ``key``/``value`` are the step's own K/V, already written into pages by ``TieredKVCache.update``.
    Anything in the call that kvtier cannot honour (soft-capping, sinks, a bias, a mask, a
    ``sliding_window`` other than the layout's, an unknown keyword) raises UnsupportedAttentionError.
    """
    cache = ACTIVE_CACHE.get()
    if cache is None:
        raise ConfigError("past_key_values", "attn_implementation='kvtier' needs past_key_values=TieredKVCache(...)")
    if dropout:
        raise ConfigError("dropout", "kvtier attention is for inference; call model.eval()")
    if query.dtype != cache.layout.dtype:
        raise ConfigError("dtype", f"the cache's layout computes in {cache.layout.dtype}, the model in {query.dtype}; "
                                   f"build it with kv_layout_for(model.config, dtype={query.dtype}) (pages may be "
                                   "stored narrower with kv_dtype=)")
    check_attention_call(module, cache.layout.window(module.layer_idx), attention_mask, kwargs)
    return cache.attend(module.layer_idx, query, scaling), None


def kvtier_mask(*args, attention_mask=None, **kwargs):
    """Masks are implied by page positions (causal, sliding windows per layer). A 2-D padding mask ``[B, seen +
    new]`` goes to the TieredKVCache of the forward (``STEP_MASK``), which stores and attends only the tokens it
    keeps (left padding; anything else is refused there by name); HF's attention gets no mask."""
    STEP_MASK.set(attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None)
    return None


def install() -> str:
    """Register the hook with transformers; returns the ``attn_implementation`` name."""
    register_attention(kvtier_attention, kvtier_mask)
    return ATTN_NAME


def use_hook(model) -> None:
    """Route ``model``'s attention through the kvtier hook (registering it first); nothing to do when it
    already is."""
    if model.config._attn_implementation != ATTN_NAME:
        model.set_attn_implementation(install())


_ROUTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> [its own attention, open routes]


def route(model) -> Callable[[], None]:
    """Route ``model``'s attention through the kvtier hook until the ``release()`` this returns is called (again:
    nothing). Routes nest (caches open together, an ``offload`` block): when the last is released the model gets
    back the attention it had before the first, unless something else switched it meanwhile."""
    held = _ROUTED.setdefault(model, [model.config._attn_implementation, 0])
    held[1] += 1
    use_hook(model)
    released = False

    def release() -> None:
        nonlocal released
        if released:
            return
        released = True
        held[1] -= 1
        if held[1] == 0:
            _ROUTED.pop(model, None)
            if model.config._attn_implementation == ATTN_NAME and held[0] != ATTN_NAME:
                model.set_attn_implementation(held[0])
    return release
