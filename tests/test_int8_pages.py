"""int8 KV pages (``kv_dtype="int8"``): int8 steps per (page, K/V, kv head, channel) about the page's mean.

The format's bounds (half a step, whole pages and pages grown a token at a time), bit-identical round trips
through the tiers, the Triton decode and prefill kernels against the torch oracle on fresh random pools
(the interpreter on a CPU, the kernels themselves on a GPU: ``pytest tests/test_int8_pages.py``), and the
reason for the format on the real SmolLM2: its perplexity gap to bf16 pages is a fraction of FP8's.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from kvtier import BlockTable, KVLayout
from kvtier.errors import ConfigError
from kvtier.kernels.base import PagedBatch
from kvtier.kernels.reference import paged_attention_reference, static_decode_reference
from kvtier.mover.paged_io import read_tokens, write_tokens
from kvtier.quant import (FP8, INT8, channel_means, channel_steps, dequantize, page_values, quantize_pages,
                          step_exponent, step_of, write_scaled)
from kvtier.mover import TransferEngine
from kvtier.tiers import DeviceTier, HostTier
from kvtier.tiers.disk import DiskTier
from test_kernels_reference import rel_err
from test_kernels_triton import assert_page_max, nan_empty

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="bfloat16", kv_dtype="int8")
TRITON = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                            reason="Triton needs a GPU or TRITON_INTERPRET=1")


def device():
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available() else "cuda"


def offset_tokens(shape, gen, spread=(-6, 6)):
    """Random values ``shape [..., N_kv, D]`` shaped like RoPE'd keys: each channel an offset of its own (up to
    30x the noise) plus noise, the magnitudes spread over ``2^spread``."""
    *lead, n_kv, dim = shape
    offset = torch.randn(n_kv, dim, generator=gen) * 30 * (torch.rand(n_kv, dim, generator=gen) < 0.3)
    scale = torch.exp2(torch.randint(*spread, (*lead[:-1], 1, n_kv, 1), generator=gen).float())
    return (offset + torch.randn(*shape, generator=gen)) * scale


# -- layout and the recipe -----------------------------------------------------------------------
def test_layout_stores_int8_pages_with_three_scale_rows():
    assert LAYOUT.kv_dtype == INT8 and LAYOUT.scaled and LAYOUT.scale_rows == 3
    assert LAYOUT.page_shape == (2, 7, 2, 8) and LAYOUT.page_bytes == 2 * 7 * 2 * 8
    fp8 = KVLayout(2, 2, 8, 4, "bfloat16", kv_dtype="fp8_e4m3")
    assert fp8.page_shape == (2, 5, 2, 8) and fp8.scale_rows == 1
    with pytest.raises(ConfigError, match="kv_dtype"):
        KVLayout(1, 1, 6, 4, "bfloat16", kv_dtype="int8")  # the means' two rows need D / 2 whole bf16s


def test_recipe_kv_dtype_int8_sets_the_layout_and_the_tier_sizes():
    from kvtier.build import plan as validate
    from kvtier.run import job_configs
    from test_run import TINY

    (bf16,) = map(validate, job_configs([*TINY, "budget.tokens=80", "model.dtype=bfloat16"]))
    (int8,) = map(validate, job_configs([*TINY, "budget.tokens=80", "model.dtype=bfloat16", "kv_dtype=int8"]))
    assert int8.layout.kv_dtype == INT8 and int8.layout.page_bytes * 32 == bf16.layout.page_bytes * 19  # 19 rows of 1 B
    with pytest.raises(ConfigError) as err:
        list(map(validate, job_configs([*TINY, "kv_dtype=int4"])))
    assert err.value.field == "kv_dtype"


# -- the format ----------------------------------------------------------------------------------
def test_step_exponents_are_the_smallest_that_hold_the_range():
    amax = torch.tensor([0.0, 127.0, 127.0 * 2 ** 0.25, 127.0 * 2 ** 0.25 * 1.0001, 1e-30, 3e9, 1e30])
    e = step_exponent(amax)
    assert e.tolist() == [-128, 0, 1, 2, -128, 98, 127]  # 4 log2(3e9 / 127) = 97.97; 1e30 saturates
    assert (amax[:-1] <= 127 * step_of(e[:-1])).all() and (amax[1:4] > 127 * step_of(e[1:4] - 1)).all()


def test_whole_pages_hold_each_channel_within_half_a_step_of_its_mean():
    g = torch.Generator().manual_seed(1)
    kv = offset_tokens((5, 2, 16, 3, 32), g)  # [n, 2, P, N_kv, D]
    pages = quantize_pages(kv, INT8)
    assert pages.shape == (5, 2, 19, 3, 32) and pages.dtype == INT8
    mean = channel_means(pages, 16).float()  # [n, 2, N_kv, D]
    assert ((mean - kv.mean(2)).abs() <= kv.mean(2).abs() * 2.0 ** -8).all()  # the page's mean, in bf16
    step = step_of(channel_steps(pages, 16))  # [n, 2, N_kv, D]
    amax = (kv - mean[:, :, None]).abs().amax(2)
    assert (amax <= 127 * step).all() and (amax > 127 * step * 2 ** -0.25).all()  # the smallest that holds
    assert page_values(pages, 16).abs().max() <= 127
    err = (dequantize(pages, 16) - kv).abs()
    assert (err <= step[:, :, None] / 2 * (1 + 1e-6) + kv.abs() * 2.0 ** -23).all()
    fp8_err = (dequantize(quantize_pages(kv, FP8), 16) - kv).abs()
    assert err.mean() * 20 < fp8_err.mean()  # what the format is for: E4M3's 3 bits on the offsets


def test_a_page_written_a_token_at_a_time_keeps_its_first_mean_and_grows_its_steps():
    """Decode writes: the mean is the first token's, each step only grows, earlier values are rounded again
    when it does (each time at most half the new step, a quarter octave above the last at least)."""
    g = torch.Generator().manual_seed(2)
    tokens = offset_tokens((2, 16, 2, 8), g, spread=(0, 1)) * torch.linspace(0.2, 4, 16)[None, :, None, None]
    pool = torch.randint(-128, 128, (3, 2, 19, 2, 8), generator=g).to(INT8)  # stale bytes in every slot
    steps = []
    for t in range(16):
        write_scaled(pool, 16, torch.tensor([1]), torch.tensor([0]), torch.tensor([t]), tokens[:, t:t + 1])
        steps.append(step_of(channel_steps(pool, 16)[1]))
        assert torch.equal(channel_means(pool, 16)[1], tokens[:, 0].to(torch.bfloat16))
        err = (dequantize(pool, 16)[1, :, :t + 1] - tokens[:, :t + 1]).abs()
        assert (err <= steps[-1][:, None] * 0.5 / (1 - 2 ** -0.25)).all()  # half a step per growth, at most
    assert all((b >= a).all() for a, b in zip(steps, steps[1:])) and (steps[-1] > steps[1]).any()
    pool2 = pool.clone()  # the first write's tokens set the mean: three at once, then the rest
    write_scaled(pool2, 16, torch.tensor([1]), torch.zeros(3, dtype=torch.long), torch.arange(3), tokens[:, :3])
    first = tokens[:, :3].mean(1)
    assert ((channel_means(pool2, 16)[1].float() - first).abs() <= first.abs() * 2.0 ** -8).all()


# -- tiers ---------------------------------------------------------------------------------------
def test_int8_pages_cross_the_tiers_bit_identical_and_writes_agree_on_every_tier(tmp_path):
    """Whole sequences through device -> host -> disk -> device, and tokens appended one by one into pages on
    each tier (in place, or read-modify-write on disk): the same bytes everywhere."""
    tiers = [DeviceTier(LAYOUT, 16, device="cpu"), HostTier(LAYOUT, 16), DiskTier(LAYOUT, 16, tmp_path / "kv")]
    table = BlockTable(LAYOUT, tiers)
    g = torch.Generator().manual_seed(3)
    kv = offset_tokens((2, 22, 2, 8), g).to(torch.bfloat16)
    table.add_sequence(0)
    table.append(0, 22)
    write_tokens(table, 0, 0, kv, 0)
    pids = table.pages(0)

    def stored(seq):
        at, slots = table.locate(0, table.pages(seq))
        return torch.cat([table.tiers[t].read(0, torch.tensor([s])) for t, s in zip(at, slots)])

    want = stored(0)
    transfer = TransferEngine(table)
    for dst in (1, 2, 0, 2, 1, 0):
        transfer.migrate(0, pids[1:5], dst=dst)
        transfer.wait()
        assert torch.equal(stored(0).view(torch.uint8), want.view(torch.uint8))
    assert (read_tokens(table, 0, 0).float() - kv.float()).abs().max() < 0.05 * kv.float().abs().max()
    written = []
    for tier in range(3):
        table.add_sequence(1 + tier)
        table.append(1 + tier, 7)
        transfer.migrate(0, table.pages(1 + tier), dst=tier)
        transfer.wait()
        for t in range(7):
            write_tokens(table, 0, 1 + tier, kv[:, t:t + 1], t)
        written.append(stored(1 + tier).view(torch.uint8))
    assert all(torch.equal(written[0], w) for w in written[1:])
    for t in tiers:
        t.close()


# -- kernels against the oracle ------------------------------------------------------------------
def as_operands(pages: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dequantized pages as the kernels' ``tl.dot`` operands: on a GPU, 16-bit queries meet keys and values rounded
    to the query's dtype (the interpreter computes in fp32)."""
    return pages.to(dtype).float() if torch.cuda.is_available() and dtype != torch.float32 else pages


