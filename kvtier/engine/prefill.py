"""Attention of an iteration's prefill chunks over their rows' chosen pages, wherever they live: at most two
varlen calls per layer for every chunk of the iteration (FlashInfer's batch prefill over paged KV).

Each row's pages split into those every query of its chunk sees whole (before ``tail_from``) and the tail (the
chunk's own pages and, on a sliding layer, the page the window cuts): one non-causal call over the whole-seen
subsets (when some row has one) and one causal call over the tails with the layer's ``window_left``, merged by LSE.
Cold prompts in an uncaptured iteration run a global layer's causal call on their contiguous K/V
(:func:`kvtier.kernels.own_causal.own_causal`). A call reads the device pool in place, else a temporary pool
gathered from the tiers. :meth:`PrefillAttention.begin` plans once per iteration the calls and K/V writes of every
layer whose pages are all on the device. The policy's statistics: the salience of each chunk's last query row (one
extra pass) and the attention mass of its newest rows (:func:`kvtier.stats.page_mass`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvtier.stats import page_mass
from kvtier.errors import KVTierError
from kvtier.kernels.base import PagedBatch, page_salience
from kvtier.kernels.merge import merge_many
from kvtier.kernels.own_causal import own_causal, runs_own_causal
from kvtier.quant import dequantize
from kvtier.window import attended_range


@dataclass(frozen=True)
class Chunk:
    """A prefill chunk of one iteration: ``q_len`` prompt tokens of ``seq`` (engine row ``row``) from position
    ``start``; its tokens are ``[offset, offset + q_len)`` of the iteration's prefill tokens."""

    seq: int
    row: int
    start: int
    q_len: int
    offset: int


@dataclass
class Call:
    """One attention call: some pages of every chunk's row, read from one pool."""

    pool: torch.Tensor  # [slots, 2, P, N_kv, D]
    batch: PagedBatch
    pids: np.ndarray  # [nnz] pid of each listed page, rows one after another
    logical: np.ndarray  # [nnz] logical page numbers
    tokens: np.ndarray  # [nnz] tokens counted per page
    resident: np.ndarray  # [nnz] read in place from the device tier
    row_ptr: np.ndarray  # [R+1] the chunks' segments of the lists
    layer: int
    planned: bool = False  # its lists are the iteration's static ones (the Triton kernel reads their tiles)
    own: bool = False  # causal over exactly the chunks' own pages: runs on their contiguous K/V when stored


CAPTURE_TOKENS = 1024  # an iteration of up to this many chunk tokens plans into static buffers (capturable)


def _put(dst: torch.Tensor, src: np.ndarray) -> None:
    """Host values into the start of a device array (no sync)."""
    dst[:src.size].copy_(torch.from_numpy(np.ascontiguousarray(src)).to(dst.dtype), non_blocking=True)


def _put_rows(dst: torch.Tensor, rows: np.ndarray, src: np.ndarray) -> None:
    """``src [r, n]`` into rows ``rows [r]`` of a device array ``[R', >= n]``, columns ``[0, n)``."""
    index = torch.from_numpy(rows).to(dst.device, non_blocking=True)
    dst[index, :src.shape[1]] = torch.from_numpy(np.ascontiguousarray(src)).to(dst.device, dst.dtype, non_blocking=True)


def _last_page_lens(tokens: np.ndarray, row_ptr: np.ndarray) -> np.ndarray:
    """Tokens of each row's last listed page ``[n]`` (0 for a row that lists none), from the pages' ``tokens [nnz]``."""
    if not tokens.size:
        return np.zeros(row_ptr.size - 1, dtype=np.int64)
    return np.where(np.diff(row_ptr) > 0, tokens[np.maximum(row_ptr[1:] - 1, 0)], 0)


