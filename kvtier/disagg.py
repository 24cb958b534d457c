"""Disaggregated prefill/decode over ``torch.distributed`` (seed 001): two processes, KV pages streamed.

The prefill worker runs a chunked prefill through a :class:`StreamingPrefillCache`: as soon as a
chunk's K/V of a layer is written into its device pages, those whole pages are sent with
``dist.isend`` (NCCL between GPUs, gloo on CPUs) while the prefill goes on with the next layer.
The decode worker (:func:`receive_prefill`) appends the prompt's pages to its own cache's device tier
and posts one ``irecv`` per (chunk, layer) straight into that tier's pool rows; decoding starts when
the last layer and the first token have arrived.

Wire order (both sides derive it from the header): header ``[prompt_len, chunk_size]`` (int64), then
for each prefill chunk ``[a, b)`` and each layer the pages ``[a // P, ceil(b / P))`` of that layer
(``[n, 2, P, N_kv, D]`` stored pages in the layout's ``kv_dtype``, FP8 scale rows included), then the first generated token (int64 ``[1]``).
Chunks other than the last must be whole pages, so no page is sent twice.

The seed-001 transfer model: one layer's KV takes ``bytes_per_layer / link_bandwidth``;
:func:`transfer_model` gives it for printing beside the measured times.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from kvtier.cache import TieredKVCache
from kvtier.errors import ConfigError
from kvtier.layout import KVLayout
from kvtier.metrics import synchronize
from kvtier.scheduler.chunked_prefill import ChunkedPrefill


def transfer_model(layout: KVLayout, tokens: int, link_gbps: float) -> dict:
    """Seed 001: bytes and seconds of one layer's KV (and of all layers) over a link of ``link_gbps`` GB/s."""
    layer_bytes = layout.pages_for(tokens) * layout.page_bytes
    return {"layer_bytes": layer_bytes, "layer_s": layer_bytes / (link_gbps * 1e9),
            "all_layers_s": layout.num_layers * layer_bytes / (link_gbps * 1e9)}


def _check_streamable(cache: TieredKVCache, chunk_size: int | None = None) -> None:
    if cache.sequences != 1:
        raise ConfigError("batch_size", f"disaggregated prefill streams one sequence, the cache holds "
                                        f"{cache.sequences}")
    if cache.engine.keys is not None or "queries" in cache.policy.needs:
        raise ConfigError("scope", "disaggregated decode receives pages only: scope 'topk' and policies that need "
                                   "key/query statistics would miss the prompt's; use scope all or resident")
    if chunk_size is not None and chunk_size % cache.layout.page_size:
        raise ConfigError("scheduler.prefill.chunk_size", f"{chunk_size} is not a multiple of the page size "
                                                          f"{cache.layout.page_size}: a page would be sent twice")


def _page_rows(cache: TieredKVCache, layer: int, first: int, last: int):
    """Device-pool rows of pages ``[first, last)`` of sequence 0 in ``layer``: a view when contiguous
    (the wire reads/writes the pool in place), else ``(None, slots)``."""
    pids = cache.table.pages(cache.seqs[0])[first:last]
    tiers, slots = cache.table.locate(layer, pids)
    if (tiers != 0).any():
        raise ConfigError("tiers", f"layer {layer}: prompt pages outside the device tier; give the device tier "
                                   "room for the whole prompt on both workers")
    pool = cache.table.tiers[0].pool(layer)  # [cap, 2, P, N_kv, D]
    if slots.size and (np.diff(slots) == 1).all():
        return pool[int(slots[0]):int(slots[0]) + slots.size], slots
    return None, slots


