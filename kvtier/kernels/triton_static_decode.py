"""Graph-capturable paged decode attention over a device pool and a pinned host pool, with static shapes.

One query row per sequence. Every input has a shape fixed by the batch bucket, and the launch
needs no host work or sync, so a model step that uses it can be captured once in a CUDA graph and
replayed every token while sequences grow, join and finish (only tensor contents change).

A sequence's page ``p`` lives at ``block_table[b, p]``: ``x >= 0`` is slot ``x`` of the device
pool, ``x < 0`` slot ``-x - 1`` of the pinned host pool, which the kernel reads in place through
its mapped (UVA) address (see :mod:`kvtier.tiers.copy_kernel`): a miss costs PCIe bandwidth, not
a sync. The sequence attends its listed pages (``page_list[b]``, or all its logical pages), keys
``j < seq_len`` and, with a window, ``j >= seq_len - 1 - window_left`` (FlashInfer semantics).

The grid is static: ``(B * num_splits, N_kv)``. Split ``c`` of sequence ``b`` covers listed
indices ``[c * pps, (c + 1) * pps)`` and walks only the blocks that hold a counted key (a 32k
sequence with a 4k window reads ~4k tokens); all query heads of a kv group are the rows of one
``tl.dot`` tile, as in :mod:`kvtier.kernels.triton_decode`. A merge kernel combines the splits by
their LSE, or the split kernel writes the output directly when ``num_splits == 1``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from kvtier.kernels.triton_decode import (DecodeConfig, default_decode_config, num_multiprocessors, page_maxima,
                                          warp_token_order)
from kvtier.kernels.triton_prefill import (LN2, LOG2E, check_page_size, dot_operand_dtype, finish_rows, MIN_DOT,
                                           fit_shared_memory, online_softmax_step, query_operand, value_operand)
from kvtier.quant import dequantize, is_scaled_pool


MAX_SPLITS = 128  # most splits per sequence that plan_static_decode chooses


@dataclass(frozen=True, eq=False)
class StaticDecodePlan:
    """Launch shape of one batch bucket, fixed at capture time from shapes only, and the partials' buffers."""

    batch_size: int
    max_pages: int  # block_table width
    max_listed: int  # listed pages the splits cover (page_list width, or max_pages)
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_splits: int  # splits per sequence
    pages_per_split: int  # a multiple of block_n // page_size
    block_n: int
    config: DecodeConfig
    part_out: torch.Tensor | None = field(repr=False)  # [splits, B, H, D] fp32; None: one split
    part_lse: torch.Tensor | None = field(repr=False)  # [splits, B, H] fp32 (log2 units)