class _Lists:
    """Device arrays of an iteration's planned chunk calls and K/V writes for up to ``cap`` chunk tokens. Made once
    for :data:`CAPTURE_TOKENS` (every iteration that fits reads the same addresses, so it can be captured), or for
    one larger iteration."""

    def __init__(self, cap: int, layers: int, rows: int, width: int, tiles: int, device):
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.cap = cap
        self.slots = torch.zeros(layers, cap + 1, **i64)  # per layer the written pages' slots; the last: scratch
        self.inv = torch.zeros(cap, **i64)  # [T] index into slots of each token's page
        self.offs = torch.zeros(cap, **i64)  # [T] row of each token in its page
        self.qo = torch.zeros(rows + 2, **i32)  # row `rows` (+1): empty, for the padding tiles
        self.kv_ptr = torch.zeros(layers, 2, rows + 2, **i32)  # per layer, per call (whole-seen subsets, tails)
        self.last = torch.zeros(layers, 2, rows + 1, **i32)
        self.indices = torch.zeros(layers, 2, width, **i32)  # the calls' pages (grown by PrefillAttention.begin)
        self.tile_seq = torch.zeros(tiles, **i32)
        self.tile_q0 = torch.zeros(tiles, **i32)
        self.rows = [[(self.kv_ptr[layer, k], self.last[layer, k], self.indices[layer, k]) for k in range(2)]
                     for layer in range(layers)]  # each (layer, call)'s views, made once


