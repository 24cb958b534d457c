"""Statistics the step gathers for scopes and scorers, on the engine's device, in static buffers: keys
(:class:`KeyStats`), queries, attention mass, salience and device scores, read by the host from pinned snapshots
under the feedback's lookahead bound; :class:`StatsRequest` / :class:`DeviceStats`: what a policy asks for and the
views the engine makes for it (the policy declares, the engine builds and owns, the policy reads).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


QUERY_SHRINK = 0.9  # how far the prompt's query moment is pulled to the identity (0: it alone, 1: Loki's basis)


def pid_index(pids, device) -> torch.Tensor:
    """Pids ``[n]`` (any integer array, read-only ones too) as an int64 index on ``device``."""
    a = np.asarray(pids, dtype=np.int64)
    return torch.from_numpy(a if a.flags.writeable else a.copy()).to(device)


class KeyStats:
    """Key statistics per (layer, pid, kv head) for ``capacity`` pids, only the ``fields`` asked for (of
    :attr:`FIELDS`; None: all; float32): ``key_min``/``key_max``/``key_sum``/``key_sq`` ``[L, pids, N_kv, D]``,
    ``norm_sum`` ``[L, pids, N_kv]``, ``count`` ``[L, pids]`` (always kept).

    With ``sketch_rank`` r > 0 also an 8-bit low-rank sketch of every key (Loki, arXiv:2406.02542; ShadowKV,
    arXiv:2410.21465), ``sketch [L, pids, P, N_kv, r]`` int8 through ``key_map [L, N_kv, D, r]``: a logit is about
    ``(query_map^T q) . sketch``, the maps fitted once by :meth:`fit_sketch` (:func:`sketch_maps` with ``query_shrink``;
    zeros before). It lives on the device whatever tier the pages are in: :meth:`bytes_per_token` is what the device
    budget pays."""

    FILL = {"key_min": float("inf"), "key_max": float("-inf"), "key_sum": 0.0, "key_sq": 0.0, "norm_sum": 0.0,
            "count": 0.0}
    FIELDS = frozenset(FILL)
    SKETCH_DTYPE = torch.int8
    SKETCH_LEVELS = 127  # a sketch component: round(y / step) in [-127, 127], clamped
    SKETCH_MARGIN = 1.5  # step = the fitted keys' largest * margin / 127: room for later keys past the prompt's

    def __init__(self, layout, capacity: int, device, fields=None, sketch_rank: int = 0,
                 query_shrink: float = QUERY_SHRINK):
        self.layout, self.device, self.query_shrink = layout, device, query_shrink
        L, N, D = layout.num_layers, layout.num_kv_heads, layout.head_dim
        self.fields = tuple(f for f in self.FILL if f in (self.FIELDS if fields is None else set(fields) | {"count"}))
        shapes = {"key_min": (L, capacity, N, D), "key_max": (L, capacity, N, D), "key_sum": (L, capacity, N, D),
                  "key_sq": (L, capacity, N, D), "norm_sum": (L, capacity, N), "count": (L, capacity)}
        for name in self.FILL:
            setattr(self, name, torch.full(shapes[name], self.FILL[name], device=device) if name in self.fields
                    else None)
        self.fitted = False  # the sketch's maps are fitted (fit_sketch)
        maps = (lambda: torch.zeros(L, N, D, sketch_rank, device=device)) if sketch_rank else (lambda: None)
        self.key_map, self.query_map = maps(), maps()
        self.query_second = torch.zeros(L, N, D, D, device=device) if sketch_rank else None
        self.sketch = torch.zeros(L, capacity, layout.page_size, N, sketch_rank, dtype=self.SKETCH_DTYPE,
                                  device=device) if sketch_rank else None

    def tensors(self) -> list[torch.Tensor]:
        """Every statistic (what a captured step advances)."""
        return [getattr(self, name) for name in self.fields] + ([self.sketch] if self.sketch is not None else [])

    def bytes_per_token(self) -> float:
        """Device bytes these statistics keep per stored token (every layer): per pid over its page's tokens."""
        return self.bytes_per_token_for(self.layout, self.fields, 0 if self.sketch is None else self.sketch.shape[-1])

    @classmethod
    def bytes_per_token_for(cls, layout, fields, sketch_rank: int) -> float:
        """:meth:`bytes_per_token` of statistics ``fields`` (count always) and a rank-``sketch_rank`` sketch, before
        any is made (what a device budget pays for them)."""
        N, D, P = layout.num_kv_heads, layout.head_dim, layout.page_size
        size = {"key_min": N * D, "key_max": N * D, "key_sum": N * D, "key_sq": N * D, "norm_sum": N, "count": 1}
        per_pid = 4 * sum(size[f] for f in set(fields) | {"count"}) + P * N * sketch_rank * cls.SKETCH_DTYPE.itemsize
        return layout.num_layers * per_pid / P

    @classmethod
    def needed(cls, scope, policy, layout) -> tuple[frozenset, int]:
        """The statistics an engine keeps for ``scope`` and ``policy`` (None: the scope's alone): those the scope's
        choice reads and its sketch's rank, every field when the policy needs keys; ``(frozenset(), 0)``: none."""
        fields, rank = scope.key_stats(layout) if scope.needs_keys else (frozenset(), 0)
        return (cls.FIELDS if fields is None or "keys" in getattr(policy, "needs", ()) else fields), rank

    def norm_mean(self, pids: np.ndarray) -> np.ndarray:
        """Mean key L2 norm of pages ``pids [n]`` ``[L, n, N_kv]`` (NaN for an empty page), read now (a wait for the
        queued steps)."""
        idx = pid_index(pids, self.device)
        return (self.norm_sum[:, idx] / self.count[:, idx, None]).cpu().numpy()

    def on_append(self, pids: np.ndarray, step: int = 0) -> None:
        """Fresh pages (a recycled pid forgets its keys)."""
        idx = pid_index(pids, self.device)
        for name in self.fields:
            getattr(self, name)[:, idx] = self.FILL[name]
        if self.sketch is not None:
            self.sketch[:, idx] = 0.0

    def on_copy(self, src: int, dst: int) -> None:
        for t in self.tensors():
            t[:, dst] = t[:, src]

    def add_queries(self, layer: int, queries: torch.Tensor) -> None:
        """Prompt queries ``[T, H, D]`` of ``layer``, summed per kv head as ``q q^T`` until the sketch is fitted."""
        N = self.layout.num_kv_heads
        q = queries.float().view(queries.shape[0], N, -1, queries.shape[-1])  # [T, N_kv, G, D]
        self.query_second[layer] += torch.einsum("tngd,tnge->nde", q, q)

    def fit_sketch(self, sequences: list) -> None:
        """Fix the maps from the keys of ``sequences`` ``[(pids [n], per layer keys [S, N_kv, D])]`` (every stored
        token, on any device; keys of pages dropped for good read as zeros and weigh nothing) and the prompt queries
        seen so far, and sketch those keys; later writes are sketched with them. Host work, once: never inside a
        captured step."""
        L, N, D = self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim
        P = self.layout.page_size
        second = torch.zeros(L, N, D, D, dtype=torch.float64, device=self.device)  # [L, N_kv, D, D] sum of k k^T
        for _, keys in sequences:
            for layer, k in enumerate(keys):  # k [S, N_kv, D]
                k = k.to(self.device, torch.float64)
                second[layer] += torch.einsum("snd,sne->nde", k, k)
        # float64 on the host: the same keys give the same maps on every device and run
        key_map, query_map = sketch_maps(second.cpu(), self.query_second.cpu().double(), self.key_map.shape[-1],
                                         self.query_shrink)
        key_map, query_map = key_map.to(self.device), query_map.to(self.device)  # [L, N_kv, D, r]
        top = torch.zeros(L, N, key_map.shape[-1], dtype=torch.float64, device=self.device)  # [L, N_kv, r] max |y|
        for _, keys in sequences:
            for layer, k in enumerate(keys):
                y = torch.einsum("snd,ndr->snr", k.to(self.device, torch.float64), key_map[layer])
                top[layer] = torch.maximum(top[layer], y.abs().amax(0))
        step = torch.where(top > 0, top * self.SKETCH_MARGIN / self.SKETCH_LEVELS, 1.0)[:, :, None]  # [L, N_kv, 1, r]
        self.key_map.copy_(key_map / step)
        self.query_map.copy_(query_map * step)
        for pids, keys in sequences:
            for layer, k in enumerate(keys):
                k = k.to(self.device, torch.float32)
                tok = torch.arange(k.shape[0], device=self.device)
                page = pid_index(pids, self.device)[tok // P]
                self.sketch[layer, page, tok % P] = self._levels(torch.einsum("snd,ndr->snr", k, self.key_map[layer]))
        self.fitted = True

    def _levels(self, y: torch.Tensor) -> torch.Tensor:
        """Sketch components on the 8-bit steps ``y [..., r]`` as stored (rounded, clamped)."""
        return y.round().clamp(-self.SKETCH_LEVELS, self.SKETCH_LEVELS).to(self.SKETCH_DTYPE)

    def add(self, layer: int, pids: torch.Tensor, keys: torch.Tensor) -> None:
        """Keys ``[n, N_kv, D]`` of ``layer`` written into pages ``pids [n]`` (device int64; repeats allowed)."""
        self._update(slice(layer, layer + 1), pids, keys[None])

    def add_step(self, pids: torch.Tensor, keys: torch.Tensor, live: torch.Tensor) -> None:
        """A decode step's keys ``[L, B, N_kv, D]`` of every layer, each row's into its page ``pids [B]``; rows
        not ``live [B]`` (idle in the bucket) change nothing."""
        self._update(slice(None), pids, keys, live)

    def _update(self, layers: slice, pids: torch.Tensor, keys: torch.Tensor, live: torch.Tensor | None = None) -> None:
        k = keys.float()  # [L', n, N_kv, D]
        on = torch.ones(k.shape[:2], device=k.device) if live is None else live.float().expand(k.shape[:2])  # [L', n]
        mask = on[..., None, None] > 0
        if self.sketch is not None:
            self._sketch(layers, pids, k, mask[..., 0, 0])
        idx = pids[None, :, None, None].expand_as(k)
        if self.key_min is not None:
            self.key_min[layers].scatter_reduce_(1, idx, torch.where(mask, k, float("inf")), reduce="amin")
            self.key_max[layers].scatter_reduce_(1, idx, torch.where(mask, k, float("-inf")), reduce="amax")
        k = k * on[..., None, None]
        if self.key_sum is not None:
            self.key_sum[layers].index_add_(1, pids, k)
            self.key_sq[layers].index_add_(1, pids, k * k)
        if self.norm_sum is not None:
            self.norm_sum[layers].index_add_(1, pids, k.norm(dim=-1))
        self.count[layers].index_add_(1, pids, on)

    def _sketch(self, layers: slice, pids: torch.Tensor, k: torch.Tensor, on: torch.Tensor) -> None:
        """Sketch keys ``k [L', n, N_kv, D]`` written into pages ``pids [n]`` (a page's keys consecutive, after the
        ``count`` it holds); rows not ``on [L', n]`` change nothing."""
        n = pids.numel()
        i = torch.arange(n, device=pids.device)
        run_start = torch.where(torch.cat([i[:1] == 0, pids[1:] != pids[:-1]]), i, 0).cummax(0).values  # [n]
        offset = (self.count[layers][:, pids].long() + (i - run_start)).clamp(max=self.layout.page_size - 1)  # [L', n]
        sketch = self.sketch[layers]  # [L', pids, P, N_kv, r]
        lay = torch.arange(sketch.shape[0], device=pids.device)[:, None].expand_as(offset)
        new = self._levels(torch.einsum("lnkd,lkdr->lnkr", k, self.key_map[layers]))  # [L', n, N_kv, r]
        old = sketch[lay, pids.expand_as(offset), offset]
        sketch[lay, pids.expand_as(offset), offset] = torch.where(on[..., None, None], new, old)


def sketch_maps(key_second: torch.Tensor, query_second: torch.Tensor, rank: int,
                shrink: float = QUERY_SHRINK) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank-``rank`` maps ``(W, A)`` ``[..., D, r]`` with ``q . k ~ (A^T q) . (W^T k)`` that lose the least in
    expectation over queries and keys of second moments ``query_second``, ``key_second`` ``[..., D, D]`` (sums of
    ``q q^T``, ``k k^T``). ``E (q^T (I - A W^T) k)^2 = |Sq^1/2 (I - A W^T) Sk^1/2|_F^2`` is least at the top ``r``
    singular pairs of ``Sq^1/2 Sk^1/2 = U S V^T`` (Eckart-Young): ``W = Sk^-1/2 V_r``, ``A = Sk W (W^T Sk W)^-1`` (the
    least-squares ``A`` for that ``W``, whatever the queries). ``Sq`` is the query moment scaled to a mean eigenvalue
    of 1 and shrunk toward the identity by ``shrink`` (a prompt's queries are a hint of a later question's, not its
    law: at 0 a passkey asked after the prompt was lost at 5%); the identity (``shrink`` 1, or no query seen) makes
    ``A W^T`` the projection on the keys' principal directions, Loki's basis."""
    D = key_second.shape[-1]
    eye = torch.eye(D, dtype=query_second.dtype)
    scale = query_second.diagonal(dim1=-2, dim2=-1).sum(-1)[..., None, None] / D  # [..., 1, 1] mean eigenvalue
    query_second = torch.where(scale > 0, (1 - shrink) * query_second / scale.clamp(min=1e-30) + shrink * eye, eye)

    def power(m: torch.Tensor, p: float) -> torch.Tensor:
        """``m^p`` of symmetric PSD ``m`` (eigenvalues below 1e-12 of the largest raised as if that small)."""
        e, v = torch.linalg.eigh(m)
        e = e.clamp(min=(e.amax(-1, keepdim=True) * 1e-12).clamp(min=1e-30))
        return v @ torch.diag_embed(e ** p) @ v.transpose(-1, -2)

    _, _, vh = torch.linalg.svd(power(query_second, 0.5) @ power(key_second, 0.5))
    key_map = power(key_second, -0.5) @ vh.transpose(-1, -2)[..., :rank]  # [..., D, r]
    query_map = key_second @ key_map @ torch.linalg.pinv(key_map.transpose(-1, -2) @ key_second @ key_map)
    return key_map, query_map


ATTENTION_FIELDS = frozenset({"total", "last", "window"})  # what a scorer may read (PageStats.attention_<field>)


class HostSnapshots:
    """Pinned host copies of pid-major device statistics (``[pids, ...]`` per field) for a host that reads them under
    the feedback's lookahead bound: :meth:`take` copies the live pids' rows into a slot after a step without a wait
    (one contiguous block per field), :meth:`show` makes a slot what :meth:`read` gives once its step is done; pids
    appended after the shown step read as empty (:meth:`forget`). ``fields``: name -> (row shape, dtype, empty value)."""

    def __init__(self, fields: dict, capacity: int, slots: int, pin: bool):
        self._empty = {f: fill for f, (_, _, fill) in fields.items()}
        self._slots = [{f: torch.full((capacity, *shape), fill, dtype=dtype, pin_memory=pin)
                        for f, (shape, dtype, fill) in fields.items()} for _ in range(slots)]
        self._fresh: list[tuple[int, np.ndarray]] = []  # (step, pids) appended after the shown step
        self._view = {f: t.numpy() for f, t in self._slots[0].items()}

    def take(self, slot: int, pids: int, live: dict) -> None:
        """The first ``pids`` rows of each live field ``[capacity, ...]`` (device) into slot ``slot`` (queued)."""
        for f, src in live.items():
            self._slots[slot][f][:pids].copy_(src[:pids], non_blocking=True)

    def show(self, slot: int, step: int) -> None:
        """Slot ``slot``, the state after ``step`` (done), is what :meth:`read` gives."""
        self._view = {f: t.numpy() for f, t in self._slots[slot].items()}
        self._fresh = [(s, pids) for s, pids in self._fresh if s > step]
        for _, pids in self._fresh:
            for f, v in self._view.items():
                v[pids] = self._empty[f]

    def forget(self, pids: np.ndarray, step: int) -> None:
        """Pages appended at ``step``: empty in what is read until a snapshot taken after it is shown."""
        self._fresh.append((step, np.asarray(pids, dtype=np.int64)))
        for f, v in self._view.items():
            v[pids] = self._empty[f]

    def read(self) -> dict:
        """Numpy ``[pids, ...]`` per field."""
        return self._view


class AttentionStats:
    """Observed attention mass per (pid, layer, kv head), added on the device by the step itself. ``keeps`` (of
    :data:`ATTENTION_FIELDS`): ``total [pids, L, N_kv]`` float64, the sum over every row (H2O); ``ring [rows, pids,
    L, N_kv]``, the last ``rows`` rows, ``head [L]`` rows pushed per layer (``last``: TOVA); ``window [pids, L,
    N_kv]`` float64, the ring's running sum (SnapKV). Pid-major: the live pids are one block. The host reads
    snapshots (:class:`HostSnapshots`), or the live state without slots (a CPU store fed by hand)."""

    def __init__(self, num_layers: int, capacity: int, num_kv_heads: int, rows: int, keeps, device, slots: int = 0):
        keeps = frozenset(keeps)
        L, N = num_layers, num_kv_heads
        self.keeps, self.rows, self.capacity, self.device = keeps, rows, capacity, torch.device(device)
        f64 = dict(dtype=torch.float64, device=device)
        self.total = torch.zeros(capacity, L, N, **f64) if "total" in keeps else None
        self.ring = torch.zeros(rows, capacity, L, N, device=device) if keeps & {"last", "window"} else None
        self.window = torch.zeros(capacity, L, N, **f64) if "window" in keeps else None
        self.head = torch.zeros(L, dtype=torch.int64, device=device)
        self._layers = torch.arange(L, device=device)
        fields = {f: ((L, N), torch.float64 if f != "last" else torch.float32, 0.0) for f in sorted(keeps)}
        self.host = HostSnapshots(fields, capacity, slots, self.device.type == "cuda") if slots else None

    def tensors(self) -> list[torch.Tensor]:
        """What a captured step advances."""
        return [t for t in (self.total, self.ring, self.window, self.head) if t is not None]

    def _live(self) -> dict:
        """The kept fields now ``[pids, L, N_kv]`` each (device)."""
        out = {}
        if self.total is not None:
            out["total"] = self.total
        if "last" in self.keeps:
            out["last"] = self.ring[(self.head - 1) % self.rows, :, self._layers].transpose(0, 1)  # newest rows
        if self.window is not None:
            out["window"] = self.window
        return out

    # -- what the step adds ------------------------------------------------------------------------
    def on_append(self, pids: np.ndarray, step: int) -> None:
        """Fresh pages (a recycled pid forgets its past), from ``step`` on; the host view forgets them now."""
        idx = pid_index(pids, self.device)
        for t in (self.total, self.window):
            if t is not None:
                t[idx] = 0
        if self.ring is not None:
            self.ring[:, idx] = 0
        if self.host is not None:
            self.host.forget(pids, step)

    def add(self, layer: int, pids: torch.Tensor, mass: torch.Tensor) -> None:
        """A prefill chunk's ``mass [r, n, N_kv]`` (its newest ``r`` query rows, oldest first) on pages ``pids [n]``
        (device int64; a page named twice adds up) of ``layer``: ``r`` ring rows."""
        N = mass.shape[-1]
        heads = torch.arange(N, device=pids.device)
        if self.total is not None:
            cell = ((pids.long()[:, None] * self.total.shape[1] + layer) * N + heads).flatten()  # [n * N_kv]
            self.total.view(-1).index_add_(0, cell, mass.sum(0).flatten().double())
        if self.ring is None:
            return
        cell = (pids.long()[:, None] * N + heads).flatten()  # in a row of one layer [pids, 1, N_kv]
        for row in mass[-self.rows:]:
            new = torch.zeros(self.capacity * N, dtype=torch.float64, device=self.device).index_add_(
                0, cell, row.flatten().double())
            self._push(self._layers[layer:layer + 1], new.view(self.capacity, 1, N))

    def add_step(self, layers: range, logical: torch.Tensor, pid_table: torch.Tensor, mass: torch.Tensor,
                 live: torch.Tensor) -> None:
        """A decode step's ``mass [L', B, K, N_kv]`` on the pages listed ``logical [L', B, G, K]`` (-1: none; ``G`` =
        N_kv for per-kv-head lists, where head g's entry counts for head g only, else 1) of rows ``live [B]`` whose
        pids are ``pid_table [B, M]``, in consecutive ``layers``: one ring row each. Device ops only."""
        Lg, B, G, K = logical.shape
        N, L = mass.shape[-1], self.head.numel()
        rows = torch.arange(B, device=logical.device)[None, :, None, None]
        pid = pid_table[rows, logical.clamp(min=0).long()].long()  # [L', B, G, K]
        ok = ((logical >= 0) & (pid >= 0) & live[None, :, None, None])[..., None]
        heads = torch.arange(N, device=logical.device)
        if G == 1:  # an entry gives its page every head's mass
            value, head = mass[:, :, None], heads  # [L', B, 1, K, N_kv]
        else:  # entry (g, k) gives head g its own mass
            value, head = mass.transpose(2, 3)[..., None], heads[:, None, None]  # [L', B, N_kv, K, 1]
        lay = torch.arange(Lg, device=logical.device)[:, None, None, None, None]
        value = value.double().masked_fill(~ok, 0.0)
        if self.total is not None:
            cell = ((pid[..., None] * L + layers.start + lay) * N + head).masked_fill(~ok, 0)  # [L', B, G, K, *]
            self.total.view(-1).index_add_(0, cell.flatten(), value.expand(cell.shape).flatten())
        if self.ring is not None:
            cell = ((pid[..., None] * Lg + lay) * N + head).masked_fill(~ok, 0)  # in a row [pids, L', N_kv]
            new = torch.zeros(self.capacity * Lg * N, dtype=torch.float64, device=self.device).index_add_(
                0, cell.flatten(), value.expand(cell.shape).flatten())
            self._push(self._layers[layers.start:layers.stop], new.view(self.capacity, Lg, N))

    def _push(self, layers: torch.Tensor, new: torch.Tensor) -> None:
        """One ring row ``new [pids, L', N_kv]`` (float64) into ``layers [L']``; the window sum follows."""
        slot = self.head[layers] % self.rows  # [L']
        new = new.float()
        if self.window is not None:
            old = self.ring[slot, :, layers].transpose(0, 1)  # [pids, L', N_kv]
            self.window.index_add_(1, layers, new.double() - old.double())
        self.ring[slot, :, layers] = new.transpose(0, 1)
        self.head.index_add_(0, layers, torch.ones_like(layers))

    # -- what the host reads -------------------------------------------------------------------------
    def snapshot(self, slot: int, pids: int) -> None:
        """The kept fields of the first ``pids`` pids into pinned slot ``slot`` (queued: read once its step is done)."""
        self.host.take(slot, pids, self._live())

    def show(self, slot: int, step: int) -> None:
        """Slot ``slot``, the state after ``step`` (done), is what :meth:`read` gives; pages appended after ``step``
        read 0."""
        self.host.show(slot, step)

    def read(self) -> dict:
        """The kept fields as the host sees them, numpy ``[L, pids, N_kv]`` each (views; read-only to scorers)."""
        view = self.host.read() if self.host is not None else {f: t.cpu().numpy() for f, t in self._live().items()}
        return {f: v.transpose(1, 0, 2) for f, v in view.items()}


class SalienceStats:
    """ASPE's salience per (pid, layer): a page's max attention probability in a step, summed over kv heads (the
    largest over rows), in a ring of the last ``window`` steps ``ring [pids, W, L]`` (NaN: not observed), written by
    the step itself into the row :meth:`begin` opened. The host reads each page's sum and count of observed steps
    (:meth:`read`) from snapshots, less the rows opened since (their old contents are gone), or live without slots."""

    def __init__(self, num_layers: int, capacity: int, window: int, device, slots: int = 0):
        self.window, self.capacity, self.device = window, capacity, torch.device(device)
        self.ring = torch.full((capacity, window, num_layers), float("nan"), device=device)
        self.row = torch.zeros(1, dtype=torch.int64, device=device)  # the ring row of the open step
        fields = {"ring": ((window, num_layers), torch.float32, float("nan")),
                  "sum": ((num_layers,), torch.float32, 0.0), "count": ((num_layers,), torch.float32, 0.0)}
        self.host = HostSnapshots(fields, capacity, slots, self.device.type == "cuda") if slots else None
        self._opened: list[int] = []  # steps opened since the shown snapshot was taken

    def tensors(self) -> list[torch.Tensor]:
        """What a captured step advances."""
        return [self.ring, self.row]

    def begin(self, step: int) -> None:
        """Open step ``step``'s ring row (it forgets the step ``window`` steps older)."""
        self.row.fill_(step % self.window)
        self.ring[:, step % self.window] = float("nan")
        if self.host is not None:
            # the last W steps opened: with more since the snapshot, every row was cleared anyway
            self._opened = self._opened[max(0, len(self._opened) + 1 - self.window):] + [step]

    def on_append(self, pids: np.ndarray, step: int) -> None:
        """Fresh pages (a recycled pid forgets its past); the host view forgets them now."""
        self.ring[pid_index(pids, self.device)] = float("nan")
        if self.host is not None:
            self.host.forget(pids, step)

    def add(self, layer: int, pids: torch.Tensor, salience: torch.Tensor) -> None:
        """Observed ``salience [n, N_kv]`` of pages ``pids [n]`` (distinct, device int64) of ``layer`` (a prefill
        chunk's last row, or fed by hand), into the open row."""
        n = pids.numel()
        self.ring.index_put_((pids.long(), self.row.expand(n), torch.full_like(pids.long(), layer)),
                             salience.float().sum(-1))

    def add_step(self, layers: range, logical: torch.Tensor, pid_table: torch.Tensor, salience: torch.Tensor,
                 live: torch.Tensor) -> None:
        """A decode step's ``salience [L', B, K, N_kv]`` on the pages listed ``logical [L', B, G, K]`` (as
        :meth:`AttentionStats.add_step`; a per-kv-head list gives head g's entry for head g only) of rows ``live [B]``
        whose pids are ``pid_table [B, M]``, in consecutive ``layers``. Device ops only."""
        Lg, B, G, K = logical.shape
        rows = torch.arange(B, device=logical.device)[None, :, None, None]
        pid = pid_table[rows, logical.clamp(min=0).long()].long()  # [L', B, G, K]
        ok = (logical >= 0) & (pid >= 0) & live[None, :, None, None]
        value = salience.float().sum(-1)[:, :, None] if G == 1 else salience.float().transpose(2, 3)  # [L', B, G, K]
        lay = torch.arange(Lg, device=logical.device)[:, None, None, None]
        cell = ((rows * Lg + lay) * self.capacity + pid).masked_fill(~ok, 0).flatten()  # (row, layer, pid)
        size = B * Lg * self.capacity
        total = torch.zeros(size, device=self.device).index_add_(0, cell, value.masked_fill(~ok, 0.0).flatten())
        seen = torch.zeros(size, device=self.device).index_add_(0, cell, ok.float().flatten())
        total = total.view(B, Lg, self.capacity).amax(0).t()  # [pids, L'] Σ over a row's heads, max over rows
        seen = seen.view(B, Lg, self.capacity).amax(0).t() > 0
        cur = self.ring.index_select(1, self.row)[:, 0]  # [pids, L]
        at = slice(layers.start, layers.stop)
        cur[:, at] = torch.where(seen, total, cur[:, at])
        self.ring.index_copy_(1, self.row, cur[:, None])

    def _sums(self, pids: int) -> dict:
        """The ring of the first ``pids`` pids and, per (pid, layer), the sum and count of its observed steps."""
        ring = self.ring[:pids]  # [pids, W, L]
        seen = ~torch.isnan(ring)
        return {"ring": ring, "sum": torch.where(seen, ring, 0.0).sum(1), "count": seen.sum(1).float()}

    def snapshot(self, slot: int, pids: int) -> None:
        self.host.take(slot, pids, self._sums(pids))

    def show(self, slot: int, step: int) -> None:
        """Slot ``slot``, the ring after ``step`` (done), is what :meth:`read` gives."""
        self.host.show(slot, step)
        self._opened = [s for s in self._opened if s > step]

    def read(self, pids: np.ndarray | slice) -> tuple[np.ndarray, np.ndarray]:
        """The sum and the count of observed steps over the ring of ``pids`` (``[n]``, or a slice of them), ``[n, L]``
        each, as the host sees them."""
        if self.host is None:
            sums = self._sums(self.capacity)
            return sums["sum"][pids].double().numpy(), sums["count"][pids].double().numpy()
        view = self.host.read()
        total, count = view["sum"][pids].astype(np.float64), view["count"][pids].astype(np.float64)
        opened = sorted({s % self.window for s in self._opened})  # rows cleared on the device since the snapshot
        if opened:
            ring = view["ring"]  # [pids, W, L]
            old = ring[pids][:, opened] if isinstance(pids, slice) else ring[pids[:, None], opened]  # [n, k, L]
            seen = ~np.isnan(old)
            total -= np.where(seen, old, 0.0).sum(1)
            count -= seen.sum(1)
        return total, count


class DeviceScores:
    """A scorer's score of every live pid, ``score(pids) -> [L, pids]`` (device ops over the first ``pids`` pids),
    computed on the engine's device after each step and read by the host from pinned snapshots
    (:class:`HostSnapshots`, the feedback's lookahead bound): the host never waits for the step in flight to rank.
    A pid appended after the shown step reads NaN (not scored yet)."""

    def __init__(self, score, num_layers: int, capacity: int, device, slots: int):
        self.score = score
        self.host = HostSnapshots({"score": ((num_layers,), torch.float32, float("nan"))}, capacity, slots,
                                  torch.device(device).type == "cuda")

    def snapshot(self, slot: int, pids: int) -> None:
        """Score the first ``pids`` pids now (queued device work) into pinned slot ``slot``."""
        self.host.take(slot, pids, {"score": self.score(pids).float().t().contiguous()})  # [pids, L]: one block

    def show(self, slot: int, step: int) -> None:
        self.host.show(slot, step)

    def on_append(self, pids: np.ndarray, step: int) -> None:
        self.host.forget(pids, step)

    def read(self, pids: np.ndarray) -> np.ndarray:
        """The shown scores of ``pids [n]`` ``[L, n]``."""
        return self.host.read()["score"][pids].T


class QueryStats:
    """The last ``rows`` queries per layer: ``ring [rows, L, H, D]`` float32 (NaN: none yet), ``seen [L]``
    on the device (so that captured steps count too)."""

    def __init__(self, num_layers: int, rows: int, num_heads: int, head_dim: int, device):
        self.rows, self.num_layers, self.device = rows, num_layers, device
        self.ring = torch.full((rows, num_layers, num_heads, head_dim), float("nan"), device=device)
        self.seen = torch.zeros(num_layers, dtype=torch.int64, device=device)

    def add(self, layer: int, q: torch.Tensor) -> None:
        """The newest query rows ``q [r, H, D]`` of ``layer`` (oldest first)."""
        for row in q:  # index_copy_ with a device index: no host read, so a captured step records it too
            self.ring[:, layer].index_copy_(0, (self.seen[layer] % self.rows).view(1), row.float()[None])
            self.seen[layer] += 1

    def add_step(self, q: torch.Tensor) -> None:
        """A decode step's query of every layer ``[L, H, D]``."""
        layers = torch.arange(self.num_layers, device=q.device)
        self.ring.index_put_((self.seen % self.rows, layers), q.float())
        self.seen += 1

    def last(self) -> torch.Tensor:
        """The newest query of every layer ``[L, H, D]`` (NaN before any; device ops only, no wait)."""
        return self.ring[(self.seen - 1) % self.rows, torch.arange(self.num_layers, device=self.device)]

    def moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and variance of the stored queries ``[L, H, D]`` each (0 before any; device ops only, no wait)."""
        seen = ~torch.isnan(self.ring)
        n = seen.sum(0).clamp_min(1)
        x = torch.where(seen, self.ring, 0.0)
        mean = x.sum(0) / n
        var = (torch.where(seen, (self.ring - mean) ** 2, 0.0)).sum(0) / n
        return mean, var


@dataclass(frozen=True)
class StatsRequest:
    """The device statistics one reader of a policy (a scored policy; each scored part of a Compose) asks for beyond
    the key and query statistics all share; the engine makes them and hands them back as a :class:`DeviceStats`."""

    attention: tuple | None = None  # (rows, keeps): AttentionStats of the newest rows query rows, the sums kept
    salience: int | None = None  # SalienceStats over a ring of this many steps
    score: object = None  # Scorer.score_device(keys, queries, pids) -> [L, pids]: DeviceScores of it after each step


@dataclass
class DeviceStats:
    """What one reader of a policy reads of the engine's statistics: plain tensors behind typed views, made, filled
    and owned by the engine (the query statistics arrive with the first attention call, once the heads are known);
    a policy fed by hand makes its own."""

    keys: KeyStats | None = None
    queries: QueryStats | None = None
    attention: AttentionStats | None = None
    salience: SalienceStats | None = None
    scores: DeviceScores | None = None


def quest_bound(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Quest's upper bound of q·k per query head (Tang et al., 2024): Σ_d max(q_d·kmin_d, q_d·kmax_d); q
    ``[B, H, D]``, a page's per-channel key bounds ``[B, M, N_kv, D]`` -> ``[B, M, H]`` (B: rows or layers)."""
    B, H, D = q.shape
    n_kv = kmin.shape[2]
    qg = q.float().view(B, 1, n_kv, H // n_kv, D)  # [B, 1, N_kv, G, D]
    ub = torch.maximum(qg * kmin[:, :, :, None], qg * kmax[:, :, :, None]).sum(-1)  # [B, M, N_kv, G]
    return ub.flatten(2)


def page_bounds(q: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor, pids: torch.Tensor) -> torch.Tensor:
    """Quest's bound per (row, page, query head) ``[B, M, H]``, max over the query rows ``q [B, r, H, D]``, of the
    pages ``pids [B, M]`` (-1: read as pid 0) of one layer's key bounds ``key_min``/``key_max [pids, N_kv, D]``."""
    p = pids.long().clamp(min=0)  # [B, M]
    kmin, kmax = key_min[p], key_max[p]  # [B, M, N_kv, D]
    return torch.stack([quest_bound(q[:, i], kmin, kmax) for i in range(q.shape[1])]).amax(0)


def over_heads(ub: torch.Tensor, num_kv_heads: int, kv_head: int | None = None, reduce=torch.amax) -> torch.Tensor:
    """``ub [B, M, H]`` -> ``[B, M]``: ``reduce`` (max or sum) over every query head, or over kv head ``kv_head``'s
    group."""
    if kv_head is None:
        return reduce(ub, -1)
    return reduce(ub.view(*ub.shape[:2], num_kv_heads, -1)[:, :, kv_head], -1)


def page_mass(keys: torch.Tensor, logical: torch.Tensor, tokens: torch.Tensor, q: torch.Tensor, lse: torch.Tensor,
              q_pos: torch.Tensor, scale: float, num_kv_heads: int, window_left: int) -> torch.Tensor:
    """Attention probability mass per (query row, page, kv head) ``[r, n, N_kv]`` for one sequence.

    ``keys [n, P, N_kv, D]`` of the attended pages, their ``logical`` page numbers ``[n]`` and counted
    tokens ``[n]``; ``q [r, H, D]`` the chosen query rows, ``lse [r, H]`` their final LSE, ``q_pos [r]``
    their positions. Causal, ``window_left`` as the kernels apply them; mass is the sum over the page's
    tokens, mean over the kv group's query heads.
    """
    n, P = keys.shape[:2]
    H = q.shape[1]
    G = H // num_kv_heads
    if n == 0:
        return torch.zeros(q.shape[0], 0, num_kv_heads, device=q.device)
    kk = keys.float().repeat_interleave(G, dim=2)  # [n, P, H, D]
    logits = torch.einsum("rhd,nphd->nrhp", q.float(), kk) * scale  # [n, r, H, P]
    key_pos = logical[:, None] * P + torch.arange(P, device=q.device)  # [n, P]
    qp = q_pos[None, :, None]  # [1, r, 1]
    ok = (torch.arange(P, device=q.device) < tokens[:, None])[:, None] & (key_pos[:, None] <= qp)  # [n, r, P]
    if window_left >= 0:
        ok &= key_pos[:, None] >= qp - window_left
    prob = torch.exp(logits - lse.float()[None, :, :, None]).masked_fill(~ok[:, :, None], 0.0)  # [n, r, H, P]
    mass = prob.sum(-1).view(n, -1, num_kv_heads, G).mean(-1)  # [n, r, N_kv]
    return mass.transpose(0, 1)
