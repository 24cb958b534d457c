"""Triton decode and prefill kernels through the interpreter against the torch reference.

Fresh random inputs per case (random pages in permuted slots, never zeros); relative error of the
output, absolute error of LSE and page_max, no NaN. Shapes are tiny: the interpreter costs
milliseconds per program iteration.
"""

from __future__ import annotations

import os


import contextlib  # noqa: E402
import math  # noqa: E402
from unittest import mock  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from kvtier.errors import ConfigError, MissingDependencyError  # noqa: E402
from kvtier.kernels.reference import paged_attention_reference  # noqa: E402
from kvtier.kernels.base import PagedBatch  # noqa: E402
from kvtier.kernels.registry import make_backend  # noqa: E402
from kvtier.kernels.triton_decode import DecodeConfig, TritonBackend, default_decode_config  # noqa: E402
from kvtier.quant import quantize_pages  # noqa: E402
from kvtier.kernels.triton_prefill import PrefillConfig  # noqa: E402
from test_kernels_reference import random_head_mask, random_paged_batch, rel_err  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="Triton needs a GPU or TRITON_INTERPRET=1")


@pytest.fixture(autouse=True)
def interpreter_mode_matches():
    if os.environ.get("TRITON_INTERPRET") == "1" and not isinstance(tl.zeros, InterpretedFunction):
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set (kvtier imports it): set it at the top "
                    "of tests/conftest.py, before anything imports kvtier")


def device():
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


@contextlib.contextmanager
def nan_empty():
    """``torch.empty`` fills floating tensors with NaN meanwhile: an output element a kernel leaves unwritten shows."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(math.nan) if t.is_floating_point() else t

    with mock.patch.object(torch, "empty", poisoned):
        yield


def assert_page_max(got, want, atol):
    """Finite where the reference is (and close there), exactly -inf elsewhere (not NaN, not unwritten)."""
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin) and torch.isneginf(got[~fin]).all()
    assert torch.allclose(got[fin], want[fin], atol=atol)


def check_against_reference(backend, kv_lens, q_lens, group, num_kv_heads, head_dim, dtype, causal, seed,
                            page_size=16, window_left=-1, head_mask=False):
    gen = torch.Generator().manual_seed(seed)
    q, pool, batch, _, _ = random_paged_batch(kv_lens, q_lens, page_size, num_kv_heads, head_dim,
                                              group * num_kv_heads, dtype, causal, generator=gen,
                                              window_left=window_left)
    if head_mask:
        batch.head_mask = random_head_mask(batch, num_kv_heads, gen)[0]
    q, pool, batch = q.to(device()), pool.to(device()), batch.to(device())
    backend.plan(batch, group * num_kv_heads, num_kv_heads, head_dim)
    with nan_empty():
        res = backend.run(q, pool, return_page_max=True)
    ref = paged_attention_reference(q, pool, batch, backend.sm_scale, return_page_max=True)
    assert res.out.dtype == q.dtype and res.out.shape == q.shape
    assert rel_err(res.out.cpu(), ref.out.cpu()) < TOL[dtype]
    fin = torch.isfinite(ref.lse)
    assert torch.equal(torch.isfinite(res.lse), fin)
    assert torch.allclose(res.lse[fin], ref.lse[fin], atol=20 * TOL[dtype])
    assert_page_max(res.page_max, ref.page_max, 20 * TOL[dtype])
    return res


@pytest.mark.parametrize("group,num_kv,dtype,kv_lens,per_split", [
    (4, 1, torch.float32, [37, 1, 50], 2),  # several splits per sequence + merge, partial last pages
    (3, 1, torch.float16, [40, 17], 1),  # one page per split
    (1, 2, torch.float32, [33, 0, 20], None),  # an empty sequence, planner-sized splits
    (4, 1, torch.bfloat16, [70, 20], None),
])
def test_decode_matches_reference(group, num_kv, dtype, kv_lens, per_split):
    backend = TritonBackend(decode_config=DecodeConfig(block_n=16, pages_per_split=per_split))
    res = check_against_reference(backend, kv_lens, [1] * len(kv_lens), group, num_kv, 32, dtype, False,
                                  seed=sum(kv_lens) + group)
    assert backend.is_decode
    if 0 in kv_lens:
        empty = kv_lens.index(0)
        assert torch.isneginf(res.lse[empty]).all() and (res.out[empty] == 0).all()


@pytest.mark.parametrize("group,num_kv,kv_lens,per_split,window_left", [
    (4, 1, [70, 1, 37], 1, 20),  # blocks and whole splits left of the window, a window inside a page
    (3, 2, [48, 9, 64], None, 31),  # GQA, one split, window on a page boundary, a sequence inside it
    (2, 1, [33], 2, 0),  # a window of one key
])
def test_decode_sliding_window_matches_reference(group, num_kv, kv_lens, per_split, window_left):
    backend = TritonBackend(decode_config=DecodeConfig(block_n=16, pages_per_split=per_split))
    res = check_against_reference(backend, kv_lens, [1] * len(kv_lens), group, num_kv, 32, torch.float32, False,
                                  seed=sum(kv_lens) + window_left, window_left=window_left)
    assert torch.isneginf(res.page_max[0]).all()  # the first page is left of the window


@pytest.mark.parametrize("group,num_kv,kv_lens,per_split", [
    (3, 2, [70, 1, 37], 1),  # splits + merge, a one-token sequence
    (2, 3, [48, 64], None),  # planner-sized splits
])
def test_decode_head_mask_matches_reference(group, num_kv, kv_lens, per_split):
    """Per-head page choice: each kv head's program skips the pages it is not given."""
    backend = TritonBackend(decode_config=DecodeConfig(block_n=16, pages_per_split=per_split))
    res = check_against_reference(backend, kv_lens, [1] * len(kv_lens), group, num_kv, 32, torch.float32, False,
                                  seed=400 + sum(kv_lens), head_mask=True)
    assert torch.isneginf(res.page_max).any()  # some (page, head) hidden
    gen = torch.Generator().manual_seed(401)
    _, _, batch, _, _ = random_paged_batch([40], [6], 16, 2, 32, 4, causal=True, generator=gen)
    batch.head_mask = torch.ones(batch.kv_indices.numel(), 2, dtype=torch.bool)
    with pytest.raises(ConfigError):  # prefill: not taken
        backend.plan(batch, 4, 2, 32)


