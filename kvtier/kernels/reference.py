"""Torch reference backend: the oracle for every kernel, and the CPU path of the model runs."""

from __future__ import annotations

import torch

from kvtier.kernels.base import (DROPPED, SCORE_BINS, SCORE_RANGE, STAGED, AttentionBackend, AttentionOutput,
                                 Capabilities, PagedBatch, at_host, check_key_list, check_landing)
from kvtier.quant import dequantize, is_scaled_pool


def paged_attention_reference(q: torch.Tensor, kv_pool: torch.Tensor, batch: PagedBatch, sm_scale: float,
                              return_page_max: bool = False) -> AttentionOutput:
    """Paged GQA attention in fp32, one sequence at a time.

    q ``[Nq, H, D]``, kv_pool ``[slots, 2, P, N_kv, D]`` (8-bit: ``[slots, 2, P + R, N_kv, D]`` with scales,
    dequantized here: :mod:`kvtier.quant`); see :mod:`kvtier.kernels.base` for the batch convention. Returns out ``[Nq, H, D]`` (q's dtype), lse ``[Nq, H]``, page_max ``[nnz, H]``.
    """
    n_q, heads, dim = q.shape
    page = batch.page_size
    n_kv = kv_pool.shape[3]
    group = heads // n_kv
    scaled = is_scaled_pool(kv_pool, page)
    out = torch.zeros(n_q, heads, dim, dtype=torch.float32, device=q.device)  # [Nq, H, D]
    lse = torch.full((n_q, heads), float("-inf"), dtype=torch.float32, device=q.device)  # [Nq, H]
    nnz = batch.kv_indices.numel()
    page_max = torch.full((nnz, heads), float("-inf"), dtype=torch.float32, device=q.device) if return_page_max else None
    qo = batch.host("qo_indptr").tolist()
    kvp = batch.host("kv_indptr").tolist()
    kv_lens = batch.kv_lens().tolist()
    for b in range(batch.batch_size):
        q0, q1, p0, p1 = qo[b], qo[b + 1], kvp[b], kvp[b + 1]
        if q1 == q0 or p1 == p0:
            continue
        s_len = kv_lens[b]
        pages = kv_pool.index_select(0, batch.kv_indices[p0:p1].long())  # [n, 2, P(+R), N_kv, D]
        if scaled:
            pages = dequantize(pages, page)  # [n, 2, P, N_kv, D] fp32
        k = pages[:, 0].reshape(-1, n_kv, dim)[:s_len].float()  # [S, N_kv, D]
        v = pages[:, 1].reshape(-1, n_kv, dim)[:s_len].float()
        qb = q[q0:q1].float().view(q1 - q0, n_kv, group, dim)  # [n, N_kv, G, D]; head h = kv h // G
        # [H, n, S]; one buffer, changed in place below (a 4k prompt's chunk of 512 rows: 75 MB a head group)
        logits = torch.einsum("nkgd,skd->kgns", qb, k).reshape(heads, q1 - q0, s_len).mul_(sm_scale)
        if batch.causal or batch.window_left >= 0:
            key = torch.arange(s_len, device=q.device)[None, :]  # [1, S]
            pos = (s_len - (q1 - q0) + torch.arange(q1 - q0, device=q.device))[:, None]  # [n, 1] bottom-right
            allowed = key <= pos if batch.causal else torch.ones_like(key, dtype=torch.bool)  # [n or 1, S]
            if batch.window_left >= 0:
                allowed = allowed & (key >= pos - batch.window_left)  # [n, S]
            logits.masked_fill_(~allowed, float("-inf"))
        if batch.head_mask is not None:  # kv head h sees only its pages
            seen = batch.head_mask[p0:p1].repeat_interleave(page, dim=0)[:s_len]  # [S, N_kv]
            logits.view(n_kv, group, q1 - q0, s_len).masked_fill_(~seen.T[:, None, None, :], float("-inf"))
        if return_page_max:
            n_pages = p1 - p0
            padded = torch.full((heads, q1 - q0, n_pages * page), float("-inf"), device=q.device)
            padded[..., :s_len] = logits
            page_max[p0:p1] = padded.view(heads, q1 - q0, n_pages, page).amax(dim=(1, 3)).transpose(0, 1)
        row_lse = torch.logsumexp(logits, dim=-1)  # [H, n]
        safe = torch.where(torch.isfinite(row_lse), row_lse, torch.zeros_like(row_lse))
        probs = logits.sub_(safe[..., None]).exp_()  # [H, n, S], in the logits' buffer
        out[q0:q1] = torch.einsum("kgns,skd->nkgd", probs.view(n_kv, group, q1 - q0, s_len), v).reshape(
            q1 - q0, heads, dim)
        lse[q0:q1] = row_lse.transpose(0, 1)
    return AttentionOutput(out.to(q.dtype), lse, page_max)


