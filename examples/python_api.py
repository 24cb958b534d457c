"""The default recipe (`kvtier-run`) from a research script: SmolLM2, ASPE, a quarter of a 1k-token
Opticks stream in the device tier, the rest in host DRAM, resident attention, torch kernels."""

from kvtier.cache import TieredKVCache
from kvtier.engine import Engine
from kvtier.eval import Perplexity
from kvtier.hook import install
from kvtier.kernels.registry import make_backend
from kvtier.models import kv_layout_for, load_model
from kvtier.policies import ASPE
from kvtier.scheduler import LookaheadScheduler
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.tiers import DeviceTier, HostTier

model, tokenizer = load_model("smollm2", dtype="float32")
model.set_attn_implementation(install())
layout = kv_layout_for(model.config, page_size=16, dtype=model.dtype)
task = Perplexity(text="opticks", length=1024, prefix=16)


def make_cache() -> TieredKVCache:
    tiers = [DeviceTier(layout, layout.pages_for(task.length // 4)), HostTier(layout, layout.pages_for(task.length))]
    policy = ASPE(sinks=4, window=16, obs_window=16, theta_evict=1e-3, theta_prefetch=1e-2)
    scheduler, backend = LookaheadScheduler(lookahead=2), make_backend("torch")
    return TieredKVCache(layout, tiers, policy, scheduler, backend, scope="resident")


result = task.run(Engine(model, ChunkedPrefill(32)), make_cache, tokenizer)
print(f"perplexity {result['perplexity']:.3f}  tier-1 hit rate {result['tier1_hit_rate']:.1%}")
