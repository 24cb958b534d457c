"""FP8 E4M3 KV pages: quantization with growing per-page scales, bit-identical round trips through every
tier path (values and scales), corrupted scales detected, and the Triton kernels against the torch
reference on FP8 pools (interpreter, fresh random inputs)."""

from __future__ import annotations

import math
import os

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from kvtier import BlockTable, KVLayout  # noqa: E402
from kvtier.errors import ConfigError, PageCorruptedError  # noqa: E402
from kvtier.kernels.base import PagedBatch  # noqa: E402
from kvtier.kernels.reference import paged_attention_reference  # noqa: E402
from kvtier.kernels.triton_decode import DecodeConfig, TritonBackend  # noqa: E402
from kvtier.kernels.triton_prefill import PrefillConfig  # noqa: E402
from kvtier.mover.paged_io import read_tokens, write_tokens  # noqa: E402
from kvtier.quant import (FP8, FP8_MAX, dequantize, page_scales, page_values, pow2_scale,  # noqa: E402
                          quantize_pages, write_scaled)
from kvtier.mover import TransferEngine  # noqa: E402
from kvtier.tiers import DeviceTier, HostTier  # noqa: E402
from kvtier.tiers.disk import DiskTier  # noqa: E402
from kvtier.tiers.redis import RedisTier  # noqa: E402
from kvtier.tiers.redis_server import LocalRedis  # noqa: E402
from test_kernels_reference import rel_err  # noqa: E402
from test_kernels_triton import assert_page_max, nan_empty  # noqa: E402

INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="Triton on CPU tensors: the interpreter only (not yet run on a GPU)")
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="bfloat16", kv_dtype="fp8_e4m3")


def raw(t):
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], -1)


def check_bound(deq, x, scale):
    """E4M3 rounding: half a unit of the 3-bit mantissa (2^-4 relative), or half the subnormal step."""
    err = (deq.float() - x.float()).abs()
    assert (err <= x.float().abs() * 2.0 ** -4 + scale * 2.0 ** -10).all()


# -- layout and quantization -------------------------------------------------------------------
def test_layout_stores_fp8_pages_with_a_scale_row():
    assert LAYOUT.kv_dtype == FP8 and LAYOUT.dtype == torch.bfloat16 and LAYOUT.scaled
    assert LAYOUT.page_shape == (2, 5, 2, 8) and LAYOUT.page_bytes == 2 * 5 * 2 * 8
    plain = KVLayout(2, 2, 8, 4, "bfloat16")
    assert plain.kv_dtype == torch.bfloat16 and plain.page_shape == (2, 4, 2, 8) and not plain.scaled
    with pytest.raises(ConfigError, match="kv_dtype"):
        KVLayout(1, 1, 6, 4, "bfloat16", kv_dtype="fp8_e4m3")  # no room for a 4-byte scale per head
    with pytest.raises(ConfigError, match="kv_dtype"):
        KVLayout(1, 1, 8, 4, "bfloat16", kv_dtype="fp4")


def test_pow2_scale_is_the_smallest_power_of_two_that_fits():
    amax = torch.tensor([448.0, 449.0, 1.0, 0.0, 3e4, 448.0 * 2 ** -20])
    s = pow2_scale(amax)
    assert torch.equal(s, torch.tensor([1.0, 2.0, 2.0 ** -8, 2.0 ** -100, 2.0 ** 7, 2.0 ** -20]))
    assert (amax / s <= FP8_MAX).all() and (amax / (s / 2) > FP8_MAX)[[0, 1, 2, 4, 5]].all()


def test_whole_pages_quantize_within_e4m3_rounding():
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(5, 2, 4, 3, 16, generator=g) * torch.logspace(-3, 3, 3)[None, None, None, :, None]
    kv[2, 0, 1, 1, 5] = 5e4  # an outlier: only its own (page, K, head) pays
    pages = quantize_pages(kv)
    assert pages.shape == (5, 2, 5, 3, 16) and pages.dtype == FP8
    vals = page_values(pages, 4).float()
    assert torch.isfinite(vals).all() and vals.abs().max() <= FP8_MAX
    scales = page_scales(pages, 4)  # [5, 2, 3]
    assert torch.equal(scales, pow2_scale(kv.abs().amax(dim=(2, 4))))
    check_bound(dequantize(pages, 4), kv, scales[:, :, None, :, None])