class PrefillAttention:
    """Prefill calls over a :class:`~kvtier.table.BlockTable`'s pages with ``backend``; ``rows`` and ``max_pages``
    bound the chunks and their pages, ``scratch [L]`` is a device slot per layer that nothing reads (or None)."""

    def __init__(self, table, transfer, backend, stats, rows: int, max_pages: int, scratch: np.ndarray | None):
        self.table, self.transfer, self.backend, self.stats = table, transfer, backend, stats
        self.layout = table.layout
        self.device = table.tiers[0].device
        self.rows, self.max_pages, self.scratch = rows, max_pages, scratch
        from kvtier.kernels.triton_decode import TritonBackend
        self.triton = isinstance(backend, TritonBackend)  # planned calls then read the lists' tiles
        self.heads: int | None = None  # query heads, once known (the tiles of the Triton kernel depend on them)
        self.chunks: list[Chunk] = []
        self.device_only = False
        self.tokens = 0  # the iteration's chunk tokens, padding included
        self.planned: dict[int, list[Call]] = {}  # layer -> its calls, planned by begin
        self.groups: list[tuple] = []  # (layers [L'], the calls of its first) of the planned layers, alike
        self.writes: dict[int, tuple] = {}  # layer -> (slots [u], inv [T], offs [T]) of the chunks' tokens
        self._static: _Lists | None = None
        self._large: _Lists | None = None  # the lists of the last iteration over CAPTURE_TOKENS (uncaptured)
        self.version = 0  # counts the static lists made (a captured iteration reads one set)
        self._lists: _Lists | None = None
        self._tiles = None  # the Triton kernel's tile plan of the iteration (None: the backend plans each call)
        self.own_contiguous = False  # the iteration's global layers run their causal call on the chunks' contiguous K/V
        self.own_kv: tuple | None = None  # (layer, keys [T, N_kv, D], values) of the chunks' tokens, from store
        layout = self.layout
        self._own_ok = layout.kv_dtype == layout.dtype and runs_own_causal(self.device, layout.dtype)

    def begin(self, chunks: list[Chunk], device_only: bool, tokens: int) -> None:
        """An iteration's chunks (their pages appended), attending with ``device_only`` the device's pages and
        each tail; ``tokens``: their token count with padding (padded tokens write the scratch slot, attend
        nothing). The layers that hold on the device every page the tokens write get their writes planned, those
        that hold every page their calls read get their calls planned: into the lists, one copy per array."""
        self.chunks, self.device_only, self.tokens, self.planned, self.writes = chunks, device_only, tokens, {}, {}
        L, R, M = self.layout.num_layers, self.rows, self.max_pages
        self.own_kv = None
        # a chunk over earlier pages would split into a paged non-causal call and this one, merged by LSE: measured
        # slower than one causal call (an H100 A/B, 8k in chunks of 2,048: TTFT 367.5 against 291.0 ms), so only
        # cold prompts' first chunks take it
        self.own_contiguous = self._own_ok and tokens > CAPTURE_TOKENS and all(c.start == 0 for c in chunks)
        pids = np.concatenate([self.table.pages(c.seq) for c in chunks])
        width = pids.size  # a call lists at most every page of the chunks' rows
        if tokens <= CAPTURE_TOKENS:
            if self._static is None or self._static.indices.shape[-1] < width:  # grown: graphs of the old ones go
                self._static = _Lists(CAPTURE_TOKENS, L, R, max(2 * width, 2 * M), self._tile_count(CAPTURE_TOKENS),
                                      self.device)
                self.version += 1
            lists = self._lists = self._static
        else:  # a larger iteration: lists kept for the next one that fits (remade only to grow)
            big = self._large
            if big is None or big.cap < tokens or big.indices.shape[-1] < width:
                big = self._large = _Lists(tokens, L, R, width, self._tile_count(tokens), self.device)
            lists = self._lists = big
        self.transfer.wait(None, pids)
        self._plan_writes(lists)
        empty = R + 1 - len(chunks)  # rows after the chunks' (the last one always): no query, no page
        T = sum(c.q_len for c in chunks)
        qo = np.concatenate([[0], np.cumsum([c.q_len for c in chunks]), np.full(empty, T)])  # [R+2]
        _put(lists.qo, qo)
        self._tiles = None
        if self.heads is not None and self.triton:
            self._plan_tiles()
        self._plan_calls(lists, pids, qo)

    def _plan_writes(self, lists: _Lists) -> None:
        """Where the chunks' tokens go, for the layers that hold every page they write on the device."""
        chunks, tokens, P = self.chunks, self.tokens, self.layout.page_size
        pos = [np.arange(c.start, c.start + c.q_len) for c in chunks]
        written, inv = np.unique(np.concatenate([self.table.pages(c.seq)[p // P] for c, p in zip(chunks, pos)]),
                                 return_inverse=True)  # [u] pages the tokens go to, [T] the page of each
        T, u = inv.size, written.size
        pad = tokens - T
        if pad and self.scratch is None:
            raise KVTierError("padded chunk tokens need the engine's scratch slot (max_batch > 1)")
        layers = np.flatnonzero((self.table.tier_of[:, written] == 0).all(1))  # [L'] holding them on the device
        _put(lists.inv, np.concatenate([inv, np.full(pad, lists.cap)]))
        _put(lists.offs, np.concatenate(pos + [np.zeros(pad, dtype=np.int64)]) % P)
        if self.scratch is not None:
            _put(lists.slots[:, lists.cap], self.scratch)
        if layers.size:
            _put_rows(lists.slots, layers, self.table.slot_of[layers[:, None], written])
        for layer in layers:  # captured writes index the whole row (u differs between replays); 8-bit: exactly u
            slots = lists.slots[layer] if lists is self._static and not self.layout.scaled else lists.slots[layer, :u]
            self.writes[int(layer)] = (slots, lists.inv[:tokens], lists.offs[:tokens])

    def _plan_calls(self, lists: _Lists, pids: np.ndarray, qo: np.ndarray) -> None:
        """The calls of the layers that hold every page their calls read on the device (``pids``: the chunks' rows'
        pages, ``qo [R+2]``), per group of alike layers."""
        chunks, L, R, P = self.chunks, self.layout.num_layers, self.rows, self.layout.page_size
        empty = R + 1 - len(chunks)
        tier = self.table.tier_of[:, pids]  # [L, n]: layers alike in window and in every page's tier plan alike
        alike: dict[tuple, list[int]] = {}
        for layer in range(L):
            alike.setdefault((self.layout.window(layer), tier[layer].tobytes()), []).append(layer)
        plans = []  # (layers [L'], their calls' [(pids, logical, tokens, row_ptr, causal)]): all pages on the device
        for layers in map(np.asarray, alike.values()):
            parts = self._parts(int(layers[0]))
            if all((self.table.tier_of[layers[0], part[0]] == 0).all() for part in parts):
                plans.append((layers, parts))
        width = max((part[0].size for _, parts in plans for part in parts), default=0)
        kv_ptr = np.zeros((L, 2, R + 2), dtype=np.int64)
        last = np.zeros((L, 2, R + 1), dtype=np.int64)
        indices = np.zeros((L, 2, width), dtype=np.int64)
        for layers, parts in plans:
            for k, (pids_k, _, tokens_k, row_ptr, _) in enumerate(parts):
                n = pids_k.size
                kv_ptr[layers, k] = np.concatenate([row_ptr, np.full(empty, n)])
                last[layers, k, :len(chunks)] = _last_page_lens(tokens_k, row_ptr)
                indices[layers, k, :n] = self.table.slot_of[layers[:, None], pids_k]
        if plans:
            _put(lists.kv_ptr.view(-1), kv_ptr.reshape(-1))
            _put(lists.last.view(-1), last.reshape(-1))
            lists.indices[:, :, :width].copy_(torch.from_numpy(indices).to(lists.indices.dtype), non_blocking=True)
        self.groups = []
        for layers, parts in plans:
            window = self.layout.window(int(layers[0]))
            for layer in layers.tolist():
                calls = []
                for k, (pids_k, logical, tokens_k, row_ptr, causal) in enumerate(parts):
                    ptr, last_len, index = lists.rows[layer][k]
                    r = R + 1 if self.triton else len(chunks)  # the Triton tiles' padding row, else the chunks'
                    batch = PagedBatch(lists.qo[:r + 1], ptr[:r + 1], index[:pids_k.size], last_len[:r], P, causal,
                                       qo[:r + 1], kv_ptr[layer, k, :r + 1], window - 1 if window and causal else -1,
                                       host_kv_last_page_len=last[layer, k, :r])
                    calls.append(Call(self.table.tiers[0].pool(layer), batch, pids_k, logical, tokens_k,
                                      np.ones(pids_k.size, dtype=bool), row_ptr, layer, True, self._own(layer, causal)))
                self.planned[layer] = calls
            self.groups.append((layers, self.planned[int(layers[0])]))

    @property
    def planned_all(self) -> bool:
        """Every layer's K/V writes and calls are planned, into the static lists (a capturable iteration)."""
        L = self.layout.num_layers
        return self._lists is self._static and len(self.planned) == L and len(self.writes) == L and \
            (self._tiles is not None or not self.triton)

    def shape(self) -> tuple:
        """What a captured iteration's kernels depend on besides the token bucket: the calls of each layer, and the
        Triton kernel's key splits."""
        splits = self._tiles.config.kv_splits if self._tiles is not None else 1
        return tuple(len(self.planned[layer]) for layer in range(self.layout.num_layers)) + (splits,)

    def _parts(self, layer: int) -> list[tuple]:
        """The chunks' live pages of ``layer`` (``device_only``: the device's, and each tail) as at most two calls,
        the subsets seen whole (non-causal; when some row has one) and the tails (causal): per call ``(pids [nnz],
        logical [nnz], tokens [nnz], row_ptr [n+1], causal)``, rows one after another."""
        chunks, P, window = self.chunks, self.layout.page_size, self.layout.window(layer)
        whole, tails = [], []
        for c in chunks:
            first, tail_from = attended_range(c.start, c.q_len, P, window)
            tier = self.table.tier_of[layer, self.table.pages(c.seq)]
            keep = tier[first:tail_from] == 0 if self.device_only else tier[first:tail_from] >= 0
            if keep.all():  # every page from the first, contiguous: the causal call takes them all
                whole.append(np.zeros(0, dtype=np.int64))
                tails.append(np.arange(first, tier.size))
            else:
                whole.append(np.flatnonzero(keep) + first)
                tails.append(np.arange(tail_from, tier.size))
        parts = [(whole, False)] if any(w.size for w in whole) else []
        out = []
        for logical, causal in parts + [(tails, True)]:
            tokens = []
            for c, lg in zip(chunks, logical):
                t = np.full(lg.size, P)
                if lg.size and lg[-1] == self.table.num_pages(c.seq) - 1:
                    t[-1] = (self.table.seq_len(c.seq) - 1) % P + 1
                tokens.append(t)
            pids = np.concatenate([self.table.pages(c.seq)[lg] for c, lg in zip(chunks, logical)])
            row_ptr = np.concatenate([[0], np.cumsum([lg.size for lg in logical])])
            out.append((pids, np.concatenate(logical), np.concatenate(tokens), row_ptr, causal))
        return out

    def _own(self, layer: int, causal: bool) -> bool:
        """``layer``'s causal call sees exactly the chunks' own tokens (:attr:`own_contiguous`, a global layer)."""
        return causal and self.own_contiguous and not self.layout.window(layer)

    def _tile_count(self, tokens: int) -> int:
        """Tiles the Triton kernel launches for ``tokens`` padded chunk tokens, at most (one query per tile)."""
        return tokens + self.rows

    def _plan_tiles(self) -> None:
        """The Triton kernel's query tiles of the planned calls, into the lists: a grid fixed by the padded token
        count (each chunk's tiles, then tiles of the empty last row)."""
        from kvtier.kernels.triton_prefill import PrefillPlan, default_prefill_config, query_tiles, tile_rows

        # by the padded token count and the longest row: an iteration captured at a bucket and splits replays one
        # launch shape (shape() keys the capture by the splits)
        keys = max(c.start + c.q_len for c in self.chunks)
        config = self.backend.prefill_config or default_prefill_config(
            self.tokens, self.heads, self.layout.num_kv_heads, self.layout.head_dim, self.device, keys)
        group_pad, block_q = tile_rows(self.heads, self.layout.num_kv_heads, config.block_m)
        grid = -(-self.tokens // block_q) + self.rows
        seq, q0 = query_tiles([c.q_len for c in self.chunks], block_q, grid, self.rows)  # [grid]
        lists = self._lists
        _put(lists.tile_seq[:grid], seq)
        _put(lists.tile_q0[:grid], q0)
        self._tiles = PrefillPlan(lists.tile_seq[:grid], lists.tile_q0[:grid], block_q, group_pad,
                                  max(config.block_n, self.layout.page_size), config)

    def calls(self, layer: int) -> list[Call]:
        """``layer``'s calls (:meth:`_parts`): planned at :meth:`begin`, or now, each from the device pool when all
        its pages are there, else from a pool gathered from their tiers."""
        if layer in self.planned:
            return self.planned[layer]
        window = self.layout.window(layer)
        return [self._call(layer, *part, window - 1 if window and part[4] else -1) for part in self._parts(layer)]

    def run(self, calls: list[Call], q: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [T, H, D]`` (the chunks' tokens one after another) over the calls, merged: ``(out [T, H, D], lse
        [T, H])``."""
        results = []
        for call in calls:
            if call.own and self.own_kv is not None and self.own_kv[0] == call.layer:  # contiguous K/V, stored
                _, keys, values = self.own_kv
                parts = [own_causal(q[c.offset:c.offset + c.q_len], keys[c.offset:c.offset + c.q_len],
                                    values[c.offset:c.offset + c.q_len], scale) for c in self.chunks]
                results.append(parts[0] if len(parts) == 1 else tuple(map(torch.cat, zip(*parts))))
                continue
            if call.planned and self.triton:  # the lists' tiles
                from kvtier.kernels.triton_prefill import paged_prefill

                if self._tiles is None:  # the heads were not known at begin
                    self.heads = q.shape[1]
                    self._plan_tiles()
                res = paged_prefill(q, call.pool, call.batch, self._tiles, scale)
            else:
                self.backend.plan(call.batch, q.shape[1], self.layout.num_kv_heads, q.shape[2], scale)
                res = self.backend.run(q, call.pool)
            results.append((res.out, res.lse))
        out, lse = merge_many(results)
        return out.contiguous(), lse

    def salience(self, calls: list[Call], q_last: torch.Tensor, lse_last: torch.Tensor,
                 scale: float) -> list[tuple[np.ndarray, torch.Tensor]]:
        """Per call ``(pids, max attention probability [nnz, N_kv])`` of each chunk's last query row ``q_last
        [R, H, D]`` against its final ``lse_last [R, H]``: one extra pass of R rows per call."""
        out = []
        n = q_last.shape[0]
        for call in calls:
            b = call.batch  # a planned call's lists have empty rows after the chunks'
            rows = torch.arange(n + 1, dtype=torch.int32, device=b.kv_indptr.device)
            last = PagedBatch(rows, b.kv_indptr[:n + 1], b.kv_indices, b.kv_last_page_len[:n], b.page_size, False,
                              np.arange(n + 1), b.host_kv_indptr[:n + 1], b.window_left)
            self.backend.plan(last, q_last.shape[1], self.layout.num_kv_heads, q_last.shape[2], scale)
            page_max = self.backend.run(q_last, call.pool, return_page_max=True).page_max  # [nnz, H]
            out.append((call.pids, page_salience(page_max, lse_last, last, self.layout.num_kv_heads)))
        return out

    def mass(self, calls: list[Call], i: int, q_rows: torch.Tensor, lse_rows: torch.Tensor, pos: torch.Tensor,
             scale: float, layer: int) -> list[tuple[np.ndarray, torch.Tensor]]:
        """Per call ``(pids, attention mass [r, n, N_kv])`` of chunk ``i``'s rows ``q_rows [r, H, D]`` at
        ``pos [r]`` over its pages in the call."""
        window = self.layout.window(layer)
        out = []
        for call in calls:
            a, b = call.row_ptr[i], call.row_ptr[i + 1]
            index = call.batch.kv_indices[a:b].long()
            pages = call.pool.index_select(0, index)  # [n, 2, P(+R), N_kv, D]
            keys = (dequantize(pages, self.layout.page_size) if self.layout.scaled else pages)[:, 0]  # [n, P, N_kv, D]
            logical = torch.from_numpy(call.logical[a:b]).to(q_rows.device)
            tokens = torch.from_numpy(call.tokens[a:b]).to(q_rows.device)
            wl = window - 1 if window and call.batch.causal else -1
            out.append((call.pids[a:b], page_mass(keys.to(q_rows.device), logical, tokens, q_rows, lse_rows, pos,
                                                  scale, self.layout.num_kv_heads, wl)))
        return out

    def _call(self, layer: int, pids: np.ndarray, logical: np.ndarray, tokens: np.ndarray, row_ptr: np.ndarray,
              causal: bool, window_left: int) -> Call:
        self.transfer.wait(layer, pids)
        tiers, slots = self.table.locate(layer, pids)
        if (tiers == 0).all():
            pool, indices = self.table.tiers[0].pool(layer), slots
        else:
            pool, links = self.transfer.gather(layer, pids, self.device)
            indices = np.arange(pids.size)
            for link, nbytes in links.items():
                self.stats.add_fetch(link, nbytes)
        qo = np.concatenate([[0], np.cumsum([c.q_len for c in self.chunks])])  # [n+1]
        batch = PagedBatch.from_host(qo, row_ptr, indices, _last_page_lens(tokens, row_ptr), self.layout.page_size, causal, self.device,
                                     window_left)
        return Call(pool, batch, pids, logical, tokens, tiers == 0, row_ptr, layer, own=self._own(layer, causal))