@TRITON
@pytest.mark.parametrize("lists,window_left,dtype,block_n", [
    (None, -1, torch.float32, 16),
    ([[0, 2, -1], [1, 2, 3]], 40, torch.float32, 16),  # page lists, a window
    ("per_head", -1, torch.float32, 32),  # a list per kv head
    (None, 20, torch.bfloat16, 32),  # 16-bit queries: bf16 operands
])
def test_int8_static_decode_matches_the_oracle(lists, window_left, dtype, block_n):
    """Device and host pages (each with its steps and means), splits and their merge, page max and log-sum-exp;
    the oracle attends exactly the dequantized pages."""
    from test_static_decode import host, random_case

    from kvtier.kernels.triton_decode import DecodeConfig, plan_static_decode, static_decode
    gen = torch.Generator().manual_seed(6 + block_n)
    seq_lens, page, n_kv, group, dim = [50, 61], 16, 2, 3, 32
    q, _, _, dev_pool, host_pool, block_table = random_case(seq_lens, 4, page, n_kv, group, dim, torch.float32,
                                                            0.5, gen)
    dev_pool = quantize_pages(offset_tokens(dev_pool.shape, gen, spread=(-12, 12)), INT8)
    host_pool = quantize_pages(offset_tokens(host_pool.shape, gen), INT8)
    q = q.to(dtype)
    if lists == "per_head":
        pl = torch.tensor([[[0, 2, 3], [1, -1, 3]], [[3, 1, 0], [2, 0, -1]]], dtype=torch.int32)  # [B, N_kv, K]
    else:
        pl = None if lists is None else torch.tensor(lists, dtype=torch.int32)
    listed = 4 if pl is None else pl.shape[-1]
    plan = plan_static_decode(2, 4, n_kv * group, n_kv, dim, page, device(), None if pl is None else listed,
                              DecodeConfig(block_n=block_n, pages_per_split=2))
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    dev = device()
    stats = [torch.full((2, listed, n_kv * group), math.nan, device=d) for d in (dev, dev, "cpu", "cpu")]
    on = lambda x: None if x is None else x.to(dev)  # noqa: E731
    with nan_empty():  # page max and log-sum-exp: the kernel's, then the oracle's
        out, lse = static_decode(q.to(dev), dev_pool.to(dev), host(host_pool), block_table.to(dev), lens.to(dev),
                                 plan, 0.2, on(pl), window_left, stats[0], stats[1])
    ref = static_decode_reference(q, dev_pool, host_pool, block_table, lens, plan, 0.2, pl, window_left, stats[2],
                                  stats[3])
    deq = static_decode_reference(q, dequantize(dev_pool, page), dequantize(host_pool, page), block_table, lens, plan,
                                  0.2, pl, window_left)
    assert torch.equal(ref[0], deq[0]) and torch.equal(ref[1], deq[1])
    ops = [as_operands(dequantize(p, page), dtype) for p in (dev_pool, host_pool)]
    ref = static_decode_reference(q, *ops[:1], ops[1], block_table, lens, plan, 0.2, pl, window_left, stats[2], stats[3])
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(out.cpu(), ref[0]) < tol and torch.allclose(lse.cpu(), ref[1], atol=1e-4)
    assert_page_max(stats[0].cpu(), stats[2], 1e-4)
    assert_page_max(stats[1].cpu(), stats[3], 1e-4)


