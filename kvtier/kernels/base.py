"""Kernel backend interface: ``plan()`` once per step, ``run()`` per layer (FlashInfer's split).

Pages are FlashInfer NHD: a pool ``[slots, 2, page_size, N_kv, D]``. A batch of B sequences is
described by ``kv_indptr [B+1] / kv_indices [nnz] / kv_last_page_len [B]`` (int32) and query rows
by ``qo_indptr [B+1]``. Sequence b's keys are the listed pages in order; all are full except the
last, which holds ``kv_last_page_len[b]`` tokens. With ``causal`` the mask is bottom-right
aligned: query i of n_b attends key j iff ``j <= kv_len_b - n_b + i``.

Every backend returns the output, its log-sum-exp in natural log, and optionally per
(listed page, query head) the max scaled logit over the page's unmasked tokens and the
sequence's queries (``page_max``), from which :func:`page_salience` derives the max attention
probability without materialising the attention matrix.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kvtier.errors import ConfigError


@dataclass
class PagedBatch:
    """The page lists of one attention call (all int32 on the pool's device)."""

    qo_indptr: torch.Tensor  # [B+1]
    kv_indptr: torch.Tensor  # [B+1]
    kv_indices: torch.Tensor  # [nnz]
    kv_last_page_len: torch.Tensor  # [B]
    page_size: int
    causal: bool = False

    @property
    def batch_size(self) -> int:
        return self.kv_last_page_len.numel()

    def kv_lens(self) -> torch.Tensor:
        """Tokens per sequence ``[B]`` (0 for a sequence with no pages)."""
        npages = (self.kv_indptr[1:] - self.kv_indptr[:-1]).long()
        return torch.where(npages > 0, (npages - 1) * self.page_size + self.kv_last_page_len.long(), 0)

    def page_seq(self) -> torch.Tensor:
        """Owning sequence of each listed page ``[nnz]`` (int64)."""
        npages = (self.kv_indptr[1:] - self.kv_indptr[:-1]).long()
        return torch.repeat_interleave(torch.arange(npages.numel(), device=npages.device), npages)

    def to(self, device) -> "PagedBatch":
        return PagedBatch(self.qo_indptr.to(device), self.kv_indptr.to(device), self.kv_indices.to(device),
                          self.kv_last_page_len.to(device), self.page_size, self.causal)


@dataclass
class AttentionOutput:
    out: torch.Tensor  # [Nq, H, D] in q's dtype
    lse: torch.Tensor  # [Nq, H] float32, natural log; -inf for a row that attended nothing
    page_max: torch.Tensor | None = None  # [nnz, H] float32 max scaled logit, or None


class AttentionBackend(ABC):
    """A paged attention implementation. ``plan`` fixes the page lists; ``run`` is per layer."""

    name: str = "base"
    supports_salience: bool = True

    def plan(self, batch: PagedBatch, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             sm_scale: float | None = None) -> None:
        if num_qo_heads % num_kv_heads:
            raise ConfigError("model.num_attention_heads",
                              f"{num_qo_heads} query heads do not divide into {num_kv_heads} kv heads")
        self.batch = batch
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.sm_scale = head_dim ** -0.5 if sm_scale is None else sm_scale

    @abstractmethod
    def run(self, q: torch.Tensor, kv_pool: torch.Tensor, return_page_max: bool = False) -> AttentionOutput:
        """q ``[Nq, H, D]``, kv_pool ``[slots, 2, P, N_kv, D]``."""


def page_salience(page_max: torch.Tensor, lse: torch.Tensor, batch: PagedBatch, num_kv_heads: int) -> torch.Tensor:
    """Max attention probability per (listed page, kv head) ``[nnz, N_kv]`` for one query per sequence.

    ``page_max [nnz, H]`` and the final ``lse [B, H]`` (after any merge): prob = exp(page_max - lse)
    of the query row of the page's sequence, max over the query heads of each kv group.
    """
    if not torch.equal(batch.qo_indptr[1:] - batch.qo_indptr[:-1], torch.ones_like(batch.qo_indptr[1:])):
        raise ValueError("page_salience needs exactly one query row per sequence (a decode step)")
    rows = batch.page_seq()  # [nnz]
    prob = torch.exp(page_max - lse.float()[rows])  # [nnz, H]
    nnz, heads = prob.shape
    return prob.view(nnz, num_kv_heads, heads // num_kv_heads).amax(-1)  # [nnz, N_kv]
