"""kernel=flashinfer through the engine on the real SmolLM2 (a GPU with flashinfer only): exact mode (scope=all, every
page in HBM) and resident over device + pinned host, its greedy tokens and logits against kernel=triton's and the
torch reference's, prompts prefilled through the engine (FlashInfer's batch prefill) and decoded in a batch.

    python -m pytest -q -p no:cacheprovider -n 0 tests/test_gpu_flashinfer_engine.py
"""

from __future__ import annotations

import pytest
import torch

flashinfer = pytest.importorskip("flashinfer") if torch.cuda.is_available() else None
pytestmark = pytest.mark.skipif(flashinfer is None, reason="kernel=flashinfer needs a GPU and flashinfer-python")

STEPS = 24


@pytest.fixture(scope="module")
def smollm2_gpu():
    from kvtier.data import token_stream
    from kvtier.hook import install
    from kvtier.models import kv_layout_for, load_model

    model, tok = load_model(None, dtype="float16", device="cuda")
    model.set_attn_implementation(install())
    ids = token_stream(tok, "opticks", 3000)
    prompts = [ids[:700], ids[1000:1333], ids[2000:2999]]  # partial last pages, different lengths
    return model, kv_layout_for(model.config, page_size=16, dtype=torch.float16), prompts


def decode(model, layout, prompts, kernel: str, stack: str, forced=None):
    """Greedy tokens ``[STEPS, B]`` and logits ``[STEPS, B, V]`` (fp32) of an engine with ``kernel`` over ``stack``;
    ``forced``: another run's greedy tokens ``[STEPS, B]``, each the next step's input (teacher-forced, so one near-tie
    cannot change the rest)."""
    from kvtier.engine import Engine, EngineConfig
    from kvtier.policies import LRU, SinkWindow
    from kvtier.scheduler.chunked_prefill import ChunkedPrefill
    from kvtier.tiers import DeviceTier, HostTier

    pages = sum(layout.pages_for(int(p.numel()) + STEPS + 1) for p in prompts) + 1
    if stack == "all":
        tiers, policy, scope = [DeviceTier(layout, pages)], LRU(), "all"
    else:  # resident: a third of the pages in HBM, the rest in pinned host memory
        tiers = [DeviceTier(layout, pages // 3), HostTier(layout, pages, pin_memory=True)]
        policy, scope = SinkWindow(sinks=4, window=128), "resident"
    engine = Engine(model, layout, tiers, policy, scope, kernel=kernel, prefill=ChunkedPrefill(256),
                    config=EngineConfig(max_batch=len(prompts)))
    seqs = [engine.add(p.cuda())[0] for p in prompts]
    tokens, logits = [], []
    for t in range(STEPS):
        inputs = None if forced is None or t == 0 else {s: int(x) for s, x in zip(seqs, forced[t - 1])}
        step = engine.step(inputs)
        logits.append(step[:len(prompts)].float())
        tokens.append(logits[-1].argmax(-1))
    engine.close()
    return torch.stack(tokens), torch.stack(logits)


def check_same(got, want) -> None:
    """Logits within fp16 kernels' rounding, and the same greedy token wherever the reference's best beats its
    second by more than the largest logit difference."""
    (g_tok, g_log), (w_tok, w_log) = got, want
    diff = (g_log - w_log).abs().amax()
    assert diff < 0.05 * w_log.abs().amax(), float(diff)
    top2 = w_log.topk(2, -1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * diff
    assert torch.equal(g_tok[clear], w_tok[clear])
    assert clear.float().mean() > 0.8


@pytest.mark.parametrize("stack", ["all", "resident"])
def test_flashinfer_through_the_engine_matches_triton_and_torch(smollm2_gpu, stack):
    model, layout, prompts = smollm2_gpu
    triton = decode(model, layout, prompts, "triton", stack)
    flash = decode(model, layout, prompts, "flashinfer", stack, forced=triton[0])
    check_same(flash, triton)
    if stack == "all":  # exact mode: the oracle too
        check_same(flash, decode(model, layout, prompts, "torch", stack, forced=triton[0]))