def test_a_page_that_grows_rescales_its_earlier_tokens_exactly():
    """Tokens appended one at a time, each larger than the page's range so far: the scale grows, no value
    leaves E4M3's range, and the page equals a one-shot quantization of the same tokens (rescaling by a
    power of two is exact) except where a value fell into E4M3's subnormals."""
    g = torch.Generator().manual_seed(2)
    tokens = torch.randn(2, 4, 2, 8, generator=g) * torch.tensor([0.01, 1.0, 3.0, 5000.0])[None, :, None, None]
    pool = torch.full((3, *LAYOUT.page_shape), float("nan")).to(FP8)  # stale bytes in every slot
    seen = []
    for t in range(4):
        write_scaled(pool, 4, torch.tensor([1]), torch.tensor([0]), torch.tensor([t]), tokens[:, t:t + 1])
        seen.append(page_scales(pool, 4)[1].clone())
        vals = page_values(pool, 4)[1, :, :t + 1].float()
        assert torch.isfinite(vals).all() and vals.abs().max() <= FP8_MAX
        once = quantize_pages(torch.cat([tokens[:, :t + 1], torch.zeros(2, 3 - t, 2, 8)], 1)[None])
        assert torch.equal(page_scales(pool, 4)[1], page_scales(once, 4)[0])
        normal = page_values(once, 4)[0, :, :t + 1].float().abs() >= 2.0 ** -6
        assert torch.equal(page_values(pool, 4)[1, :, :t + 1].float()[normal], page_values(once, 4)[0, :, :t + 1].float()[normal])
    assert (seen[3] > seen[2]).all() and (seen[2] > seen[0]).all()  # it grew
    scale = page_scales(pool, 4)[1][:, None, :, None]  # [2, 1, N_kv, 1]
    check_bound(page_values(pool, 4)[1].float() * scale, tokens, scale)


# -- every tier path ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    with LocalRedis() as srv:
        yield srv.url


def four_tier_table(tmp_path, server):
    tiers = [DeviceTier(LAYOUT, 16, device="cpu"), HostTier(LAYOUT, 16), DiskTier(LAYOUT, 16, tmp_path / "kv"),
             RedisTier(LAYOUT, 16, server)]
    return BlockTable(LAYOUT, tiers)


def stored(table, layer, pids):
    """Raw bytes of ``pids``'s stored pages (values and scale rows) wherever they live."""
    tiers, slots = table.locate(layer, pids)
    return torch.cat([raw(table.tiers[t].read(layer, torch.tensor([s]))) for t, s in zip(tiers, slots)])


@pytest.mark.parametrize("method", ["kernel", "generic"])
def test_fp8_pages_cross_every_tier_bit_identical(tmp_path, server, method):
    table = four_tier_table(tmp_path, server)
    table.add_sequence(0)
    table.append(0, 22)  # 6 pages, the last partly filled
    kv = torch.randn(LAYOUT.num_layers, 2, 22, 2, 8).to(torch.bfloat16)
    for layer in range(LAYOUT.num_layers):
        write_tokens(table, layer, 0, kv[layer], 0)
    pids = table.pages(0)
    want = [stored(table, layer, pids) for layer in range(LAYOUT.num_layers)]
    transfer = TransferEngine(table, method=method)
    for dst in (1, 2, 3, 2, 1, 0, 3, 0):  # device -> host -> disk -> remote -> ... -> device
        for layer in range(LAYOUT.num_layers):
            transfer.migrate(layer, pids[1:5], dst=dst)
            transfer.wait()
            assert torch.equal(stored(table, layer, pids), want[layer])
    for layer in range(LAYOUT.num_layers):  # gather into one pool (the merge=false read path)
        pool, _ = transfer.gather(layer, pids, "cpu")
        assert torch.equal(raw(pool), want[layer])
        got = read_tokens(table, layer, 0)
        check_bound(got, kv[layer], 1.0)
    for t in table.tiers:
        t.close()


