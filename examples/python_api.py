"""The default recipe (`kvtier-run`) from a research script: SmolLM2, ASPE, a quarter of an Opticks
stream in the device tier, the rest in host DRAM, resident attention, torch kernels.

    python examples/python_api.py [--tokens 384]      # a progress bar per step; ~1 minute at 384
"""

import argparse
import sys

from rich.progress import Progress

from kvtier import ASPE, ChunkedPrefill, DeviceTier, Engine, HostTier, LookaheadScheduler
from kvtier import kv_layout_for, load_model, make_backend
from kvtier.checks import check_device_room
from kvtier.errors import ConfigError
from kvtier.eval import Perplexity

PAGE, CHUNK = 16, 32
parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--tokens", type=int, default=384, help="tokens of the stream (context)")
args = parser.parse_args()


def make_policy() -> ASPE:
    return ASPE(sinks=4, window=16, obs_window=16, theta_evict=1e-3, theta_prefetch=1e-2)


try:  # what the settings need, said before the model loads
    task = Perplexity(text="opticks", length=args.tokens, prefix=16)
    check_device_room(-(-(args.tokens // 4) // PAGE), make_policy(), PAGE, min(CHUNK, task.prefix), "--tokens",
                      give=lambda pages: f"a quarter of the stream is the device's: use --tokens >= "
                                         f"{4 * ((pages - 1) * PAGE + 1)}")
except ConfigError as e:
    print(f"python_api.py: error: {e if e.field == '--tokens' else f'--tokens {args.tokens}: {e}'}", file=sys.stderr)
    sys.exit(2)

model, tokenizer = load_model("smollm2", dtype="float32")
layout = kv_layout_for(model.config, page_size=PAGE, dtype=model.dtype)


def make_engine() -> Engine:
    """A fresh engine per sample: tiers, policy, scheduler, kernel, scope."""
    tiers = [DeviceTier(layout, layout.pages_for(task.length // 4)), HostTier(layout, layout.pages_for(task.length))]
    return Engine(model, layout, tiers, make_policy(), "resident", LookaheadScheduler(), make_backend("torch"),
                  ChunkedPrefill(CHUNK))


with Progress() as progress:
    result = task.run(make_engine, tokenizer, progress=progress)
print(f"perplexity {result['perplexity']:.3f}  tier-1 hit rate {result['tier1_hit_rate']:.1%}")