@pytest.mark.parametrize("page,block_n,num_warps,kv_lens,per_split,window_left,head_mask", [
    (16, 64, 4, [150, 3, 77], 4, -1, False),  # four 16-token pages per block
    (8, 64, 2, [130, 40], None, 50, True),  # eight 8-token pages, a window, per-head pages
    (32, 64, 4, [100, 64], 2, 40, False),  # two 32-token pages
    (4, 32, 4, [45, 9], 3, 20, True),  # 4-token pages, a window inside a page
    (16, 128, 8, [200, 33], None, -1, True),
])
def test_decode_page_max_per_page_of_each_block(page, block_n, num_warps, kv_lens, per_split, window_left, head_mask):
    """page_max of every page of a key block, for pages of 4 to 32 tokens and several warp counts (a block
    layout that dealt tokens to warps out of order gave wrong maxima on the GPU only); pages of
    splits left of the window and hidden pages are -inf."""
    config = DecodeConfig(block_n=block_n, num_warps=num_warps, pages_per_split=per_split)
    check_against_reference(TritonBackend(decode_config=config), kv_lens, [1] * len(kv_lens), 3, 2, 32,
                            torch.float32, False, seed=page + block_n + sum(kv_lens), page_size=page,
                            window_left=window_left, head_mask=head_mask)


def test_decode_page_max_of_unlisted_entries_is_neg_inf():
    """page_max has a row per kv_indices entry; entries outside ``kv_indptr[0]:kv_indptr[-1]`` attend nothing."""
    gen = torch.Generator().manual_seed(11)
    q, pool, batch, _, _ = random_paged_batch([40, 20], [1, 1], 16, 1, 32, 2, generator=gen)
    extra = torch.tensor([0, 1], dtype=torch.int32)
    batch = PagedBatch(batch.qo_indptr, batch.kv_indptr + 2, torch.cat([extra, batch.kv_indices, extra]),
                       batch.kv_last_page_len, 16)  # two unlisted entries before and after
    q, pool, batch = q.to(device()), pool.to(device()), batch.to(device())
    backend = TritonBackend(decode_config=DecodeConfig(block_n=16))
    backend.plan(batch, 2, 1, 32)
    with nan_empty():
        res = backend.run(q, pool, return_page_max=True)
    ref = paged_attention_reference(q, pool, batch, backend.sm_scale, return_page_max=True)
    assert torch.isneginf(res.page_max[[0, 1, -2, -1]]).all() and rel_err(res.out, ref.out) < 1e-5
    assert_page_max(res.page_max, ref.page_max, 1e-4)


def test_decode_plan_follows_the_pool_dtype():
    """FP8 pages take their own default config (D=128: twice the tokens per step), planned at the first run."""
    assert default_decode_config(128, kv_bytes=1).block_n == 2 * default_decode_config(128).block_n
    gen = torch.Generator().manual_seed(12)
    q, pool, batch, _, _ = random_paged_batch([300, 20], [1, 1], 16, 1, 128, 2, generator=gen)
    q, pool, batch = q.to(device()), pool.to(device()), batch.to(device())
    backend = TritonBackend()
    backend.plan(batch, 2, 1, 128)
    assert backend.decode_plans == {}
    for kv in (pool, quantize_pages(pool)):
        res = backend.run(q, kv)
        assert rel_err(res.out, paged_attention_reference(q, kv, batch, backend.sm_scale).out) < 1e-5
    assert {k: p.config for k, p in backend.decode_plans.items()} == {4: default_decode_config(128),
                                                                      1: default_decode_config(128, 1)}