def test_writes_into_pages_on_every_tier_quantize_alike(tmp_path, server):
    """Tokens appended one by one into a page on the device, host, disk or remote tier (in place or
    read-modify-write) give the same stored bytes: the growing scale is one rule everywhere."""
    table = four_tier_table(tmp_path, server)
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(2, 7, 2, 8, generator=g) * torch.tensor([0.1, 1, 1, 30, 2, 2, 900])[None, :, None, None]
    pages = []
    for tier in range(4):
        table.add_sequence(tier)
        table.append(tier, 7)
        transfer = TransferEngine(table)
        transfer.migrate(0, table.pages(tier), dst=tier)
        transfer.wait()
        for t in range(7):
            write_tokens(table, 0, tier, kv[:, t:t + 1], t)
        pages.append(stored(table, 0, table.pages(tier)))
    assert all(torch.equal(pages[0], p) for p in pages[1:])
    for t in table.tiers:
        t.close()


# -- a corrupted scale is detected like a corrupted page -----------------------------------------
def scale_byte(layout, slot):
    """Byte offset of the V scale of kv head 1 of ``slot`` within a layer's file (its exponent byte)."""
    rows = layout.page_size + 1
    per_half = rows * layout.num_kv_heads * layout.head_dim
    return slot * layout.page_bytes + per_half + layout.page_size * layout.num_kv_heads * layout.head_dim \
        + layout.head_dim + 3


def test_corrupted_scale_on_disk_is_detected(tmp_path):
    tier = DiskTier(LAYOUT, 8, tmp_path / "kv")
    pages = quantize_pages(torch.randn(8, 2, 4, 2, 8))
    tier.write(0, torch.arange(8), pages)
    off = scale_byte(LAYOUT, 5)
    scale_bytes = np.float32(page_scales(pages, 4)[5, 1, 1].item()).tobytes()  # the V scale of head 1
    assert raw(pages)[5, off - 5 * LAYOUT.page_bytes] == scale_bytes[3]
    with open(tmp_path / "kv" / "layer_000.kv", "r+b") as f:
        f.seek(off)
        byte = f.read(1)[0]
        f.seek(off)
        f.write(bytes([byte ^ 0x01]))  # the scale doubles or halves: every V value of the head is wrong
    with pytest.raises(PageCorruptedError, match=r"slots \[5\] failed their checksum"):
        tier.read(0, torch.arange(8))
    assert torch.equal(raw(tier.read(0, torch.tensor([4, 6]))), raw(pages[[4, 6]]))
    tier.close()


def test_corrupted_scale_on_the_remote_store_is_detected(server):
    import redis

    tier = RedisTier(LAYOUT, 8, server)
    pages = quantize_pages(torch.randn(8, 2, 4, 2, 8))
    tier.write(0, torch.arange(8), pages)
    other = redis.Redis.from_url(server)  # the store's copy changes behind the tier's back
    value = bytearray(other.get(tier.key(0, 2)))
    value[scale_byte(LAYOUT, 0)] ^= 0x01
    other.set(tier.key(0, 2), bytes(value))
    with pytest.raises(PageCorruptedError, match=r"slots \[2\] from .* checksum"):
        tier.read(0, torch.arange(8))
    tier.close()


