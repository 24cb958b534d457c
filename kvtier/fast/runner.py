"""The model side of the fast path: a Llama-family forward over kvtier pages, built from the HF
model's own modules (embeddings, rotary, decoder layers, norm, head), so its numerics are HF's.

Attention goes through the kvtier hook (``attn_implementation="kvtier"``): each decoder layer's
attention module calls ``past_key_values.update`` and then ``kvtier_attention``, which asks the
active cache (here a :class:`kvtier.fast.engine.FastEngine` step) to attend. Nothing here runs
host logic that depends on data, so a decode step can be captured as a CUDA graph.
"""

from __future__ import annotations

import torch

from kvtier.errors import ConfigError
from kvtier.hook import use_hook

# Families whose base model is embed -> rotary -> decoder layers -> norm -> head, with no extra
# per-layer inputs (Gemma scales embeddings, GPT-OSS adds sinks: those use the hook path).
FAST_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def check_fast_model(model) -> None:
    """ConfigError unless ``model`` is a causal LM of a family the fast path runs."""
    kind = getattr(model.config, "model_type", None)
    if kind not in FAST_FAMILIES:
        raise ConfigError("model", f"the fast decode path runs {', '.join(FAST_FAMILIES)} models, not {kind!r}; "
                                   "use kvtier.engine.Engine (the attention-hook path) for other families")


class LlamaRunner:
    """Runs ``model`` (a HF causal LM of :data:`FAST_FAMILIES`) over kvtier pages."""

    def __init__(self, model):
        check_fast_model(model)
        self.model = model
        self.base = model.model
        self.num_layers = len(self.base.layers)

    @property
    def device(self) -> torch.device:
        return self.base.embed_tokens.weight.device

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, kv, last_only: bool) -> torch.Tensor:
        """``ids [B, q]`` at ``positions [B, q]`` -> logits ``[B, q or 1, V]`` (float32).

        ``kv`` is the object the decoder layers see as ``past_key_values`` (its ``update`` stores K/V).
        """
        use_hook(self.model)  # another user may have switched it
        hidden = self.base.embed_tokens(ids)  # [B, q, hidden]
        rope = self.base.rotary_emb(hidden, positions)  # (cos, sin) [B, q, D]
        for layer in self.base.layers:
            hidden = layer(hidden, attention_mask=None, position_ids=positions, past_key_values=kv,
                           use_cache=True, position_embeddings=rope)
        if last_only:
            hidden = hidden[:, -1:]
        return self.model.lm_head(self.base.norm(hidden)).float()
