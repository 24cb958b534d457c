"""Which attention features kvtier honours, and the named refusal of the rest.

Honoured: causal self-attention over the cache's pages, GQA/MQA, any head size, the model's own
``scaling``, and per-layer sliding windows (HF's ``sliding_window`` W: query i sees keys j with
``i - W < j <= i``; the windows come from the config, :func:`sliding_windows`).

Refused with :class:`~kvtier.errors.UnsupportedAttentionError`, from the config when the model is
loaded or its layout built (:func:`check_model_support`), and from the hook's arguments on every
call (:func:`check_attention_call`): logit soft-capping, attention sinks as learned logits, ALiBi
and other position biases, non-causal (bidirectional) attention, an explicit attention mask,
packed varlen batches, sparse index attention, layer types other than full and sliding (chunked,
linear, ...), a ``sliding_window`` that differs from the layout's, and any keyword argument the
hook does not know (it may change the result).
"""

from __future__ import annotations

import dataclasses

from kvtier.errors import ConfigError, UnsupportedAttentionError

LAYER_TYPES = {"full_attention": False, "sliding_attention": True}  # layer type -> sliding
SINK_MODELS = ("gpt_oss", "granite_swa", "granitemoe_swa", "mimo_v2_flash", "deepseek_v4", "hy_v4")
# keyword arguments that never change the attention the hook computes
HARMLESS = frozenset({"position_ids", "cache_position", "use_cache", "output_attentions", "output_hidden_states",
                      "output_router_logits", "num_items_in_batch", "deterministic", "position_embeddings",
                      "past_key_values"})
# keyword arguments that change the result unless they are None
REFUSED = {
    "softcap": "logit soft-capping",
    "s_aux": "attention sinks (learned logits)",
    "position_bias": "a position bias (ALiBi or relative)",
    "cu_seq_lens_q": "packed varlen sequences", "cu_seq_lens_k": "packed varlen sequences",
    "max_length_q": "packed varlen sequences", "max_length_k": "packed varlen sequences",
    "seq_idx": "packed varlen sequences",
    "indices": "sparse index attention", "block_indices": "sparse index attention",
}


def model_name(config) -> str:
    return getattr(config, "model_type", None) or type(config).__name__


def applied(config, key: str):
    """``config.<key>`` when the model's architecture reads it, else None.

    HF configs are dataclasses whose fields are what the architecture reads; a key an exported
    ``config.json`` carries beyond them (``sliding_window`` on a Llama) is kept as an attribute that
    the model's attention never reads, so kvtier must not read it either. Any other object: its attribute.
    """
    if dataclasses.is_dataclass(config) and key not in {f.name for f in dataclasses.fields(config)}:
        return None
    return getattr(config, key, None)


def sliding_windows(config) -> tuple[int, ...]:
    """Per layer, the keys a query sees (HF ``sliding_window``), 0 for a global layer; ``()`` if none slide.

    Only windows the architecture applies (:func:`applied`: Mistral, Qwen 2/3 with ``use_sliding_window``,
    Gemma 2/3, Cohere 2, ...; not Llama). ``config.layer_types`` names each layer (Gemma 2/3, Qwen 2/3,
    Cohere 2, ...); without it a set ``sliding_window`` covers every layer (Mistral).
    """
    window, types = applied(config, "sliding_window"), applied(config, "layer_types")
    if types is None:
        return (int(window),) * config.num_hidden_layers if window else ()
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise UnsupportedAttentionError(f"layer types {unknown}", model_name(config),
                                        f"kvtier attends only {sorted(LAYER_TYPES)} layers")
    if any(LAYER_TYPES[t] for t in types) and not (isinstance(window, int) and window > 0):
        raise ConfigError("model", f"config.layer_types has sliding layers but sliding_window={window!r}")
    return tuple(window if LAYER_TYPES[t] else 0 for t in types)


def check_model_support(config) -> None:
    """Raise UnsupportedAttentionError if the config asks for attention kvtier does not compute."""
    name = model_name(config)
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise UnsupportedAttentionError("logit soft-capping", name, "config.attn_logit_softcapping is set")
    if getattr(config, "alibi", False) or getattr(config, "position_embedding_type", None) == "alibi":
        raise UnsupportedAttentionError("ALiBi position biases", name, "kvtier adds no bias to the logits")
    if getattr(config, "use_bidirectional_attention", False) or getattr(config, "is_encoder_decoder", False):
        raise UnsupportedAttentionError("non-causal attention", name, "kvtier attention is causal self-attention")
    if name in SINK_MODELS:
        raise UnsupportedAttentionError("attention sinks (learned logits)", name, "kvtier adds no sink logit")
    if getattr(config, "attention_chunk_size", None):
        raise UnsupportedAttentionError("chunked attention", name, "kvtier attends full or sliding-window layers")
    sliding_windows(config)


def check_attention_call(module, window: int, attention_mask, kwargs: dict) -> None:
    """Raise UnsupportedAttentionError unless the hook's call is exactly what kvtier computes.

    ``window`` is the layout's window of ``module.layer_idx`` (0: global); ``kwargs`` are the
    keyword arguments the hook did not consume itself.
    """
    name = type(module).__name__
    if getattr(module, "is_causal", True) is False or kwargs.get("is_causal", True) is False:
        raise UnsupportedAttentionError("non-causal attention", name, "kvtier attention is causal self-attention")
    if attention_mask is not None:
        raise UnsupportedAttentionError("an explicit attention mask", name,
                                        "kvtier derives the causal (and sliding) mask from page positions")
    applies = kwargs.get("sliding_window")  # an architecture that passes none applies none (Llama)
    if (applies or 0) != window:
        raise UnsupportedAttentionError(
            f"sliding_window={applies} on layer {module.layer_idx}", name,
            f"the cache's layout has window {window or None} there; build it with "
            "kvtier.models.kv_layout_for(model.config)")
    for key, value in kwargs.items():
        if key in HARMLESS or key in ("is_causal", "sliding_window"):  # both checked above
            continue
        if key in REFUSED:
            if value is not None:
                raise UnsupportedAttentionError(REFUSED[key], name, f"the attention call passes {key}=...")
        else:
            raise UnsupportedAttentionError(f"the keyword argument {key!r}", name,
                                            "the kvtier hook refuses what it does not know may change the result")
