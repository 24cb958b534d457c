"""FlashInfer backend: ``BatchDecodeWithPagedKVCacheWrapper`` / ``BatchPrefillWithPagedKVCacheWrapper``.

The pool is already FlashInfer's NHD layout, so the wrappers read it without a copy. One
workspace buffer serves both wrappers for the backend's lifetime. ``plan`` records the page lists;
the wrapper's own plan needs the q/kv dtypes, which only ``run`` sees, so it runs on the first
``run`` after each ``plan`` (and again only if the dtypes change). FlashInfer returns the LSE in
base 2; this backend returns it in natural log. No per-page salience: FlashInfer exposes no
per-page max logit.
"""

from __future__ import annotations

import math

import torch

from kvtier.errors import ConfigError, MissingDependencyError
from kvtier.kernels.base import AttentionBackend, AttentionOutput, PagedBatch
from kvtier.quant import is_scaled_pool

LN2 = math.log(2.0)


class FlashInferBackend(AttentionBackend):
    """Paged attention through FlashInfer's wrappers (decode for one query row per sequence)."""

    name = "flashinfer"
    supports_salience = False

    def __init__(self, workspace_bytes: int = 256 << 20, device: str | torch.device = "cuda"):
        try:
            import flashinfer
        except ImportError as err:
            raise MissingDependencyError("flashinfer-python", "gpu", "kernel=flashinfer") from err
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.planned_dtypes = None

    def plan(self, batch: PagedBatch, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             sm_scale: float | None = None) -> None:
        super().plan(batch, num_qo_heads, num_kv_heads, head_dim, sm_scale)
        self.is_decode = batch.is_decode()
        self.planned_dtypes = None

    def plan_wrapper(self, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
        """The wrapper's plan for this step's page lists and these dtypes (host work, once per step)."""
        b = self.batch
        common = dict(q_data_type=q_dtype, kv_data_type=kv_dtype, sm_scale=self.sm_scale, window_left=b.window_left)
        if self.is_decode:
            self.decode_wrapper.plan(b.kv_indptr, b.kv_indices, b.kv_last_page_len, self.num_qo_heads,
                                     self.num_kv_heads, self.head_dim, b.page_size, **common)
        else:
            self.prefill_wrapper.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_last_page_len, self.num_qo_heads,
                                      self.num_kv_heads, self.head_dim, b.page_size, causal=b.causal, **common)
        self.planned_dtypes = (q_dtype, kv_dtype)

    def run(self, q: torch.Tensor, kv_pool: torch.Tensor, return_page_max: bool = False) -> AttentionOutput:
        """q ``[Nq, H, D]``, kv_pool ``[slots, 2, P, N_kv, D]``; out ``[Nq, H, D]``, lse ``[Nq, H]`` natural log."""
        if return_page_max:
            raise ConfigError("kernel", "page salience needs kernel=triton or kernel=torch; "
                                        "FlashInfer returns no per-page max logit")
        if is_scaled_pool(kv_pool, self.batch.page_size):
            raise ConfigError("kernel", "kernel=flashinfer cannot read kvtier's 8-bit pages: FlashInfer's FP8 path "
                                        "takes one k_scale/v_scale per call, these pages carry theirs per page (int8 "
                                        "pages per channel too); use kernel=triton (or kernel=torch)")
        if self.planned_dtypes != (q.dtype, kv_pool.dtype):
            self.plan_wrapper(q.dtype, kv_pool.dtype)
        wrapper = self.decode_wrapper if self.is_decode else self.prefill_wrapper
        out, lse2 = wrapper.run(q, kv_pool, return_lse=True)  # lse2 [Nq, H] base 2
        return AttentionOutput(out, lse2.float() * LN2)