class StreamingPrefillCache(TieredKVCache):
    """The prefill worker's cache: each step's whole pages of a layer go to rank ``dst`` as soon as
    :meth:`update` wrote them (``dist.isend``; the handles are kept until :meth:`wait_sent`)."""

    def __init__(self, *args, dst: int, group=None, **kwargs):
        super().__init__(*args, **kwargs)
        _check_streamable(self)
        self.dst, self.group = dst, group
        self.sent: list[tuple] = []  # (work, pages) kept alive until sent
        self.sent_bytes = 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == 0:
            self._start = self.get_seq_length()  # the step's first token
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if not self.prefilled:
            P = self.layout.page_size
            a, b = self._start, self._start + key_states.shape[2]
            rows, slots = _page_rows(self, layer_idx, a // P, -(-b // P))
            if rows is None:
                rows = self.table.tiers[0].pool(layer_idx)[torch.from_numpy(slots).to(self.device)]
            self.sent.append((dist.isend(rows, self.dst, group=self.group), rows))
            self.sent_bytes += rows.numel() * rows.element_size()
        return out

    def wait_sent(self) -> None:
        for work, _ in self.sent:
            work.wait()
        self.sent.clear()


@dataclass
class PrefillResult:
    first_token: int
    prefill_s: float  # the prefill's own time (up to the first token's logits)
    sent_bytes: int
    sent_s: float  # until every send completed


def prefill_and_send(model, cache: StreamingPrefillCache, ids: torch.Tensor, chunk_size: int,
                     comm_device: torch.device | str = "cpu") -> PrefillResult:
    """Prefill ``ids [1, S]`` on this rank, streaming pages to ``cache.dst``; sends the first token too."""
    _check_streamable(cache, chunk_size if ids.shape[1] > chunk_size else None)
    header = torch.tensor([ids.shape[1], chunk_size], dtype=torch.int64, device=comm_device)
    dist.send(header, cache.dst, group=cache.group)
    synchronize(cache.device)
    t0 = time.perf_counter()
    for a, b in ChunkedPrefill(chunk_size).chunks(ids.shape[1]):
        logits = cache.forward(model, ids[:, a:b])[:, -1]  # [1, V]
    cache.end_prefill()
    synchronize(cache.device)
    prefill_s = time.perf_counter() - t0
    token = logits.argmax(-1).to(device=comm_device, dtype=torch.int64)  # [1]
    dist.send(token, cache.dst, group=cache.group)
    cache.wait_sent()
    return PrefillResult(int(token), prefill_s, cache.sent_bytes, time.perf_counter() - t0)


@dataclass
class ReceiveResult:
    first_token: int
    prompt_len: int
    received_bytes: int
    layer_arrival_s: list = field(default_factory=list)  # per layer, when its last chunk landed


def receive_prefill(cache: TieredKVCache, src: int, group=None, comm_device: torch.device | str = "cpu",
                    t0: float | None = None) -> ReceiveResult:
    """Receive a prompt's pages from rank ``src`` straight into ``cache``'s device tier; returns the
    first token. Arrival times are measured from ``t0`` (``time.perf_counter()``; default: now)."""
    _check_streamable(cache)
    t0 = time.perf_counter() if t0 is None else t0
    header = torch.empty(2, dtype=torch.int64, device=comm_device)
    dist.recv(header, src, group=group)
    prompt_len, chunk_size = (int(x) for x in header.tolist())
    _check_streamable(cache, chunk_size if prompt_len > chunk_size else None)
    cache.receive_step(prompt_len)  # the prompt's pages, appended in the device tier
    P, L = cache.layout.page_size, cache.layout.num_layers
    posted = []  # (layer, work, landing, slots or None)
    for a, b in ChunkedPrefill(chunk_size).chunks(prompt_len):
        for layer in range(L):
            rows, slots = _page_rows(cache, layer, a // P, -(-b // P))
            landing = rows if rows is not None else torch.empty((slots.size, *cache.layout.page_shape),
                                                                 dtype=cache.layout.kv_dtype, device=cache.device)
            posted.append((layer, dist.irecv(landing, src, group=group), landing, None if rows is not None else slots))
    arrival = [0.0] * L
    nbytes = 0
    for layer, work, landing, slots in posted:
        work.wait()
        if landing.is_cuda:  # NCCL's wait only orders the stream: wait for the bytes themselves
            torch.cuda.current_stream(landing.device).synchronize()
        if slots is not None:
            cache.table.tiers[0].pool(layer)[torch.from_numpy(slots).to(cache.device)] = landing
        arrival[layer] = time.perf_counter() - t0
        nbytes += landing.numel() * landing.element_size()
    token = torch.empty(1, dtype=torch.int64, device=comm_device)
    dist.recv(token, src, group=group)
    cache.end_prefill()
    return ReceiveResult(int(token), prompt_len, nbytes, arrival)


def decode(model, cache: TieredKVCache, first_token: int, max_new_tokens: int) -> torch.Tensor:
    """Greedy tokens ``[1, max_new_tokens]`` after a received prefill (the first one included)."""
    token = torch.tensor([[first_token]], dtype=torch.int64)
    out = [token]
    for _ in range(max_new_tokens - 1):
        token = cache.forward(model, token)[:, -1].argmax(-1, keepdim=True).cpu()
        out.append(token)
    cache.finish_step()
    return torch.cat(out, dim=1)