# -- kernels on FP8 pools ------------------------------------------------------------------------
def fp8_batch(kv_lens, q_lens, num_kv, group, dim, causal, seed, page=16, window_left=-1, spare=3,
              exponents=(-6, 6)):
    """Random q ``[Nq, H, D]`` and an FP8 pool of fresh random pages in shuffled slots (outliers included),
    each (page, K/V, head) scaled by ``2^e``, ``e`` drawn from ``exponents``."""
    g = torch.Generator().manual_seed(seed)
    npages = [-(-n // page) for n in kv_lens]
    slots = sum(npages) + spare
    kv = torch.randn(slots, 2, page, num_kv, dim, generator=g)
    kv = kv * torch.exp2(torch.randint(*exponents, (slots, 2, 1, num_kv, 1), generator=g).float())  # scales differ
    pool = quantize_pages(kv)
    perm = torch.randperm(slots, generator=g)[:sum(npages)].int()
    last = torch.tensor([n - (p - 1) * page if p else 0 for n, p in zip(kv_lens, npages)]).int()
    batch = PagedBatch(torch.tensor([0] + q_lens).cumsum(0).int(), torch.tensor([0] + npages).cumsum(0).int(),
                       perm, last, page, causal, window_left=window_left)
    q = torch.randn(sum(q_lens), num_kv * group, dim, generator=g)
    return q, pool, batch


def test_reference_attends_the_dequantized_pages():
    q, pool, batch = fp8_batch([37, 5], [1, 1], 2, 2, 16, False, seed=4)
    got = paged_attention_reference(q, pool, batch, 0.25, return_page_max=True)
    want = paged_attention_reference(q, dequantize(pool, 16), batch, 0.25, return_page_max=True)
    assert torch.equal(got.out, want.out) and torch.equal(got.lse, want.lse)
    assert torch.equal(got.page_max, want.page_max)


def run_both(backend, q, pool, batch, group, num_kv, dim, dtype, sm_scale=None):
    q = q.to(dtype)
    backend.plan(batch, group * num_kv, num_kv, dim, sm_scale)
    with nan_empty():
        res = backend.run(q, pool, return_page_max=True)
    ref = paged_attention_reference(q, pool, batch, backend.sm_scale, return_page_max=True)
    assert rel_err(res.out, ref.out) < (1e-5 if dtype == torch.float32 else 1e-2)
    fin = torch.isfinite(ref.lse)
    assert torch.equal(torch.isfinite(res.lse), fin) and torch.allclose(res.lse[fin], ref.lse[fin], atol=1e-3)
    assert_page_max(res.page_max, ref.page_max, 1e-3)
    return res, ref


@INTERPRETED
@pytest.mark.parametrize("kv_lens,per_split,window_left,dtype", [
    ([70, 1, 33], 2, -1, torch.float32),  # splits + merge, partial last pages
    ([50, 0, 20], None, -1, torch.bfloat16),
    ([90, 40], 2, 20, torch.float32),  # a sliding window
])
def test_fp8_decode_matches_reference(kv_lens, per_split, window_left, dtype):
    q, pool, batch = fp8_batch(kv_lens, [1] * len(kv_lens), 2, 3, 16, False, seed=sum(kv_lens), window_left=window_left)
    backend = TritonBackend(decode_config=DecodeConfig(block_n=16, pages_per_split=per_split))
    run_both(backend, q, pool, batch, 3, 2, 16, dtype)


@INTERPRETED
@pytest.mark.parametrize("q_scale,v_shift,block_n,window_left", [
    (1.0, 0, 16, -1),
    (2.0 ** 17, 0, 64, 30),  # queries past fp16's range (65504): brought into it by a power of two
    (2.0 ** -20, 0, 32, -1),  # queries in fp16's subnormals
    (1.0, -14, 64, -1),  # every V scale at 2^-34 .. 2^-6: the weights P * scale sit below fp16's range
])
def test_fp8_decode_with_16bit_queries_and_wide_scales(q_scale, v_shift, block_n, window_left):
    """bf16 queries on FP8 pages take fp16 operands for Q K^T and bf16 ones for P V (the weights carry V's
    scales): within bf16's tolerance, row by row, for page scales spread over 2^-20 .. 2^8 and any query range."""
    q, pool, batch = fp8_batch([150, 1, 70], [1] * 3, 2, 3, 32, False, seed=block_n, window_left=window_left,
                               exponents=(-13, 16))  # amax ~3 x 2^e: page scales ~2^(e - 7)
    scales = page_scales(pool, 16)
    assert scales.min() <= 2.0 ** -18 and scales.max() >= 2.0 ** 6
    scales[:, 1] *= 2.0 ** v_shift
    backend = TritonBackend(decode_config=DecodeConfig(block_n=block_n, pages_per_split=4))
    res, ref = run_both(backend, q * q_scale, pool, batch, 3, 2, 32, torch.bfloat16, sm_scale=32 ** -0.5 / q_scale)
    row_err = (res.out.float() - ref.out.float()).norm(dim=-1) / ref.out.float().norm(dim=-1)  # [B, H]
    assert row_err.max() < 1e-2  # also rows whose weight sits on pages of tiny V scales


@INTERPRETED
@pytest.mark.parametrize("kv_lens,q_lens,causal,window_left", [
    ([40, 19], [7, 19], True, -1),
    ([45, 30], [3, 30], True, 9),
    ([33], [4], False, -1),
])
def test_fp8_prefill_matches_reference(kv_lens, q_lens, causal, window_left):
    q, pool, batch = fp8_batch(kv_lens, q_lens, 1, 4, 16, causal, seed=sum(kv_lens) + 1, window_left=window_left)
    backend = TritonBackend(prefill_config=PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1))
    run_both(backend, q, pool, batch, 4, 1, 16, torch.float32)


def test_a_pool_without_scale_rows_is_refused():
    q, pool, batch = fp8_batch([20], [1], 1, 1, 16, False, seed=5)
    backend = TritonBackend()
    backend.plan(batch, 1, 1, 16)
    with pytest.raises(ValueError, match="page_size \\+ 1"):
        backend.run(q, page_values(pool, 16).contiguous())


@INTERPRETED
@pytest.mark.parametrize("lists,window_left,dtype,exponents,block_n", [
    (None, -1, torch.float32, (-5, 5), 16),
    ([[0, 2, -1], [1, 2, 3]], 40, torch.float32, (-5, 5), 16),
    (None, 20, torch.bfloat16, (-13, 16), 32),  # fp16 / bf16 operands, page scales from ~2^-20 to ~2^8
])
def test_fp8_static_decode_reads_device_and_host_pages_with_their_scales(lists, window_left, dtype, exponents,
                                                                         block_n):
    from test_static_decode import random_case

    from kvtier.kernels.reference import static_decode_reference
    from kvtier.kernels.triton_decode import plan_static_decode, static_decode
    gen = torch.Generator().manual_seed(6)
    seq_lens, page, n_kv, group, dim = [50, 61], 16, 2, 3, 32
    q, _, _, dev_pool, host_pool, block_table = random_case(seq_lens, 4, page, n_kv, group, dim, torch.float32,
                                                            0.5, gen)
    q = q.to(dtype)
    dev_pool = quantize_pages(dev_pool * torch.exp2(torch.randint(*exponents, (dev_pool.shape[0], 2, 1, n_kv, 1),
                                                                  generator=gen).float()))
    host_pool = quantize_pages(host_pool * 40.0)
    plan = plan_static_decode(2, 4, n_kv * group, n_kv, dim, page, "cpu", None if lists is None else 3,
                              DecodeConfig(block_n=block_n, pages_per_split=2))
    lens, pl = torch.tensor(seq_lens, dtype=torch.int32), None if lists is None else torch.tensor(lists).int()
    pm, pm_ref, pm_deq = (torch.full((2, 4 if lists is None else 3, n_kv * group), math.nan) for _ in range(3))
    out, lse = static_decode(q, dev_pool, host_pool, block_table, lens, plan, 0.2, pl, window_left, pm)
    ref = static_decode_reference(q, dev_pool, host_pool, block_table, lens, plan, 0.2, pl, window_left, pm_ref)
    deq = static_decode_reference(q, dequantize(dev_pool, page), dequantize(host_pool, page), block_table, lens, plan,
                                  0.2, pl, window_left, pm_deq)
    assert torch.equal(ref[0], deq[0]) and torch.equal(pm_ref, pm_deq)  # the reference attends the dequantized pages
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(out, ref[0]) < tol and torch.allclose(lse, ref[1], atol=1e-4)
    assert_page_max(pm, pm_ref, 1e-4)


def test_fp8_pages_give_the_same_logits_wherever_they_live_and_stay_near_bf16_pages():
    """A tiny Llama with FP8 pages through ``generate``'s driver (TieredKVCache, pages through the host tier)
    and through the engine's own forward (every page in HBM): the same logits, near the unquantized run."""
    from kvtier.cache import TieredKVCache
    from kvtier.engine import Engine, EngineConfig
    from kvtier.models import kv_layout_for, tiny_llama
    from kvtier.policies import LRU
    from kvtier.scheduler.chunked_prefill import ChunkedPrefill

    model = tiny_llama(seed=1)
    prompt = torch.randint(0, 256, (45,), generator=torch.Generator().manual_seed(7))

    def hook_run(layout, steps=5):
        cache = TieredKVCache(layout, [DeviceTier(layout, 5, device="cpu"), HostTier(layout, 64)], LRU(), scope="all")
        logits = [cache.prefill(model, prompt[None], 16)[0, -1]]
        for _ in range(steps):
            logits.append(cache.forward(model, logits[-1].argmax().view(1, 1))[0, -1])
        return torch.stack(logits), cache

    fp8 = kv_layout_for(model.config, page_size=8, dtype=torch.float32, kv_dtype="fp8_e4m3")
    exact, _ = hook_run(kv_layout_for(model.config, page_size=8, dtype=torch.float32))
    hook, cache = hook_run(fp8)
    assert cache.table.occupancy()["host"][0] > 0  # pages (and scales) went through the host tier
    fast = Engine(model, fp8, [DeviceTier(fp8, 64, device="cpu")], LRU(), prefill=ChunkedPrefill(16),
                  config=EngineConfig(max_context=128))
    got = torch.stack([fast.add(prompt)[1][-1]] + [fast.step()[0].clone() for _ in range(5)])
    assert (got - hook).abs().max() / hook.abs().max() < 1e-4
    err = ((hook - exact).abs().max() / exact.abs().max()).item()
    assert 0 < err < 0.1  # quantized, not a no-op, and close


# -- the recipe ----------------------------------------------------------------------------------
def test_recipe_kv_dtype_sets_the_layout_and_the_tier_sizes():
    """``kvtier-run kv_dtype=fp8_e4m3``: the plan's layout stores FP8 pages, whose bytes (scale rows included)
    size the tiers; a bad name is a ConfigError on kv_dtype."""
    from kvtier.build import plan as validate
    from kvtier.run import job_configs
    from test_run import TINY

    (fp32_plan,) = map(validate, job_configs([*TINY, "budget.tokens=80"]))
    (fp8_plan,) = map(validate, job_configs([*TINY, "budget.tokens=80", "kv_dtype=fp8_e4m3"]))
    assert fp8_plan.layout.scaled and fp8_plan.layout.page_bytes * 64 == fp32_plan.layout.page_bytes * 17  # 16 rows of 4 B vs 17 of 1 B
    with pytest.raises(ConfigError) as err:
        list(map(validate, job_configs([*TINY, "kv_dtype=fp4"])))
    assert err.value.field == "kv_dtype"
    sized = [job_configs([*TINY, "budget.tokens=80", "tiers.stack.host.size=8MiB", *kv]) for kv in ([], ["kv_dtype=fp8_e4m3"])]
    host_fp32, host_fp8 = (validate(cfg).capacities["host"] for (cfg,) in sized)
    assert host_fp8 == (8 << 20) // (30 * fp8_plan.layout.page_bytes) > host_fp32 * 3  # 64/17 as many pages