class TorchBackend(AttentionBackend):
    """Reference backend (CPU and GPU)."""

    name = "torch"
    can = Capabilities(captures=False)  # reads the lengths on the host

    def run(self, q, kv_pool, return_page_max=False):
        return paged_attention_reference(q, kv_pool, self.batch, self.sm_scale, return_page_max)

    def decode(self, *args, **kwargs):
        """The engine's decode step: :func:`static_decode_reference`."""
        return static_decode_reference(*args, **kwargs)


def static_decode_reference(q: torch.Tensor, dev_pool: torch.Tensor, host_pool: torch.Tensor | None,
                            block_table: torch.Tensor, seq_lens: torch.Tensor, plan, sm_scale: float,
                            page_list: torch.Tensor | None = None, window_left: int = -1,
                            page_max: torch.Tensor | None = None, page_lse: torch.Tensor | None = None,
                            spans: torch.Tensor | None = None, stage_pool: torch.Tensor | None = None,
                            key_list: torch.Tensor | None = None, land_slots: torch.Tensor | None = None,
                            land_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract of :func:`kvtier.kernels.triton_decode.static_decode` in fp32 torch, vectorised over the
    batch and pages: the engine's decode step on the CPU and the kernel's oracle.

    The pools may live on different devices (host and staged pages are gathered on their pool's device).
    Of ``plan`` only the page size is read.
    """
    n_q, heads, dim = q.shape
    n_kv = dev_pool.shape[3]
    page = plan.page_size
    keys, page_list = check_key_list(key_list, page_list, plan.entry_tokens, page, dev_pool.dtype == torch.int8,
                                     spans, land_slots is not None)
    scaled = is_scaled_pool(dev_pool, page)  # 8-bit pages hold rows of scales
    check_landing(land_slots, land_index, page_list, host_pool, scaled, n_q)
    as_f32 = (lambda pages: dequantize(pages, page)) if scaled else torch.Tensor.float  # [n, 2, P, N_kv, D] fp32
    dev = q.device
    max_pages = block_table.shape[1]
    longest = min(max_pages, int((seq_lens.max() + page - 1) // page)) if n_q else 0  # every page: only those held
    lists = torch.arange(longest, device=dev).expand(n_q, 1, -1) if page_list is None else \
        page_list.to(dev, torch.long).view(n_q, -1, page_list.shape[-1])  # [B, 1 or N_kv, K]
    n_lists, width = lists.shape[1:]
    if page_list is not None and width:  # entries after the last that any list holds read nothing (-inf, -1 there)
        held = torch.where((lists >= 0).flatten(0, 1).any(0), torch.arange(width, device=dev), -1)  # [K]
        lists = lists[..., :int(held.max()) + 1 or 1]  # [B, h, K' <= K]: a static-width list's padding
    n_listed = lists.shape[-1]
    lens = seq_lens.to(dev, torch.long)[:, None, None, None]  # [B, 1, 1, 1]
    lo = (lens - 1 - window_left).clamp(min=0) if window_left >= 0 else torch.zeros_like(lens)
    entry = 1 if keys else page  # keys per listed entry
    if keys:  # each entry one key, read from its page
        tok = lists[..., None]  # [B, h, K, 1] key position
        pg = torch.where(lists >= 0, lists // page, -1)  # [B, h, K]
    else:
        pg = lists
        tok = pg[..., None] * page + torch.arange(page, device=dev)  # [B, h, K, P] key position
    ok = (tok >= lo) & (tok < lens)  # a -1 entry has negative positions
    if spans is not None:  # a token budget: sinks of the sink pages, the window's tokens of its pages
        sinks, win = (x.to(dev, torch.long)[:, None, None, None] for x in spans.unbind(1))
        ok &= (tok < sinks) | (tok >= win) | ((pg[..., None] >= -(-sinks // page)) & (pg[..., None] < win // page))
    loc = block_table.to(dev, torch.long).gather(1, pg.clamp(0, max_pages - 1).flatten(1)).view(pg.shape)
    if keys:  # a key of a page dropped for good is never read
        ok &= (loc != DROPPED)[..., None]
    need = ok.any(-1)  # [B, h, K] entries whose page is read
    pages = torch.zeros(*lists.shape, 2, page, n_kv, dim, dtype=torch.float32, device=dev)  # [B, h, K, 2, P, N_kv, D]
    staged = -STAGED
    for pool, sel, slot in ((dev_pool, need & (loc >= 0), loc), (host_pool, need & at_host(loc), -loc - 1),
                            (stage_pool, need & (loc <= staged), -loc + staged)):
        if pool is not None and bool(sel.any()):
            pages[sel] = as_f32(pool[slot[sel].to(pool.device)]).to(dev)
    if land_slots is not None:
        _land(lists, loc, ok, lens, page, width, dev_pool, host_pool, land_slots, land_index)
    if keys:  # each entry's key of its page
        pages = pages.gather(4, (tok % page).clamp(min=0)[..., None, :, None, None].expand(
            *lists.shape, 2, 1, n_kv, dim))  # [B, h, K, 2, 1, N_kv, D]
    k = pages[:, :, :, 0].reshape(n_q, n_lists, n_listed * entry, n_kv, dim)  # [B, h, S, N_kv, D]
    v = pages[:, :, :, 1].reshape(n_q, n_lists, n_listed * entry, n_kv, dim)
    ok = ok.view(n_q, n_lists, -1)  # [B, h, S]
    group = heads // n_kv
    qg = q.float().view(n_q, n_kv, group, dim)  # [B, N_kv, G, D]; head h = kv h // G
    heads_kv = torch.arange(n_kv, device=dev)
    lists_of = heads_kv if n_lists > 1 else torch.zeros_like(heads_kv)  # each kv head's list
    k, v = (x.transpose(2, 3)[:, lists_of, heads_kv] for x in (k, v))  # [B, N_kv, S, D]
    seen = ok[:, lists_of]  # [B, N_kv, S]
    logits = torch.einsum("bngd,bnsd->bngs", qg, k) * sm_scale  # [B, N_kv, G, S]
    logits = logits.masked_fill(~seen[:, :, None], float("-inf"))
    out, lse = _softmax_rows(logits, v.masked_fill(~seen[..., None], 0.0))  # stale rows never count
    per_page = logits.view(n_q, n_kv, group, n_listed, entry)
    for stat, value in ((page_max, lambda: per_page.amax(-1)), (page_lse, lambda: torch.logsumexp(per_page, -1))):
        if stat is not None:  # [B, K, H]; entries past the longest row's pages see nothing
            stat.fill_(float("-inf"))
            stat[:, :n_listed].copy_(value().reshape(n_q, heads, n_listed).transpose(1, 2))
    return out.reshape(n_q, heads, dim).to(q.dtype), lse.reshape(n_q, heads)


def _land(lists: torch.Tensor, loc: torch.Tensor, ok: torch.Tensor, lens: torch.Tensor, page: int, width: int,
          dev_pool: torch.Tensor, host_pool: torch.Tensor, land_slots: torch.Tensor, land_index: torch.Tensor) -> None:
    """The landing of :func:`static_decode_reference`: the row's r-th listed page ``lists [B, 1, K]`` at home on the
    host (``loc``), read whole (``ok [B, 1, K, P]``), is copied into its landing slot r; ``land_index [B, width]``
    says which (-1 none)."""
    dev, n_listed = lists.device, lists.shape[-1]
    live = (lists >= 0) & (lists < -(-lens[..., 0] // page))  # [B, 1, K]
    from_host = live & at_host(loc)
    rank = from_host.cumsum(-1) - from_host.long()  # [B, 1, K]
    lands = from_host & ok.all(-1) & (rank < land_slots.shape[1])
    land_index[:, :n_listed].copy_(torch.where(lands, rank, -1)[:, 0])
    land_index[:, n_listed:width].fill_(-1)
    to = land_slots.to(dev, torch.long).gather(1, rank[:, 0].clamp(max=land_slots.shape[1] - 1))[lands[:, 0]]
    dev_pool[to.to(dev_pool.device)] = host_pool[(-loc - 1)[lands].to(host_pool.device)].to(dev_pool.device)


def _softmax_rows(logits: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax of ``logits [..., S]`` (-inf: masked) times ``v [..., S, D]`` broadcast over the rows before S:
    ``(out [..., D], lse [...])``; a row with no key gives 0 and -inf."""
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return torch.einsum("...gs,...sd->...gd", probs, v), lse


def page_choice_reference(q: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor, pids: torch.Tensor,
                          cand: torch.Tensor, k: int, count: torch.Tensor | None = None,
                          kv_head: int | None = None) -> torch.Tensor:
    """The contract of :func:`kvtier.kernels.triton_page_choice.page_choice` in torch (the ``topk`` scope's path
    on the torch backend): Quest's bound of the pages ``pids [B, M]`` for ``q [B, (r,) H, D]``, max over the
    query heads (of ``kv_head``'s group), and the best ``k`` (at most ``count [B]``) candidates ``cand [B, M]``
    with a pid: ``[B, k]`` in page order, -1 none (:func:`kvtier.scopes.base.best_of`)."""
    from kvtier.stats import over_heads, page_bounds  # imported here: both packages import this module
    from kvtier.scopes.base import best_of

    q4 = q if q.dim() == 4 else q[:, None]  # [B, r, H, D]
    score = over_heads(page_bounds(q4, key_min, key_max, pids), key_min.shape[1], kv_head)  # [B, M]
    return best_of(score, cand.bool() & (pids >= 0), k, count)


def key_bins_reference(q: torch.Tensor, query_map: torch.Tensor, sketch: torch.Tensor, pids: torch.Tensor,
                       table: torch.Tensor, lens: torch.Tensor, spans: torch.Tensor, window: int = 0,
                       scale: float | None = None) -> torch.Tensor:
    """Each candidate key's score bin ``[B, N_kv, M P]`` in ``[0, SCORE_BINS)`` (-1: not a candidate) as
    :func:`key_choice_reference` ranks them. The score: ``max_g (s_g - lse_g)`` over the kv head's query heads, the
    approximate logits ``s_g`` from the sketch and ``lse_g`` their log-sum-exp over the shown keys (0 where a head is
    shown none), cut into :data:`~kvtier.kernels.base.SCORE_BINS` bins over ``SCORE_RANGE``. fp32, products summed
    elementwise (no reduced-precision matmul)."""
    B, H, D = q.shape
    n_kv, _, r = query_map.shape
    P, M = sketch.shape[1], pids.shape[1]
    t = torch.arange(M * P, device=q.device)  # [S] key positions
    n_keys = lens.long()[:, None]  # [B, 1]
    lo = (n_keys - window).clamp(min=0) if window else torch.zeros_like(n_keys)
    pid = pids.long()[:, t // P]  # [B, S]
    vis = (t >= lo) & (t < n_keys) & (pid >= 0) & (table[:, t // P] != DROPPED)
    qr = (q.float().view(B, n_kv, H // n_kv, D, 1) * query_map.float()[None, :, None]).sum(-2)  # [B, N_kv, G, r]
    qr = qr * (D ** -0.5 if scale is None else scale)
    y = sketch[pid.clamp(min=0), t % P].float().permute(0, 2, 1, 3)  # [B, N_kv, S, r]
    s = (qr[:, :, :, None] * y[:, :, None]).sum(-1).masked_fill(~vis[:, None, None], float("-inf"))  # [B, N_kv, G, S]
    sinks, win = (x[:, None] for x in spans.long().unbind(1))  # [B, 1]
    c_lo = torch.maximum(lo, sinks)
    c_hi = torch.where(win == 0, c_lo, torch.maximum(win, c_lo))
    middle = (t >= c_lo) & (t < c_hi)  # [B, S] the candidates: what the shown spans leave out
    lse = torch.logsumexp(s.masked_fill(middle[:, None, None], float("-inf")), -1, keepdim=True)  # [B, N_kv, G, 1]
    score = (s - torch.where(lse == float("-inf"), 0.0, lse)).amax(2)  # [B, N_kv, S]
    low, high = SCORE_RANGE
    bins = ((score.clamp(low, high) - low) * (SCORE_BINS / (high - low))).to(torch.int32).clamp(max=SCORE_BINS - 1)
    return torch.where(middle[:, None] & (score > float("-inf")), bins, -1)


def key_choice_reference(q: torch.Tensor, query_map: torch.Tensor, sketch: torch.Tensor, pids: torch.Tensor,
                         table: torch.Tensor, lens: torch.Tensor, spans: torch.Tensor, n: int, out: torch.Tensor,
                         window: int = 0, scale: float | None = None) -> torch.Tensor:
    """The contract of :func:`kvtier.kernels.triton_key_choice.key_choice` in torch (the ``topk`` scope's key choice
    on the torch backend): each kv head's shown keys and ``n`` best others ``out [B, N_kv, W]`` in position order,
    then -1; the best by their bins (:func:`key_bins_reference`), equal bins the lower position first
    (:func:`kvtier.scopes.base.best_of`)."""
    from kvtier.scopes.base import best_of  # imported here: the scopes import this module

    B, n_kv, dev, W = q.shape[0], query_map.shape[0], q.device, out.shape[-1]
    image = key_bins_reference(q, query_map, sketch, pids, table, lens, spans, window, scale)  # [B, N_kv, S]
    chosen = best_of(image.double(), image >= 0, n) if n else torch.zeros(B, n_kv, 0, dtype=torch.int32, device=dev)
    kk = (chosen >= 0).sum(-1, keepdim=True)  # [B, N_kv, 1]
    n_keys = lens.long()[:, None]  # [B, 1]
    lo = (n_keys - window).clamp(min=0) if window else torch.zeros_like(n_keys)
    sinks, win = (x[:, None] for x in spans.long().unbind(1))  # [B, 1]
    whole = win == 0
    n_sink = torch.where(whole, n_keys - lo, (torch.minimum(sinks, n_keys) - lo).clamp(min=0))[:, None]  # [B, 1, 1]
    w_lo = torch.maximum(win, lo)[:, None]
    n_win = torch.where(whole, 0, n_keys - torch.maximum(win, lo))[:, None]
    j = torch.arange(W, device=dev)  # [W]
    mid = chosen.long().gather(-1, (j - n_sink).clamp(0, max(n - 1, 0)).expand(B, n_kv, W)) if n else \
        torch.full((B, n_kv, W), -1, device=dev)
    listed = torch.where(j < n_sink, lo[:, None] + j, torch.where(j < n_sink + kk, mid, w_lo + j - n_sink - kk))
    return out.copy_(torch.where(j < n_sink + kk + n_win, listed, -1))
