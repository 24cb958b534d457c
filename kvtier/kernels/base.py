"""Kernel backend interface: ``plan()`` once per step, ``run()`` per layer (FlashInfer's split).

Pages are FlashInfer NHD: a pool ``[slots, 2, page_size, N_kv, D]``. A batch of B sequences is
described by ``kv_indptr [B+1] / kv_indices [nnz] / kv_last_page_len [B]`` (int32) and query rows
by ``qo_indptr [B+1]``. Sequence b's keys are the listed pages in order; all are full except the
last, which holds ``kv_last_page_len[b]`` tokens. With ``causal`` the mask is bottom-right
aligned: query i of n_b attends key j iff ``j <= kv_len_b - n_b + i``. With ``window_left >= 0``
(FlashInfer's ``window_left``; HF's ``sliding_window`` W is ``window_left = W - 1``) it also needs
``j >= kv_len_b - n_b + i - window_left``, causal or not: positions are the keys' order in the
batch, so the cache lists a windowed layer's pages contiguously up to the newest. With ``head_mask``
``[nnz, N_kv]`` (Quest-style per-head page choice over the union of the heads' pages) kv head h,
and its group of query heads, sees listed page p only where ``head_mask[p, h]``.

Every backend returns the output, its log-sum-exp in natural log, and optionally per (listed page, query head) the
max scaled logit over the page's unmasked tokens (``page_max``: :func:`page_salience`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace

import numpy as np
import torch

from kvtier.errors import ConfigError

DROPPED = -(2 ** 31)  # block-table value of a page freed for good (left of a window, compressed away)
# The key choice ranks a key by its score (log share beside the shown keys) cut into SCORE_BINS equal bins over
# SCORE_RANGE (nats; clamped): keys in one bin are equal choices, the lower position first.
SCORE_BINS, SCORE_RANGE = 256, (-20.0, 0.0)
STAGED = 1 << 30  # block-table values <= -STAGED: slot -x - STAGED of the pinned staging pool (disk and remote pages)


def at_host(loc: torch.Tensor) -> torch.Tensor:
    """Block-table values ``loc`` that are host-pool slots (``-s - 1``): not device slots, not staged."""
    return (loc < 0) & (loc > -STAGED)


@dataclass
class PagedBatch:
    """The page lists of one attention call (all int32 on the pool's device)."""

    qo_indptr: torch.Tensor  # [B+1]
    kv_indptr: torch.Tensor  # [B+1]
    kv_indices: torch.Tensor  # [nnz]
    kv_last_page_len: torch.Tensor  # [B]
    page_size: int
    causal: bool = False
    host_qo_indptr: np.ndarray | None = None  # [B+1] int64 copy on the host (from_host), or None
    host_kv_indptr: np.ndarray | None = None  # [B+1]
    window_left: int = -1  # keys left of each query's position it may see; -1: no window
    head_mask: torch.Tensor | None = None  # [nnz, N_kv] bool: kv head h sees listed page p; None: all do
    host_kv_last_page_len: np.ndarray | None = None  # [B] int64 copy on the host (from_host), or None

    @classmethod
    def from_host(cls, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size: int, causal: bool,
                  device, window_left: int = -1, head_mask: np.ndarray | None = None) -> "PagedBatch":
        """A batch on ``device`` from host int arrays, in one copy, keeping the indptrs and last lengths on the host;
        ``head_mask [nnz, N_kv]`` bool or None."""
        qo, kv = np.asarray(qo_indptr, np.int64), np.asarray(kv_indptr, np.int64)
        arrays = [qo, kv, kv_indices, kv_last_page_len] + ([] if head_mask is None else [head_mask])
        d_qo, d_kv, d_idx, d_last, *mask = to_device(arrays, device)
        mask = mask[0].view(-1, head_mask.shape[1]) != 0 if mask else None
        return cls(d_qo, d_kv, d_idx, d_last, page_size, causal, qo, kv, window_left, mask,
                   np.asarray(kv_last_page_len, np.int64))

    @property
    def batch_size(self) -> int:
        return self.kv_last_page_len.numel()

    def host(self, name: str) -> np.ndarray:
        """``qo_indptr``, ``kv_indptr`` or ``kv_last_page_len`` on the host (int64; a device-to-host sync unless built
        by from_host)."""
        kept = getattr(self, "host_" + name)
        return kept if kept is not None else getattr(self, name).cpu().long().numpy()

    def is_decode(self) -> bool:
        """One query row per sequence."""
        return bool((np.diff(self.host("qo_indptr")) == 1).all())

    def kv_lens(self) -> torch.Tensor:
        """Tokens per sequence ``[B]`` (0 for a sequence with no pages)."""
        npages = (self.kv_indptr[1:] - self.kv_indptr[:-1]).long()
        return torch.where(npages > 0, (npages - 1) * self.page_size + self.kv_last_page_len.long(), 0)

    def to(self, device) -> "PagedBatch":
        moved = {f: getattr(self, f).to(device) for f in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len")}
        return replace(self, **moved, head_mask=None if self.head_mask is None else self.head_mask.to(device))


@dataclass
class AttentionOutput:
    out: torch.Tensor  # [Nq, H, D] in q's dtype
    lse: torch.Tensor  # [Nq, H] float32, natural log; -inf for a row that attended nothing
    page_max: torch.Tensor | None = None  # [nnz, H] float32 max scaled logit, or None


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do in the engine's step, declared by the backend and checked against the scope, policy,
    tiers and budget when the engine is built (:func:`kvtier.checks.check_kernel`: a named error, never a wrong
    answer later)."""

    decode: bool = True  # has the engine's decode step (:meth:`AttentionBackend.decode`)
    far_pages: bool = True  # reads pages where they live (pinned host, staged); else every attended page in HBM
    page_stats: bool = True  # per-page max logit and LSE: salience, attention mass
    query_picks: bool = True  # a list chosen per layer from the query (topk); else lists planned at the step's start
    key_lists: bool = True  # attends single keys (KeyList) in place of pages
    spans: bool = True  # shows part of a listed page (a token budget's sinks and window); else whole pages only
    head_lists: bool = True  # a page list per kv head (PagedBatch.head_mask, [B, N_kv, K] page lists)
    window_by_position: bool = True  # masks a sliding window by key positions; else by list order (contiguous lists)
    scaled_pages: bool = True  # reads 8-bit pages (their scale rows)
    host_plan: bool = False  # plans each decode call from its page counts on the host (a ``plan_decode`` method)
    captures: bool = True  # its decode step can be captured in a CUDA graph (reads its lengths on the device)


class AttentionBackend(ABC):
    """A paged attention implementation. ``plan`` fixes the page lists; ``run`` is per layer; ``can`` says what it
    does in the engine's step."""

    name: str = "base"
    can: Capabilities = Capabilities(decode=False)

    def plan(self, batch: PagedBatch, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             sm_scale: float | None = None) -> None:
        if num_qo_heads % num_kv_heads:
            raise ConfigError("model.num_attention_heads",
                              f"{num_qo_heads} query heads do not divide into {num_kv_heads} kv heads")
        if batch.head_mask is not None and not self.can.head_lists:
            raise ConfigError("kernel", f"backend '{self.name}' does not take a per-head page choice "
                                        "(head_mask); use kernel=torch or kernel=triton")
        self.batch = batch
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.sm_scale = head_dim ** -0.5 if sm_scale is None else sm_scale

    @abstractmethod
    def run(self, q: torch.Tensor, kv_pool: torch.Tensor, return_page_max: bool = False) -> AttentionOutput:
        """q ``[Nq, H, D]``, kv_pool ``[slots, 2, P, N_kv, D]``."""

    def decode(self, *args, **kwargs):
        """The engine's decode step over the block table (:func:`kvtier.kernels.triton_decode.static_decode`'s
        contract); backends without one (``can.decode`` false) are refused when the engine is built."""
        raise NotImplementedError


def page_salience(page_max: torch.Tensor, lse: torch.Tensor, batch: PagedBatch, num_kv_heads: int) -> torch.Tensor:
    """Max attention probability per (listed page, kv head) ``[nnz, N_kv]`` for one query per sequence.

    ``page_max [nnz, H]`` and the final ``lse [B, H]`` (after any merge): prob = exp(page_max - lse)
    of the query row of the page's sequence, max over the query heads of each kv group.
    """
    if not batch.is_decode():
        raise ValueError("page_salience needs exactly one query row per sequence (a decode step)")
    npages = (batch.kv_indptr[1:] - batch.kv_indptr[:-1]).long()  # [B]
    rows = torch.repeat_interleave(torch.arange(npages.numel(), device=npages.device), npages)  # [nnz] its sequence
    prob = torch.exp(page_max - lse.float()[rows])  # [nnz, H]
    nnz, heads = prob.shape
    return prob.view(nnz, num_kv_heads, heads // num_kv_heads).amax(-1)  # [nnz, N_kv]


def check_key_list(key_list: torch.Tensor | None, page_list: torch.Tensor | None, entry_tokens: int,
                   page_size: int, int8: bool, spans: torch.Tensor | None, landing: bool) -> tuple:
    """A decode call attends a key list (int32 positions) in place of a page list, with a plan made for key lists
    (``entry_tokens`` 1), on 16/32-bit or FP8 pages, without spans (the list shows every key it attends) and without
    landing slots (it reads single keys, never a whole page). ``(whether it does, the list it attends)``."""
    if key_list is None:
        if entry_tokens not in (0, page_size):
            raise ValueError("the plan was made for key lists (keys=True): pass key_list")
        return False, page_list
    if page_list is not None or key_list.dtype != torch.int32 or key_list.dim() not in (2, 3):
        raise ValueError(f"key_list takes the place of page_list: int32 [B, (N_kv,) K], got {key_list.dtype} "
                         f"{tuple(key_list.shape)}" + (" beside a page_list" if page_list is not None else ""))
    if entry_tokens != 1:
        raise ValueError("a key list needs a plan made for key lists: plan_static_decode(..., keys=True)")
    if int8:
        raise ValueError("int8 pages are read back a page at a time: attend them by pages, not a key list")
    if spans is not None:
        raise ValueError("a key list shows every key it attends: pass no spans with it")
    if landing:
        raise ValueError("the decode lands whole pages read from the host: a key list reads single keys")
    return True, key_list


def check_landing(land_slots: torch.Tensor | None, land_index: torch.Tensor | None, page_list: torch.Tensor | None,
                  host_pool: torch.Tensor | None, scaled: bool, n_q: int) -> None:
    """The decode's landing arguments (:func:`~kvtier.kernels.triton_decode.static_decode`): both or neither,
    with what they need."""
    if land_slots is None and land_index is None:
        return
    if land_slots is None or land_index is None:
        raise ValueError("landing needs land_slots and land_index together")
    if page_list is None or page_list.dim() != 2 or host_pool is None or scaled:
        raise ValueError("landing needs a per-sequence page_list [B, K], a host pool and 16/32-bit pages")
    n_listed = page_list.shape[-1]
    if land_slots.shape[0] != n_q or land_index.shape[0] != n_q or land_index.shape[1] < n_listed or \
            land_index.dtype != torch.int32 or land_slots.stride(1) != 1 or land_index.stride(1) != 1:
        raise ValueError(f"landing needs land_slots [{n_q}, cap] and int32 land_index [{n_q}, >= {n_listed}] with "
                         f"unit last strides, got {tuple(land_slots.shape)} and {tuple(land_index.shape)} "
                         f"{land_index.dtype}")


def to_device(arrays: list, device, dtype: torch.dtype = torch.int32) -> list[torch.Tensor]:
    """Host int arrays (numpy or CPU tensors) as ``dtype`` tensors on ``device``.

    On CUDA: one non-blocking copy from pageable memory. CUDA stages pageable memory before the
    call returns, so the host buffer may go at once, and the stream is not synchronised (a blocking
    copy would make the host wait for every queued kernel; pinning a fresh buffer per call costs
    more host time than it saves). On the CPU: views of one tensor.
    """
    device = torch.device(device)
    flat = [np.asarray(a).reshape(-1) for a in arrays]
    host = torch.from_numpy(np.concatenate(flat).astype(np.dtype(str(dtype).removeprefix("torch."))))
    if device.type == "cuda":
        host = host.to(device, non_blocking=True)
    return list(torch.split(host, [a.size for a in flat]))
