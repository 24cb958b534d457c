"""A compiled engine compiles its step whole: the attention hook's graph breaks leave each attention module's
forward a frame of its own, specialised per layer and per decode bucket, and none of them may fall back to eager."""

import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from transformers.models.llama.modeling_llama import LlamaAttention

from kvtier.engine import Engine, EngineConfig
from kvtier.models import kv_layout_for, tiny_llama
from kvtier.policies import LRU
from kvtier.tiers import DeviceTier


def test_a_compiled_engine_compiles_the_attention_of_every_layer_at_every_bucket():
    """dynamo's limits set to 1 (a user's, or used up by earlier engines): two layers x (the prompt forward, decode
    buckets 1 and 2) are six compiled entries of the attention forward; without the engine's room, one."""
    torch._dynamo.reset()
    # dynamo's own patch restores them after the test (pytest's monkeypatch would delete them: dynamo's config keeps its
    # values outside the module's __dict__, and a deleted one reads as missing to every later engine)
    with torch._dynamo.config.patch(recompile_limit=1, accumulated_recompile_limit=1):
        model = tiny_llama()
        layout = kv_layout_for(model.config, page_size=16, dtype=model.dtype)
        engine = Engine(model, layout, [DeviceTier(layout, 40)], LRU(), "all",
                        config=EngineConfig(max_batch=2, max_context=128, compile=True, graphs=False))
        generator = torch.Generator().manual_seed(0)
        for tokens in (20, 33):  # a prompt, a step at bucket 1; another prompt, a step at bucket 2
            engine.add(torch.randint(0, 256, (tokens,), generator=generator))
            engine.step()
        assert len(_debug_get_cache_entry_list(LlamaAttention.forward.__code__)) == 2 * 3
    torch._dynamo.reset()