def plan_static_decode(batch_size: int, max_pages: int, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                       page_size: int, device, max_listed: int | None = None,
                       config: DecodeConfig | None = None, kv_bytes: int = 2) -> StaticDecodePlan:
    """Size the splits so that ``B x splits x N_kv`` programs fill the GPU at the bucket's longest context.

    ``max_listed`` is the page_list width (None: every sequence attends all its ``max_pages``
    pages); ``kv_bytes`` the pools' bytes per value (1 for FP8 pages), which picks the default
    config. Host work on static numbers only; allocates the partials when there is more than one split.
    """
    check_page_size(page_size)
    config = default_decode_config(head_dim, kv_bytes) if config is None else config
    listed = max_pages if max_listed is None else max_listed
    block_n = max(config.block_n, page_size, MIN_DOT)
    pages_per_block = block_n // page_size
    if config.pages_per_split is not None:
        per_split = config.pages_per_split
    else:
        target = num_multiprocessors(torch.device(device)) * config.ctas_per_sm
        per_split = max(-(-batch_size * listed * num_kv_heads // target), -(-config.min_split_tokens // page_size), 1)
        per_split = max(per_split, -(-listed // MAX_SPLITS))  # a merge reads every split of its row
        per_split = -(-listed // max(-(-listed // per_split), 1))  # even splits of the longest list
    per_split = -(-max(per_split, 1) // pages_per_block) * pages_per_block  # whole loop iterations
    splits = max(-(-listed // per_split), 1)
    part_out = part_lse = None
    if splits > 1:
        part_out = torch.empty(splits, batch_size, num_qo_heads, head_dim, dtype=torch.float32, device=device)
        part_lse = torch.empty(splits, batch_size, num_qo_heads, dtype=torch.float32, device=device)
    return StaticDecodePlan(batch_size, max_pages, listed, num_qo_heads, num_kv_heads, head_dim, page_size, splits,
                            per_split, block_n, config, part_out, part_lse)


@triton.jit
def _listed_range(list_row, i0, i1, first_page, n_pages, HAS_LIST: tl.constexpr, SCAN: tl.constexpr):
    """``[lo, hi)``: the span of listed indices in ``[i0, i1)`` whose page may hold a counted key.

    A page counts when ``first_page <= page < n_pages`` (``first_page``: the window's first page);
    ``lo >= hi`` when none does. With a page list, one vector scan of the split's entries.
    """
    if HAS_LIST:
        lo = i1
        hi = i0
        for j in range(i0, i1, SCAN):
            idx = j + tl.arange(0, SCAN)  # [SCAN]
            pg = tl.load(list_row + idx, mask=idx < i1, other=-1)
            useful = (pg >= first_page) & (pg < n_pages) & (idx < i1)
            lo = tl.minimum(lo, tl.min(tl.where(useful, idx, i1)))
            hi = tl.maximum(hi, tl.max(tl.where(useful, idx + 1, i0)))
    else:
        lo = tl.maximum(i0, first_page)
        hi = tl.minimum(i1, n_pages)
    return lo, hi


@triton.jit
def _static_split_kernel(
    q, dev_kv, host_kv, block_table, seq_lens, page_list,
    out, lse, page_max,
    stride_qn, stride_qh,
    stride_slot, stride_kv, stride_p, stride_kh,
    stride_bt, stride_pl,
    stride_os, stride_on, stride_oh,
    stride_ls, stride_ln,
    stride_pb, stride_pk, stride_ph,
    qk_scale, lse_scale, window_left, n_listed,
    SPLITS: tl.constexpr, PPS: tl.constexpr, SCAN: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_WARPS: tl.constexpr,
    HAS_HOST: tl.constexpr, HAS_LIST: tl.constexpr, WITH_PAGE_MAX: tl.constexpr,
    DOT_F32: tl.constexpr, FP8_HALF: tl.constexpr, PRECISION: tl.constexpr, SCALED: tl.constexpr,
):
    """One (sequence x split, kv head): rows ``[GROUP]`` of split ``c`` of sequence ``b``.

    FP8 pages (``SCALED``): the head's K (V) scale sits at row ``PAGE`` of the same page, read as fp32
    through the page's own pointer, so host pages bring theirs too. Dot operands as in
    :func:`kvtier.kernels.triton_decode._decode_split_kernel`.

    ``out [splits, B, H, D]`` / ``lse [splits, B, H]`` (log2 units times ``lse_scale``): fp32
    partials, or the final output when there is one split. ``page_max [B, n_listed, H]``: every
    listed entry of the split is written, -inf where no key counts.
    """
    PPB: tl.constexpr = BLOCK_N // PAGE  # pages per block
    WARP_ORDER: tl.constexpr = WITH_PAGE_MAX and BLOCK_N % (8 * NUM_WARPS) == 0
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    b = pid // SPLITS
    c = pid % SPLITS
    seq_len = tl.load(seq_lens + b)
    n_pages = (seq_len + PAGE - 1) // PAGE
    win_lo = tl.where(window_left >= 0, tl.maximum(seq_len - 1 - window_left, 0), 0)  # first visible key
    i0 = c * PPS  # listed indices of the split: [i0, i1)
    i1 = tl.minimum(i0 + PPS, n_listed)
    list_row = page_list + b * stride_pl
    lo, hi = _listed_range(list_row, i0, i1, win_lo // PAGE, n_pages, HAS_LIST, SCAN)
    blk_lo = (lo // PPB) * PPB  # i0 is a multiple of PPB: blocks stay aligned to the split
    blk_hi = tl.where(lo < hi, blk_lo + tl.cdiv(hi - blk_lo, PPB) * PPB, blk_lo)  # end of the walked blocks

    offs_g = tl.arange(0, BLOCK_G)  # [G] query head within the group
    offs_d = tl.arange(0, BLOCK_D)  # [D]
    order = warp_token_order(BLOCK_N, NUM_WARPS, WARP_ORDER)  # [N] token of each column
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g  # [G]
    qt = tl.load(q + b * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
                 mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [G, D]
    qt, qk_scale = query_operand(qt, qk_scale, FP8_HALF, DOT_F32)
    pm_row = page_max + b * stride_pb
    if WITH_PAGE_MAX:  # entries of the split outside the walked blocks attend nothing
        for j in range(i0, i1, SCAN):
            idx = j + tl.arange(0, SCAN)  # [SCAN]
            skip = (idx < i1) & ((idx < blk_lo) | (idx >= blk_hi))
            tl.store(pm_row + idx[None, :] * stride_pk + heads[:, None] * stride_ph,
                     tl.full([BLOCK_G, SCAN], float("-inf"), tl.float32), mask=g_ok[:, None] & skip[None, :])

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    head_off = kvh * stride_kh
    bt_row = block_table + b * stride_bt
    for i in range(blk_lo, blk_hi, PPB):
        li = i + order // PAGE  # [N] listed index of each token
        in_split = li < i1
        if HAS_LIST:
            pg = tl.load(list_row + li, mask=in_split, other=-1)  # [N] logical page
        else:
            pg = li
        tok = pg * PAGE + order % PAGE  # [N] key position in the sequence
        ok = in_split & (tok >= win_lo) & (tok < seq_len)
        loc = tl.load(bt_row + pg, mask=ok, other=0)  # [N]
        row = (order % PAGE) * stride_p + head_off  # [N]
        dev_row = dev_kv + (tl.maximum(loc, 0).to(tl.int64) * stride_slot + row)  # [N] pointers
        if HAS_HOST:  # one load per element: a host page's pointer is its mapped address
            host_row = host_kv + (tl.maximum(-loc - 1, 0).to(tl.int64) * stride_slot + row)
            k_row = tl.where(loc >= 0, dev_row, host_row)  # [N]
        else:
            k_row = dev_row
        k_ptrs = k_row[:, None] + offs_d[None, :]  # [N, D]
        kv_mask = ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(qt.dtype)  # [N, D]
        s = tl.dot(qt, tl.trans(k), input_precision=PRECISION) * qk_scale  # [G, N] log2 units
        if SCALED:  # K = values * the page's scale, folded into the logits
            scale_row = k_row + (PAGE - order % PAGE) * stride_p  # [N] the page's scale row, this head
            s = s * tl.load(scale_row.to(tl.pointer_type(tl.float32)), mask=ok, other=1.0)[None, :]
        s = tl.where(ok[None, :], s, float("-inf"))
        if WITH_PAGE_MAX:
            pm = page_maxima(s, BLOCK_G, BLOCK_N, PAGE, NUM_WARPS, WARP_ORDER)  # [G, PPB]
            pidx = i + tl.arange(0, PPB)  # [PPB] listed index
            tl.store(pm_row + pidx[None, :] * stride_pk + heads[:, None] * stride_ph, pm * 0.6931471805599453,
                     mask=g_ok[:, None] & (pidx < i1)[None, :])
        p, alpha, m_new, l_i = online_softmax_step(s, m_i, l_i)  # p [G, N]
        v = tl.load(k_ptrs + stride_kv, mask=kv_mask, other=0.0)  # [N, D]
        v = value_operand(v, qt, FP8_HALF, DOT_F32)
        if SCALED:  # V's scale on the probabilities (powers of two: exact)
            p = p * tl.load((scale_row + stride_kv).to(tl.pointer_type(tl.float32)), mask=ok, other=1.0)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)  # [G, D]
        m_i = m_new

    o, row_lse = finish_rows(acc, m_i, l_i, lse_scale)  # [G, D], [G]
    o_ptrs = out + c * stride_os + b * stride_on + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(out.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    tl.store(lse + c * stride_ls + b * stride_ln + heads, row_lse, mask=g_ok)


@triton.jit
def _merge_static_kernel(
    part_out, part_lse, out, lse,
    stride_ps, stride_pn, stride_ph,
    stride_ls, stride_ln,
    stride_on, stride_oh, stride_lo,
    SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One (row, head): softmax-weighted sum of its ``SPLITS`` partials (log2 LSE), ``CHUNK`` splits per load."""
    row = tl.program_id(0)
    h = tl.program_id(1)
    lse_row = part_lse + row * stride_ln + h
    offs_s = tl.arange(0, BLOCK_S)  # [S]
    offs_d = tl.arange(0, BLOCK_D)  # [D]
    d_ok = offs_d < HEAD_DIM
    m = tl.max(tl.load(lse_row + offs_s * stride_ls, mask=offs_s < SPLITS, other=float("-inf")), axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, SPLITS, CHUNK):
        offs_c = s0 + tl.arange(0, CHUNK)  # [C]
        w = tl.exp2(tl.load(lse_row + offs_c * stride_ls, mask=offs_c < SPLITS, other=float("-inf")) - m_safe)  # [C]
        o_s = tl.load(part_out + offs_c[:, None] * stride_ps + row * stride_pn + h * stride_ph + offs_d[None, :],
                      mask=(w > 0)[:, None] & d_ok[None, :], other=0.0)  # [C, D]; empty splits are not read
        acc += tl.sum(w[:, None] * o_s, axis=0)
        total += tl.sum(w, axis=0)
    has = total > 0
    o = acc / tl.where(has, total, 1.0)  # [D]
    tl.store(out + row * stride_on + h * stride_oh + offs_d, o.to(out.dtype.element_ty), mask=d_ok)
    tl.store(lse + row * stride_lo + h,
             tl.where(has, (m + tl.log2(tl.where(has, total, 1.0))) * 0.6931471805599453, float("-inf")))


def static_decode(q: torch.Tensor, dev_pool: torch.Tensor, host_pool: torch.Tensor | None,
                  block_table: torch.Tensor, seq_lens: torch.Tensor, plan: StaticDecodePlan, sm_scale: float,
                  page_list: torch.Tensor | None = None, window_left: int = -1,
                  page_max: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of ``q [B, H, D]`` over one layer's pools; no host sync, static shapes.

    ``dev_pool [slots, 2, P, N_kv, D]`` (FP8: ``P + 1`` rows, dequantized in the kernel),
    ``host_pool [hslots, 2, P, N_kv, D]`` (pinned, same strides and dtype) or None; ``block_table [B, max_pages]`` int32 (``x >= 0``: device slot,
    ``x < 0``: host slot ``-x - 1``; entries past a sequence's pages are never read);
    ``seq_lens [B]`` int32 (0: an inactive row, out 0, lse -inf); ``page_list [B, K]`` int32
    logical pages to attend (-1 and pages past the sequence attend nothing), None for all pages;
    ``window_left`` (-1: none); ``page_max`` an optional fp32 ``[B, K or max_pages, H]`` filled
    with the max scaled logit (natural log) of each listed page, -inf where no key counts.
    Returns out ``[B, H, D]`` (q's dtype) and lse ``[B, H]`` (fp32, natural log).
    """
    n_q, heads, dim = q.shape
    page, n_kv = plan.page_size, dev_pool.shape[3]
    scaled = is_scaled_pool(dev_pool, page)  # FP8 pages: [slots, 2, P + 1, N_kv, D]
    if dev_pool.shape[2] != page + scaled:
        raise ValueError(f"pool pages {tuple(dev_pool.shape[1:])} do not match the plan's page size {page}")
    n_listed = plan.max_pages if page_list is None else page_list.shape[1]
    if (n_q, heads, dim, page, n_kv) != (plan.batch_size, plan.num_qo_heads, plan.head_dim, plan.page_size,
                                         plan.num_kv_heads):
        raise ValueError(f"q {tuple(q.shape)} / pool {tuple(dev_pool.shape)} do not match the plan {plan}")
    if tuple(block_table.shape) != (n_q, plan.max_pages) or n_listed > plan.max_listed:
        raise ValueError(f"block_table {tuple(block_table.shape)} or {n_listed} listed pages exceed the plan {plan}")
    if page_max is not None and (tuple(page_max.shape) != (n_q, n_listed, heads) or page_max.dtype != torch.float32):
        raise ValueError(f"page_max needs fp32 [{n_q}, {n_listed}, {heads}], got {tuple(page_max.shape)}")
    if q.stride(-1) != 1 or dev_pool.stride(-1) != 1:
        raise ValueError("q and dev_pool need a contiguous head dimension")
    if host_pool is not None and (host_pool.stride() != dev_pool.stride() or host_pool.dtype != dev_pool.dtype):
        raise ValueError("host_pool needs dev_pool's strides and dtype")
    block_d = triton.next_power_of_2(dim)
    dot_f32, precision = dot_operand_dtype(q.dtype)
    out = torch.empty(n_q, heads, dim, dtype=q.dtype, device=q.device)  # [B, H, D]
    lse = torch.empty(n_q, heads, dtype=torch.float32, device=q.device)  # [B, H]
    single = plan.num_splits == 1
    part_out, part_lse = (out.unsqueeze(0), lse.unsqueeze(0)) if single else (plan.part_out, plan.part_lse)
    pm = page_max if page_max is not None else lse.unsqueeze(1)  # a placeholder pointer when off
    pl = page_list if page_list is not None else block_table
    scan = min(triton.next_power_of_2(plan.pages_per_split), 256)  # listed entries per vector scan
    block_g = max(16, triton.next_power_of_2(heads // n_kv))
    _, stages = fit_shared_memory(block_g, plan.block_n, plan.config.num_stages, block_d,
                                  4 if dot_f32 else q.element_size(), plan.block_n, dev_pool.element_size())
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _static_split_kernel[(n_q * plan.num_splits, n_kv)](
            q, dev_pool, host_pool if host_pool is not None else dev_pool, block_table, seq_lens, pl,
            part_out, part_lse, pm,
            q.stride(0), q.stride(1),
            dev_pool.stride(0), dev_pool.stride(1), dev_pool.stride(2), dev_pool.stride(3),
            block_table.stride(0), pl.stride(0),
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            pm.stride(0), pm.stride(1), pm.stride(2),
            sm_scale * LOG2E, LN2 if single else 1.0, window_left, n_listed,
            SPLITS=plan.num_splits, PPS=plan.pages_per_split, SCAN=scan,
            GROUP=heads // n_kv, BLOCK_G=block_g, PAGE=page,
            BLOCK_N=plan.block_n, HEAD_DIM=dim, BLOCK_D=block_d, NUM_WARPS=plan.config.num_warps,
            HAS_HOST=host_pool is not None, HAS_LIST=page_list is not None, WITH_PAGE_MAX=page_max is not None,
            DOT_F32=dot_f32, FP8_HALF=scaled and q.dtype != torch.float32, PRECISION=precision, SCALED=scaled,
            num_warps=plan.config.num_warps, num_stages=stages, maxnreg=plan.config.maxnreg,
        )
        if not single:
            block_s = triton.next_power_of_2(plan.num_splits)
            chunk = min(block_s, 16)
            _merge_static_kernel[(n_q, heads)](
                part_out, part_lse, out, lse,
                part_out.stride(0), part_out.stride(1), part_out.stride(2),
                part_lse.stride(0), part_lse.stride(1),
                out.stride(0), out.stride(1), lse.stride(0),
                SPLITS=plan.num_splits, BLOCK_S=block_s, CHUNK=chunk, HEAD_DIM=dim, BLOCK_D=block_d,
                num_warps=max(chunk * block_d // 1024, 1),  # <= 8 partial values per thread and load
            )
    return out, lse


def static_decode_reference(q: torch.Tensor, dev_pool: torch.Tensor, host_pool: torch.Tensor | None,
                            block_table: torch.Tensor, seq_lens: torch.Tensor, plan: StaticDecodePlan | None,
                            sm_scale: float, page_list: torch.Tensor | None = None, window_left: int = -1,
                            page_max: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract of :func:`static_decode` in fp32 torch, vectorised over the batch and pages.

    The CPU path of the fast engine and the kernel's oracle; the pools may live on different
    devices (host pages are gathered on the host pool's device). ``plan`` is accepted for a
    drop-in signature and not needed.
    """
    n_q, heads, dim = q.shape
    n_kv = dev_pool.shape[3]
    page = dev_pool.shape[2] - (dev_pool.dtype == torch.float8_e4m3fn)  # FP8 pages hold a scale row
    as_f32 = dequantize if is_scaled_pool(dev_pool, page) else torch.Tensor.float  # [n, 2, P, N_kv, D] fp32
    dev = q.device
    max_pages = block_table.shape[1]
    ids = (torch.arange(max_pages, device=dev).expand(n_q, -1) if page_list is None
           else page_list.to(dev, torch.long))  # [B, K] logical page of each listed entry
    n_listed = ids.shape[1]
    lens = seq_lens.to(dev, torch.long)[:, None, None]  # [B, 1, 1]
    lo = (lens - 1 - window_left).clamp(min=0) if window_left >= 0 else torch.zeros_like(lens)
    tok = ids[:, :, None] * page + torch.arange(page, device=dev)  # [B, K, P] key position
    ok = (tok >= lo) & (tok < lens)  # [B, K, P]; a -1 entry has negative positions
    loc = block_table.to(dev, torch.long).gather(1, ids.clamp(0, max_pages - 1))  # [B, K]
    need = ok.any(-1)  # [B, K] entries whose page is read
    pages = torch.zeros(n_q, n_listed, 2, page, n_kv, dim, dtype=torch.float32, device=dev)  # [B, K, 2, P, N_kv, D]
    on_dev = need & (loc >= 0)
    pages[on_dev] = as_f32(dev_pool[loc[on_dev].to(dev_pool.device)]).to(dev)
    if host_pool is not None:
        on_host = need & (loc < 0)
        pages[on_host] = as_f32(host_pool[(-loc[on_host] - 1).to(host_pool.device)]).to(dev)
    k = pages[:, :, 0].reshape(n_q, n_listed * page, n_kv, dim)  # [B, S, N_kv, D]
    v = pages[:, :, 1].reshape(n_q, n_listed * page, n_kv, dim).masked_fill(~ok.view(n_q, -1, 1, 1), 0.0)  # stale rows
    qg = q.float().view(n_q, n_kv, heads // n_kv, dim)  # [B, N_kv, G, D]; head h = kv h // G
    logits = torch.einsum("bngd,bsnd->bngs", qg, k).reshape(n_q, heads, -1) * sm_scale  # [B, H, S]
    logits = logits.masked_fill(~ok.view(n_q, 1, -1), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [B, H]
    probs = torch.exp(logits - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])  # [B, H, S]
    out = torch.einsum("bngs,bsnd->bngd", probs.view(n_q, n_kv, heads // n_kv, -1), v)  # [B, N_kv, G, D]
    if page_max is not None:
        page_max.copy_(logits.view(n_q, heads, n_listed, page).amax(-1).transpose(1, 2))  # [B, K, H]
    return out.reshape(n_q, heads, dim).to(q.dtype), lse
