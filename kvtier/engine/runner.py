"""The model side of a step: the forward pass that drives the engine's attention (through the kvtier hook).

- :class:`HFRunner`: the model's own forward (any architecture the hook accepts), given explicit positions, so
  that a decode step can be captured.
- :class:`LlamaRunner`: a compact forward for the Llama family over the HF model's own modules (HF's numerics),
  with no model-level overhead.

:class:`StepForward` runs an engine's step through either: the work a CUDA graph captures.
"""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import rotate_half

from kvtier.cache_base import ACTIVE_CACHE
from kvtier.compiling import compile_step
from kvtier.errors import ConfigError
from kvtier.hook import use_hook

# Families whose base model is embed -> rotary -> decoder layers -> norm -> head, with no extra
# per-layer inputs (Gemma scales embeddings, GPT-OSS adds sinks: those take the HF forward).
FAST_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
RUNNERS = ("auto", "hf", "llama")


class HFRunner:
    """The HF model's own forward over kvtier pages."""

    def __init__(self, model):
        self.model = model

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, kv, keep, ahead=None) -> torch.Tensor:
        """``ids [B, q]`` at ``positions [B, q]`` -> logits ``[B, k, V]`` (float32) of the tokens ``keep`` names
        (HF's ``logits_to_keep``: an int n, the last n, 0 all; or a tensor of token indices ``[k]``); ``kv`` is
        what the attention modules see as ``past_key_values``. The model's forward shows no hidden state between
        layers, so ``ahead`` is None here (the engine refuses a predictor for this runner)."""
        use_hook(self.model)
        out = self.model(input_ids=ids, position_ids=positions, cache_position=positions[0], past_key_values=kv,
                         use_cache=True, logits_to_keep=keep)
        return out.logits.float()


class LlamaRunner:
    """Runs ``model`` (a HF causal LM of :data:`FAST_FAMILIES`) over kvtier pages."""

    def __init__(self, model):
        kind = getattr(model.config, "model_type", None)
        if kind not in FAST_FAMILIES:
            raise ConfigError("engine.runner", f"the compact runner runs {', '.join(FAST_FAMILIES)} models, not "
                                               f"{kind!r}; use engine.runner=hf (the model's own forward)")
        self.model = model
        self.base = model.model

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, kv, keep, ahead=None) -> torch.Tensor:
        """As :meth:`HFRunner.forward`; ``ahead = (point, fn)``, if given: in each layer but the last, ``fn(layer,
        hidden, rope)`` is called with the next layer's index and the hidden state ``[B, q, hidden]`` at ``point``
        (``layer_input``: entering this layer; ``after_attention``: the residual after its attention), for
        prediction ahead (:mod:`kvtier.scopes.predict`)."""
        use_hook(self.model)  # another user may have switched it
        hidden = self.base.embed_tokens(ids)  # [B, q, hidden]
        rope = self.base.rotary_emb(hidden, positions)  # (cos, sin) [B, q, D]
        point, fn = ahead if ahead is not None else (None, None)
        last = len(self.base.layers) - 1
        args = dict(attention_mask=None, position_ids=positions, past_key_values=kv, use_cache=True,
                    position_embeddings=rope)  # every layer's attention
        for i, layer in enumerate(self.base.layers):
            if point == "layer_input" and i < last:
                fn(i + 1, hidden, rope)
            # the decoder layer's forward, written out: one compiled region from its MLP's residual add on to the
            # next layer's attention (norm fused with the add), where the layer's own frame would split them
            hidden = hidden + layer.self_attn(hidden_states=layer.input_layernorm(hidden), **args)[0]
            if point == "after_attention" and i < last:
                fn(i + 1, hidden, rope)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = hidden[:, keep] if isinstance(keep, torch.Tensor) else hidden[:, -keep:]  # [B, k, hidden]
        return self.model.lm_head(self.base.norm(hidden)).float()

    def layer_query(self, layer: int, hidden: torch.Tensor, rope: tuple) -> torch.Tensor:
        """Layer ``layer``'s query for the hidden state ``hidden [B, q, hidden]`` (its input norm, query projection,
        per-head norm where the family has one, rotary embedding ``rope``): ``[B, H, q, D]``."""
        module = self.base.layers[layer]
        attn = module.self_attn
        q = attn.q_proj(module.input_layernorm(hidden))  # [B, q, H * D]
        q = q.view(*hidden.shape[:2], -1, attn.head_dim)  # [B, q, H, D]
        if getattr(attn, "q_norm", None) is not None:  # Qwen3: RMSNorm over each head's dims
            q = attn.q_norm(q)
        q = q.transpose(1, 2)  # [B, H, q, D]
        cos, sin = (x[:, None] for x in rope)  # [B, 1, q, D]
        return q * cos + rotate_half(q) * sin  # the Llama family's rotary embedding (HF's own helper)


def make_runner(model, name: str = "auto"):
    """``auto``: the compact runner for the Llama family, else the model's own forward (``name`` checked by
    :class:`~kvtier.engine.config.EngineConfig`)."""
    if name == "llama" or (name == "auto" and getattr(model.config, "model_type", None) in FAST_FAMILIES):
        return LlamaRunner(model)
    return HFRunner(model)


class StepForward:
    """The forward of ``engine``'s steps through ``runner``, torch.compile'd when ``compiled`` (a decode bucket with
    static rows; an iteration with prompt chunks once for every token count, captured ones paying its guards once,
    at capture); the decode rows' logits and greedy next tokens into the step's buffers."""

    def __init__(self, engine, runner, compiled: bool):
        self.engine, self.runner = engine, runner
        self._decode = self._chunks = runner.forward
        if compiled:
            self._decode = compile_step(runner.forward, dynamic=False)
            self._chunks = compile_step(runner.forward, dynamic=True)

    def decode(self, B: int) -> None:
        """A decode step of ``B`` rows: ``tokens[:B]`` -> ``logits[:B]``, greedy next tokens into ``tokens[:B]``."""
        e, buffers = self.engine, self.engine.buffers
        e.callbacks.start(B)
        token = ACTIVE_CACHE.set(e.kv)
        try:
            logits = self._decode(buffers.tokens[:B, None], buffers.positions[:B, None], e.kv, 1,
                                  (e.predictor.point, e.callbacks.ahead) if e.predictor is not None else None)
        finally:
            ACTIVE_CACHE.reset(token)
        self._decoded(B, logits[:, 0])

    def iteration(self, row: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, B: int) -> torch.Tensor:
        """The forward of an iteration's token row ``[1, B + T]`` (decode rows first): logits of the tokens ``keep``
        ``[k, V]``; the decode rows' logits and greedy next tokens into ``logits[:B]`` / ``tokens[:B]``."""
        e = self.engine
        e.callbacks.start(B)
        token = ACTIVE_CACHE.set(e.kv)
        try:
            logits = self._chunks(row, positions, e.kv, keep)[0]  # [k, V]
        finally:
            ACTIVE_CACHE.reset(token)
        if B:
            self._decoded(B, logits[:B])
        return logits

    def _decoded(self, B: int, logits: torch.Tensor) -> None:
        """The step's tail once the decode rows' ``logits [B, V]`` are computed."""
        e = self.engine
        e.callbacks.finish(B)
        e.buffers.logits[:B] = logits
        e.buffers.tokens[:B] = logits.argmax(-1)
        if e.recall is not None:
            e.recall.next_step()