def int8_batch(kv_lens, q_lens, num_kv, group, dim, causal, seed, page=16, window_left=-1, spare=3):
    """Random q ``[Nq, H, D]`` and an int8 pool of fresh random pages in shuffled slots, on the test's device."""
    g = torch.Generator().manual_seed(seed)
    npages = [-(-n // page) for n in kv_lens]
    slots = sum(npages) + spare
    pool = quantize_pages(offset_tokens((slots, 2, page, num_kv, dim), g), INT8)
    perm = torch.randperm(slots, generator=g)[:sum(npages)].int()
    last = torch.tensor([n - (p - 1) * page if p else 0 for n, p in zip(kv_lens, npages)]).int()
    dev = device()
    batch = PagedBatch(torch.tensor([0] + q_lens).cumsum(0).int().to(dev),
                       torch.tensor([0] + npages).cumsum(0).int().to(dev), perm.to(dev), last.to(dev), page, causal,
                       window_left=window_left)
    q = torch.randn(sum(q_lens), num_kv * group, dim, generator=g)
    return q.to(dev), pool.to(dev), batch


@TRITON
@pytest.mark.parametrize("kv_lens,q_lens,causal,window_left,dtype", [
    ([40, 19], [7, 19], True, -1, torch.float32),  # prefill chunks, partial last pages
    ([45, 30], [3, 30], True, 9, torch.float32),  # a sliding window
    ([33], [4], False, -1, torch.bfloat16),
    ([70, 1, 33], [1, 1, 1], False, -1, torch.float32),  # decode rows through a PagedBatch
])
def test_int8_paged_batches_match_the_oracle(kv_lens, q_lens, causal, window_left, dtype):
    from kvtier.kernels.triton_decode import DecodeConfig, TritonBackend
    from kvtier.kernels.triton_prefill import PrefillConfig

    q, pool, batch = int8_batch(kv_lens, q_lens, 2, 3, 16, causal, seed=sum(kv_lens), window_left=window_left)
    q = q.to(dtype)
    backend = TritonBackend(decode_config=DecodeConfig(block_n=16, pages_per_split=2),
                            prefill_config=PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1))
    backend.plan(batch, 6, 2, 16)
    with nan_empty():
        res = backend.run(q, pool, return_page_max=True)
    ref = paged_attention_reference(q, pool, batch, backend.sm_scale, return_page_max=True)
    deq = paged_attention_reference(q, dequantize(pool, 16), batch, backend.sm_scale)
    assert torch.equal(ref.out, deq.out) and torch.equal(ref.lse, deq.lse)
    ref = paged_attention_reference(q, as_operands(dequantize(pool, 16), dtype), batch, backend.sm_scale,
                                    return_page_max=True)
    assert rel_err(res.out, ref.out) < (1e-5 if dtype == torch.float32 else 1e-2)
    fin = torch.isfinite(ref.lse)
    assert torch.equal(torch.isfinite(res.lse), fin) and torch.allclose(res.lse[fin], ref.lse[fin], atol=1e-3)
    assert_page_max(res.page_max, ref.page_max, 1e-3)


# -- the engine ----------------------------------------------------------------------------------
def test_int8_pages_through_the_engine_and_the_hook_give_the_same_logits():
    """A tiny Llama's prefill (chunks that end inside pages) and decode steps (pages grown a token at a time)
    on int8 pages through ``generate``'s driver (pages through the host tier) and the engine's own step: the
    same logits, near the unquantized run and nearer than FP8 pages (random weights: no channel offsets)."""
    from kvtier.cache import TieredKVCache
    from kvtier.engine import Engine, EngineConfig
    from kvtier.models import kv_layout_for, tiny_llama
    from kvtier.policies import LRU
    from kvtier.scheduler.chunked_prefill import ChunkedPrefill

    model = tiny_llama(seed=1)
    prompt = torch.randint(0, 256, (45,), generator=torch.Generator().manual_seed(7))

    def hook_run(kv_dtype=None, steps=5):
        layout = kv_layout_for(model.config, page_size=8, dtype=torch.float32, kv_dtype=kv_dtype)
        cache = TieredKVCache(layout, [DeviceTier(layout, 5, device="cpu"), HostTier(layout, 64)], LRU(), scope="all")
        logits = [cache.prefill(model, prompt[None], 12)[0, -1]]
        for _ in range(steps):
            logits.append(cache.forward(model, logits[-1].argmax().view(1, 1))[0, -1])
        return torch.stack(logits), cache

    exact, _ = hook_run()
    hook, cache = hook_run("int8")
    fp8, _ = hook_run("fp8_e4m3")
    assert cache.table.occupancy()["host"][0] > 0
    layout = kv_layout_for(model.config, page_size=8, dtype=torch.float32, kv_dtype="int8")
    fast = Engine(model, layout, [DeviceTier(layout, 64, device="cpu")], LRU(), prefill=ChunkedPrefill(12),
                  config=EngineConfig(max_context=128))
    got = torch.stack([fast.add(prompt)[1][-1]] + [fast.step()[0].clone() for _ in range(5)])
    assert (got - hook).abs().max() / hook.abs().max() < 1e-4
    err = ((hook - exact).abs().max() / exact.abs().max()).item()
    assert 0 < err < ((fp8 - exact).abs().max() / exact.abs().max()).item() / 2


def test_int8_pages_keep_smollm2_near_bf16_where_fp8_pages_do_not(smollm2):
    """256 Opticks tokens of the real SmolLM2 prefilled in 120-token chunks (pages grown across chunks), each
    chunk attending the stored pages: the NLL gap of int8 pages to bf16 pages is under a quarter of FP8's."""
    from kvtier.data import token_stream
    from kvtier.engine import Engine, EngineConfig
    from kvtier.models import kv_layout_for
    from kvtier.policies import LRU
    from kvtier.scheduler.chunked_prefill import ChunkedPrefill

    model, tok = smollm2
    ids = token_stream(tok, "opticks", 256)
    nll = {}
    try:
        for kv_dtype in ("bfloat16", "fp8_e4m3", "int8"):
            layout = kv_layout_for(model.config, page_size=16, dtype=torch.float32, kv_dtype=kv_dtype)
            engine = Engine(model, layout, [DeviceTier(layout, 20, device="cpu")], LRU(), "all",
                            prefill=ChunkedPrefill(120), config=EngineConfig(max_context=272))
            with torch.no_grad():
                logits = engine.prefill_sequence(engine.open(256), ids, all_logits=True)  # [256, V]
            nll[kv_dtype] = torch.nn.functional.cross_entropy(logits[:-1].double(), ids[1:]).item()
    finally:
        model.set_attn_implementation("sdpa")
    gap_fp8, gap_int8 = nll["fp8_e4m3"] - nll["bfloat16"], nll["int8"] - nll["bfloat16"]
    assert gap_fp8 > 0.01 and abs(gap_int8) < gap_fp8 / 4, nll
