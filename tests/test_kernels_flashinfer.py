"""FlashInfer backend against the torch reference on fresh random paged batches (a GPU with flashinfer only).

Decode and chunked prefill, GQA, partial last pages, and sliding windows (``window_left``) that
skip whole pages, end inside a page and leave a window of one key.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.kernels.reference import paged_attention_reference
from test_kernels_reference import random_paged_batch, rel_err

flashinfer = pytest.importorskip("flashinfer") if torch.cuda.is_available() else None
pytestmark = pytest.mark.skipif(flashinfer is None, reason="FlashInfer needs a GPU")


@pytest.mark.parametrize("kv_lens,q_lens,causal,window_left", [
    ([700, 1, 370], [1, 1, 1], False, -1),  # decode, no window
    ([700, 9, 640], [1, 1, 1], False, 200),  # decode: pages left of the window skipped, a window inside a page
    ([300, 90], [37, 90], True, -1),  # prefill: a chunk after a prefix, a whole prompt
    ([830, 400], [37, 400], True, 63),  # prefill: windowed chunk and prompt
    ([190], [1], False, 0),  # a window of one key
])
def test_flashinfer_matches_reference(kv_lens, q_lens, causal, window_left):
    from kvtier.kernels.flashinfer import FlashInferBackend

    gen = torch.Generator().manual_seed(sum(kv_lens) + window_left)
    q, pool, batch, _, _ = random_paged_batch(kv_lens, q_lens, 16, 2, 128, 8, torch.bfloat16, causal,
                                              generator=gen, window_left=window_left)
    q, pool, batch = q.cuda(), pool.cuda(), batch.to("cuda")
    backend = FlashInferBackend()
    backend.plan(batch, 8, 2, 128)
    res = backend.run(q, pool)
    ref = paged_attention_reference(q.float(), pool.float(), batch, backend.sm_scale)
    assert rel_err(res.out.float().cpu(), ref.out.cpu()) < 1e-2
    fin = torch.isfinite(ref.lse)
    assert torch.allclose(res.lse[fin].cpu(), ref.lse[fin].cpu(), atol=5e-2)