def test_a_batch_built_from_host_arrays_plans_and_runs_the_same():
    """PagedBatch.from_host (what the cache builds: host indptrs, no read-back) gives the same plan and output."""
    gen = torch.Generator().manual_seed(6)
    q, pool, batch, _, _ = random_paged_batch([100, 0, 37], [1, 1, 1], 16, 2, 32, 4, generator=gen)
    host = PagedBatch.from_host(batch.qo_indptr.numpy(), batch.kv_indptr.numpy(), batch.kv_indices.numpy(),
                                batch.kv_last_page_len.numpy(), 16, False, device())
    assert host.is_decode() and host.host("kv_indptr").tolist() == batch.kv_indptr.tolist()
    assert all(torch.equal(a.cpu(), b.int()) for a, b in zip(
        (host.qo_indptr, host.kv_indptr, host.kv_indices, host.kv_last_page_len),
        (batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len)))
    q, pool, batch = q.to(device()), pool.to(device()), batch.to(device())
    config = DecodeConfig(block_n=16, pages_per_split=2)
    results = []
    for b in (batch, host):
        backend = TritonBackend(decode_config=config)
        backend.plan(b, 4, 2, 32)
        results.append(backend.run(q, pool, return_page_max=True))
    assert torch.equal(results[0].out, results[1].out) and torch.equal(results[0].page_max, results[1].page_max)
    assert not torch.isnan(results[1].out).any()


@pytest.mark.parametrize("group,num_kv,dtype,kv_lens,q_lens,causal", [
    (4, 1, torch.float32, [50, 33], [7, 33], True),  # a chunk after a prefix of earlier pages; a full prompt
    (3, 1, torch.float16, [40, 9, 30], [12, 0, 30], True),  # a sequence with no query rows
    (1, 2, torch.float32, [20, 47], [3, 5], False),
    (4, 1, torch.float32, [5], [9], True),  # more queries than keys: the first rows attend nothing
])
def test_prefill_matches_reference(group, num_kv, dtype, kv_lens, q_lens, causal):
    backend = TritonBackend(prefill_config=PrefillConfig(block_m=32, block_n=16))
    res = check_against_reference(backend, kv_lens, q_lens, group, num_kv, 32, dtype, causal,
                                  seed=sum(kv_lens) + sum(q_lens) + group)
    assert not backend.is_decode
    if kv_lens == [5]:
        assert torch.isneginf(res.lse[:4]).all() and (res.out[:4] == 0).all()


@pytest.mark.parametrize("group,num_kv,kv_lens,q_lens,causal,window_left", [
    (4, 1, [83, 40], [37, 40], True, 23),  # a chunk after a prefix, a whole prompt: skipped, banded, diagonal
    (3, 2, [50, 9], [7, 9], True, 15),  # GQA, a window on a page boundary, a sequence shorter than it
    (1, 2, [47], [5], False, 30),  # no causal flag: the window alone bounds the keys
    (2, 1, [19], [19], True, 0),  # a window of one key
])
def test_prefill_sliding_window_matches_reference(group, num_kv, kv_lens, q_lens, causal, window_left):
    backend = TritonBackend(prefill_config=PrefillConfig(block_m=32, block_n=16))
    check_against_reference(backend, kv_lens, q_lens, group, num_kv, 32, torch.float32, causal,
                            seed=sum(kv_lens) + window_left, window_left=window_left)


@pytest.mark.parametrize("splits,kv_lens,q_lens,causal,window_left", [
    (2, [90, 40], [9, 40], True, -1),  # a chunk over a prefix: both halves hold keys; a whole prompt
    (3, [83, 20], [37, 20], True, 23),  # a window: splits left of it walk nothing
    (8, [50, 9], [4, 9], False, -1),  # more splits than key blocks: empty splits, merged away
])
def test_prefill_split_keys_match_reference(splits, kv_lens, q_lens, causal, window_left):
    """Each tile's keys split over programs (split-KV), the partial states merged by LSE: the reference's output,
    LSE and page maxima (reduced across the splits)."""
    backend = TritonBackend(prefill_config=PrefillConfig(block_m=32, block_n=16, kv_splits=splits))
    check_against_reference(backend, kv_lens, q_lens, 2, 2, 32, torch.float32, causal, seed=sum(kv_lens) + splits,
                            window_left=window_left)
    assert backend.prefill_plan.config.kv_splits == splits


