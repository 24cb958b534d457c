"""The Fifo policy from Python: one tiny-Llama cache, 96 tokens prefilled, 16 decoded, bytes moved.

    python examples/custom_policy/run.py [--tokens N]
"""

import argparse

import torch

from fifo import Fifo
from kvtier import DeviceTier, HostTier, TieredKVCache, bytes_moved, kv_layout_for
from kvtier.models import tiny_llama


def main(tokens: int = 96) -> dict:
    model = tiny_llama()
    layout = kv_layout_for(model.config, page_size=16, dtype=torch.float32)
    cache = TieredKVCache(layout, [DeviceTier(layout, 4, device="cpu"), HostTier(layout, 16)], Fifo(sinks=4),
                          scope="resident")
    ids = torch.randint(0, model.config.vocab_size, (1, tokens))
    token = cache.prefill(model, ids, 16)[:, -1:].argmax(-1)  # the model's own forward over the cache
    for _ in range(15):
        token = cache.forward(model, token)[:, -1:].argmax(-1)
    cache.finish_step()
    moved = dict(bytes_moved(cache))
    print(f"fifo: hit rate {cache.engine.hit_rate():.1%}, bytes moved {moved}")
    return moved


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=96)
    main(parser.parse_args().tokens)
