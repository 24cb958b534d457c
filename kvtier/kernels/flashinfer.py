"""FlashInfer backend: ``BatchDecodeWithPagedKVCacheWrapper`` / ``BatchPrefillWithPagedKVCacheWrapper``, in single
calls and in the engine's step.

The pool is already FlashInfer's NHD layout; one float workspace serves every wrapper. A wrapper's ``plan`` is host
work over a call's page counts (``indptr``, ``last_page_len``), and its kernels read the page indices when they
``run``: one plan serves every call with the same counts (an iteration's prefill calls of every layer; a decode step's
layers whose lists hold as many pages per row, every layer under ``scope=all``). The engine's decode step plans from
the counts of the step's lists, computed on the host (:meth:`FlashInferBackend.plan_decode`), and each layer writes
its indices from the block table and its list on the device (:func:`paged_indices`) before ``run``. FlashInfer's plan
copies its schedule from one pinned buffer per wrapper without waiting: a few wrappers (:class:`Plans`) keep the
plans of a step's distinct counts, each planned again only once its last plan's copy has run (an event).

Decode runs with ``use_tensor_cores=True``, FlashInfer's faster setting in every cell of ``bench/kernels.py``'s decode
grid, GQA included. The LSE comes back in natural log (FlashInfer's is base 2). What it cannot do: ``can``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.errors import ConfigError, MissingDependencyError
from kvtier.kernels.base import AttentionBackend, AttentionOutput, Capabilities
from kvtier.quant import is_scaled_pool

LN2 = math.log(2.0)


def decode_counts(counts: np.ndarray, lens: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """FlashInfer's ``kv_indptr [B+1]`` and ``kv_last_page_len [B]`` (int32, host) of a decode call whose row b lists
    ``counts[b]`` pages, the last of them its newest, of ``lens[b]`` tokens. A row that lists nothing (idle in its
    bucket) gets one page of one token, its list's first entry: FlashInfer reads it, the engine ignores the row."""
    counts = np.maximum(np.asarray(counts, np.int64), 1)
    lens = np.asarray(lens, np.int64)
    last = np.where(lens > 0, (lens - 1) % page_size + 1, 1)
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int32), last.astype(np.int32)


def paged_indices(table: torch.Tensor, page_list: torch.Tensor | None, indptr: torch.Tensor, out: torch.Tensor) -> None:
    """FlashInfer's ``kv_indices`` of one layer into ``out[:nnz]`` on the device (static shapes, no host sync): row b's
    listed pages' slots ``table [B, M][b, page_list [B, K][b, j]]`` (``page_list`` None: its pages in order; lists
    ascending, -1 after the last) at ``indptr [B+1][b] + j`` for ``j < indptr[b+1] - indptr[b]``; ``out[-1]`` takes the
    entries past each row's count. A page dropped left of a sliding window (listed under ``scope=all``, which lists
    every page) reads slot 0, which the call's ``window_left`` masks."""
    B, M = table.shape
    logical = torch.arange(M, device=table.device).expand(B, M) if page_list is None else page_list.long()  # [B, K]
    j = torch.arange(logical.shape[1], device=table.device)  # [K]
    start, count = indptr[:-1, None].long(), (indptr[1:] - indptr[:-1])[:, None].long()  # [B, 1]
    at = torch.where(j < count, start + j, out.numel() - 1)  # [B, K]
    out.scatter_(0, at.flatten(), table.gather(1, logical.clamp(min=0)).clamp(min=0).flatten())


@dataclass
class Plan:
    """A wrapper planned for one key, its page-index buffer (``indices[:nnz]`` what it reads) and its ``indptr`` on
    the device; ``planned``: the event after its plan's copies (None on the CPU)."""

    wrapper: object
    key: tuple = ()
    indices: torch.Tensor | None = None  # [>= nnz + 1] int32
    indptr: torch.Tensor | None = None  # [B+1] int32
    planned: object = None


class Plans:
    """Up to ``size`` wrappers made by ``make()``, each planned for one key (counts, window, shapes, dtypes), the
    least recently used planned anew."""

    def __init__(self, make, size: int, device):
        self.make, self.size, self.device = make, size, torch.device(device)
        self.plans: list[Plan] = []  # the most recently used last

    def get(self, key: tuple, indptr: np.ndarray, plan) -> Plan:
        """The wrapper planned for ``key``; if none is, one planned now by ``plan(wrapper, indptr, indices)`` with
        ``indptr [B+1]`` (host int32) and its index buffer's first ``indptr[-1]`` entries."""
        for i, p in enumerate(self.plans):
            if p.key == key:
                self.plans.append(self.plans.pop(i))
                return p
        if len(self.plans) < self.size:
            p = Plan(self.make())
        else:
            p = self.plans.pop(0)
            if p.planned is not None:  # its schedule's copy from the pinned buffer that plan() rewrites has run
                p.planned.synchronize()
        nnz = int(indptr[-1])
        if p.indices is None or p.indices.numel() <= nnz:
            p.indices = torch.zeros(2 * nnz + 1, dtype=torch.int32, device=self.device)
        p.indptr = torch.from_numpy(indptr).to(self.device, non_blocking=True)
        plan(p.wrapper, torch.from_numpy(indptr), p.indices[:nnz])
        p.key = key
        if self.device.type == "cuda":
            p.planned = torch.cuda.Event()
            p.planned.record()
        self.plans.append(p)
        return p


