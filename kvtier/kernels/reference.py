"""Torch reference backend: the oracle for every kernel, and the CPU path of the model runs."""

from __future__ import annotations

import torch

from kvtier.kernels.base import AttentionBackend, AttentionOutput, PagedBatch
from kvtier.quant import dequantize, is_scaled_pool


def paged_attention_reference(q: torch.Tensor, kv_pool: torch.Tensor, batch: PagedBatch, sm_scale: float,
                              return_page_max: bool = False) -> AttentionOutput:
    """Paged GQA attention in fp32, one sequence at a time.

    q ``[Nq, H, D]``, kv_pool ``[slots, 2, P, N_kv, D]`` (FP8: ``[slots, 2, P + 1, N_kv, D]`` with scales,
    dequantized here); see :mod:`kvtier.kernels.base` for the batch convention. Returns out ``[Nq, H, D]`` (q's dtype), lse ``[Nq, H]``, page_max ``[nnz, H]``.
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
    qo = batch.qo_indptr_host().tolist()
    kvp = batch.kv_indptr_host().tolist()
    kv_lens = batch.kv_lens().tolist()
    for b in range(batch.batch_size):
        q0, q1, p0, p1 = qo[b], qo[b + 1], kvp[b], kvp[b + 1]
        if q1 == q0 or p1 == p0:
            continue
        s_len = kv_lens[b]
        pages = kv_pool.index_select(0, batch.kv_indices[p0:p1].long())  # [n, 2, P(+1), N_kv, D]
        if scaled:
            pages = dequantize(pages)  # [n, 2, P, N_kv, D] fp32
        k = pages[:, 0].reshape(-1, n_kv, dim)[:s_len].float()  # [S, N_kv, D]
        v = pages[:, 1].reshape(-1, n_kv, dim)[:s_len].float()
        qb = q[q0:q1].float().view(q1 - q0, n_kv, group, dim)  # [n, N_kv, G, D]; head h = kv h // G
        logits = torch.einsum("nkgd,skd->kgns", qb, k).reshape(heads, q1 - q0, s_len) * sm_scale  # [H, n, S]
        if batch.causal or batch.window_left >= 0:
            key = torch.arange(s_len, device=q.device)[None, :]  # [1, S]
            pos = (s_len - (q1 - q0) + torch.arange(q1 - q0, device=q.device))[:, None]  # [n, 1] bottom-right
            allowed = key <= pos if batch.causal else torch.ones_like(key, dtype=torch.bool)  # [n or 1, S]
            if batch.window_left >= 0:
                allowed = allowed & (key >= pos - batch.window_left)  # [n, S]
            logits = logits.masked_fill(~allowed, float("-inf"))
        if batch.head_mask is not None:  # kv head h sees only its pages
            seen = batch.head_mask[p0:p1].repeat_interleave(page, dim=0)[:s_len]  # [S, N_kv]
            logits = logits.view(n_kv, group, q1 - q0, s_len).masked_fill(
                ~seen.T[:, None, None, :], float("-inf")).view(heads, q1 - q0, s_len)
        row_lse = torch.logsumexp(logits, dim=-1)  # [H, n]
        safe = torch.where(torch.isfinite(row_lse), row_lse, torch.zeros_like(row_lse))
        probs = torch.exp(logits - safe[..., None])  # [H, n, S]
        out[q0:q1] = torch.einsum("kgns,skd->nkgd", probs.view(n_kv, group, q1 - q0, s_len), v).reshape(
            q1 - q0, heads, dim)
        lse[q0:q1] = row_lse.transpose(0, 1)
        if return_page_max:
            n_pages = p1 - p0
            padded = torch.full((heads, q1 - q0, n_pages * page), float("-inf"), device=q.device)
            padded[..., :s_len] = logits
            page_max[p0:p1] = padded.view(heads, q1 - q0, n_pages, page).amax(dim=(1, 3)).transpose(0, 1)
    return AttentionOutput(out.to(q.dtype), lse, page_max)


class TorchBackend(AttentionBackend):
    """Reference backend (CPU and GPU)."""

    name = "torch"
    supports_head_mask = True

    def run(self, q, kv_pool, return_page_max=False):
        return paged_attention_reference(q, kv_pool, self.batch, self.sm_scale, return_page_max)