def test_prefill_with_default_tiles_and_page_size_8():
    backend = TritonBackend()
    check_against_reference(backend, [77, 30], [45, 30], 4, 1, 64, torch.float32, True, seed=21, page_size=8)


@pytest.mark.parametrize("sms,tokens,head_dim,rows", [
    (132, 8192, 128, 256),  # a long prompt: the largest tile, still 7.8 programs per multiprocessor
    (132, 2048, 128, 128),  # 256-row tiles would leave under two waves
    (132, 512, 128, 128),
    (132, 256, 128, 64),  # a short chunk over its prefix: more programs
    (132, 8192, 256, 128),  # large heads never take the 256-row tile
])
def test_default_prefill_config_by_the_grid_it_gives(sms, tokens, head_dim, rows):
    from kvtier.kernels import triton_prefill
    from kvtier.kernels.triton_prefill import default_prefill_config

    with mock.patch.object(triton_prefill, "num_multiprocessors", lambda device: sms):
        assert default_prefill_config(tokens, 32, 8, head_dim, "cpu").block_m == rows


@pytest.mark.parametrize("tokens,keys,splits", [
    (256, 8448, 4),  # 128 programs over an 8k prefix: four splits of ~2k keys fill two waves
    (256, 2304, 2),  # a shorter prefix: no split under 1,024 keys
    (256, 1024, 1),
    (8192, 8192, 1),  # a long prompt fills the multiprocessors by its tiles
    (16, 32768, 8),  # at most eight splits
])
def test_default_prefill_config_splits_the_keys_of_a_small_grid(tokens, keys, splits):
    from kvtier.kernels import triton_prefill
    from kvtier.kernels.triton_prefill import default_prefill_config

    with mock.patch.object(triton_prefill, "num_multiprocessors", lambda device: 132):
        assert default_prefill_config(tokens, 32, 8, 128, "cpu", keys).kv_splits == splits


def test_query_tiles_put_each_sequences_last_tile_first_then_the_padding():
    from kvtier.kernels.triton_prefill import query_tiles

    seq, q0 = query_tiles(np.array([5, 2, 0, 3]), 2, grid=10, pad_seq=9)
    assert seq.tolist() == [3, 3, 1, 0, 0, 0, 9, 9, 9, 9]
    assert q0.tolist() == [2, 0, 0, 4, 2, 0, 0, 0, 0, 0]


def test_decode_default_config_fp16_head_dim_64():
    check_against_reference(make_backend("triton"), [150, 45], [1, 1], 3, 3, 64, torch.float16, False,
                            seed=9)


def test_prefill_page_max_differs_when_a_key_changes():
    gen = torch.Generator().manual_seed(2)
    q, pool, batch, _, _ = random_paged_batch([40], [6], 16, 1, 32, 2, causal=True, generator=gen)
    q, pool, batch = q.to(device()), pool.to(device()), batch.to(device())
    backend = TritonBackend(prefill_config=PrefillConfig(block_m=32, block_n=16))
    backend.plan(batch, 2, 1, 32)
    before = backend.run(q, pool, return_page_max=True).page_max.clone()
    pool[batch.kv_indices[1], 0, 3] = 100 * q[0, :1]  # page 1, token 3: huge logit with query 0
    after = backend.run(q, pool, return_page_max=True).page_max
    assert after[1, 0] > before[1, 0] + 10 and torch.equal(after[0], before[0])


def test_non_power_of_two_page_size_is_a_config_error():
    gen = torch.Generator().manual_seed(1)
    _, _, batch, _, _ = random_paged_batch([30], [1], 12, 1, 16, 1, generator=gen)
    with pytest.raises(ConfigError, match="power-of-two"):
        TritonBackend().plan(batch, 1, 1, 16)


def test_registry_names_and_errors():
    assert make_backend("torch").name == "torch" and make_backend("triton").name == "triton"
    with pytest.raises(ConfigError, match="torch, triton, flashinfer"):
        make_backend("cuda")
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        gpu = torch.cuda.is_available()  # no GPU: refused first, whatever is installed
        with pytest.raises(MissingDependencyError if gpu else ConfigError, match="flashinfer-python" if gpu else "GPU"):
            make_backend("flashinfer")


def test_lse_is_natural_log():
    gen = torch.Generator().manual_seed(4)
    q, pool, batch, keys, _ = random_paged_batch([24], [1], 16, 1, 16, 1, generator=gen)
    backend = TritonBackend()
    q, pool, batch = q.to(device()), pool.to(device()), batch.to(device())
    backend.plan(batch, 1, 1, 16)
    lse = backend.run(q, pool).lse.cpu()
    expect = torch.logsumexp((keys[0][:, 0].double() @ q[0, 0].cpu().double()) * 16 ** -0.5, 0)
    assert math.isclose(lse[0, 0].item(), expect.item(), abs_tol=1e-4)