class FlashInferBackend(AttentionBackend):
    """Paged attention through FlashInfer's wrappers (decode for one query row per sequence), and the engine's decode
    step over pages in HBM. ``plans``: wrappers of each kind kept planned (distinct page counts of a step)."""

    name = "flashinfer"
    can = Capabilities(far_pages=False, page_stats=False, query_picks=False, key_lists=False, spans=False,
                       head_lists=False, window_by_position=False, scaled_pages=False, host_plan=True, captures=False)

    def __init__(self, workspace_bytes: int = 256 << 20, device: str | torch.device = "cuda", plans: int = 4):
        try:
            import flashinfer
        except ImportError as err:
            raise MissingDependencyError("flashinfer-python", "gpu", "kernel=flashinfer") from err
        self.workspace = work = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)  # shared by all
        self.use(lambda: flashinfer.BatchDecodeWithPagedKVCacheWrapper(work, "NHD", use_tensor_cores=True),
                 lambda: flashinfer.BatchPrefillWithPagedKVCacheWrapper(work, "NHD"), device, plans)

    def use(self, decode_wrapper, prefill_wrapper, device, plans: int = 4) -> None:
        """Make wrappers with ``decode_wrapper()`` / ``prefill_wrapper()``: FlashInfer's, or any object with their
        ``plan`` / ``run`` contract."""
        self.decodes = Plans(decode_wrapper, plans, device)
        self.prefills = Plans(prefill_wrapper, plans, device)

    def run(self, q: torch.Tensor, kv_pool: torch.Tensor, return_page_max: bool = False) -> AttentionOutput:
        """q ``[Nq, H, D]``, kv_pool ``[slots, 2, P, N_kv, D]``; out ``[Nq, H, D]``, lse ``[Nq, H]`` natural log."""
        if return_page_max:
            raise ConfigError("kernel", "page salience needs kernel=triton or kernel=torch; "
                                        "FlashInfer returns no per-page max logit")
        b = self.batch
        if is_scaled_pool(kv_pool, b.page_size):
            raise ConfigError("kernel", "kernel=flashinfer cannot read kvtier's 8-bit pages: FlashInfer's FP8 path "
                                        "takes one k_scale/v_scale per call, these pages carry theirs per page (int8 "
                                        "pages per channel too); use kernel=triton (or kernel=torch)")
        kv, last = b.host("kv_indptr").astype(np.int32), b.host("kv_last_page_len").astype(np.int32)
        shape = (self.num_qo_heads, self.num_kv_heads, self.head_dim, b.page_size)
        common = dict(q_data_type=q.dtype, kv_data_type=kv_pool.dtype, sm_scale=self.sm_scale,
                      window_left=b.window_left)
        if b.is_decode():
            p = self.plan_decode(np.diff(kv), None, b.window_left, shape, self.sm_scale, (q.dtype, kv_pool.dtype),
                                 last)
        else:
            qo = b.host("qo_indptr").astype(np.int32)
            key = ("prefill", qo.tobytes(), kv.tobytes(), last.tobytes(), b.causal, b.window_left, shape,
                   self.sm_scale, q.dtype, kv_pool.dtype)
            p = self.prefills.get(key, kv, lambda w, indptr, indices: w.plan(
                torch.from_numpy(qo), indptr, indices, torch.from_numpy(last), *shape, causal=b.causal, **common))
        p.indices[:b.kv_indices.numel()].copy_(b.kv_indices)
        out, lse2 = p.wrapper.run(q, kv_pool, return_lse=True)  # lse2 [Nq, H] base 2
        return AttentionOutput(out, lse2.float() * LN2)

    def plan_decode(self, counts: np.ndarray, lens: np.ndarray | None, window_left: int, shape: tuple,
                    sm_scale: float, dtypes: tuple, last: np.ndarray | None = None) -> Plan:
        """The decode wrapper planned for rows listing ``counts [B]`` pages of ``lens [B]`` tokens (or, for a single
        call, its ``last [B]`` page lengths as given), ``shape`` ``(H, N_kv, D, page_size)``, ``dtypes`` (q's, the
        pool's): the ``plan`` :meth:`decode` takes."""
        if last is None:
            indptr, last = decode_counts(counts, lens, shape[3])
        else:
            indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        key = ("decode", indptr.tobytes(), last.tobytes(), window_left, shape, sm_scale, *dtypes)
        return self.decodes.get(key, indptr, lambda w, indptr, indices: w.plan(
            indptr, indices, torch.from_numpy(last), *shape, q_data_type=dtypes[0], kv_data_type=dtypes[1],
            sm_scale=sm_scale, window_left=window_left))

    def decode(self, q: torch.Tensor, dev_pool: torch.Tensor, host_pool, table: torch.Tensor, lens: torch.Tensor,
               plan: Plan, sm_scale: float, page_list: torch.Tensor | None = None, window_left: int = -1,
               stage_pool=None, **unsupported) -> tuple[torch.Tensor, torch.Tensor]:
        """The engine's decode step of ``q [B, H, D]`` over the device pages ``table [B, M]`` lists (``page_list
        [B, K]`` or every page), with :meth:`plan_decode`'s ``plan`` for this layer's counts: ``(out [B, H, D], lse
        [B, H])`` natural log. The host and staging pools are never read (the engine lists device pages only)."""
        if any(x is not None for x in unsupported.values()) or (page_list is not None and page_list.dim() != 2):
            raise ValueError("kernel=flashinfer attends whole device pages, one list per row: no page statistics, "
                             "spans, key lists, landing slots or per-head lists (the engine checks this when built)")
        paged_indices(table, page_list, plan.indptr, plan.indices)
        out, lse2 = plan.wrapper.run(q, dev_pool, return_lse=True)
        return out, lse2.float() * LN2

