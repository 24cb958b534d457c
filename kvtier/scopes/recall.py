"""A device-managed recall cache for the ``topk`` scope: no host work per pick.

The host places pages at *home* (its block table, uploaded as ``home [L, R, M]``). Each layer also owns ``C``
device slots the captured step manages by itself: at the step's start one overlay points every layer's table at
the pages its slots hold; once a batch of ``ADMIT_LAYERS`` layers has attended, the pages they picked from the host
(read in place) are copied into their least recently picked slots, one copy on a side stream behind the later
layers' compute. With landing slots the decode kernel writes the host pages it reads whole into them, and their
admission swaps slots instead of crossing the host link again. With a predictor a layer's predicted picks are
admitted before it runs (:meth:`RecallCache.prefetch`, on a second side stream; :meth:`RecallCache.wait`).
All static-shape device work, captured with the step.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.compiling import compile_step
from kvtier.kernels.base import at_host
from kvtier.scopes.base import DROPPED
from kvtier.mover.copy_kernel import copy_pool_pages

ADMIT_LAYERS = 8  # layers admitted together, once the last of them has attended


def admission_batches(groups: list[range]) -> dict[int, range]:
    """The layers each admission takes, keyed by the last of them: runs of at most ``ADMIT_LAYERS`` layers within a
    layer group (whose page lists share their shape)."""
    batches = {}
    for group in groups:
        for first in range(group.start, group.stop, ADMIT_LAYERS):
            batch = range(first, min(first + ADMIT_LAYERS, group.stop))
            batches[batch.stop - 1] = batch
    return batches


class RecallCache:
    """``C`` recall slots per layer: device slot ``slots [L, C]``, cached page ``page [L, C]``
    (``row * M + logical``, -1 empty), last step picked ``stamp [L, C]``; ``ahead [L, C]`` the slots filled by
    this step's prediction that the layer has not picked from yet. ``device_tier`` holds the slots, ``host_tier``
    the pages at home on the host. ``land [L, R, n]`` (or None): each row's landing slots, where the decode writes
    the pages it reads whole from the host (``land_index [L, R, M]``: each listed entry's landing slot, -1 none).

    ``compile``: the overlay and the admissions run as torch.compile'd kernels (a few fused launches).
    """

    def __init__(self, slots: np.ndarray, max_pages: int, scratch: np.ndarray, device_tier, host_tier, device,
                 compile: bool = False, land: np.ndarray | None = None):
        L, C = slots.shape
        self.slots = torch.from_numpy(slots.astype(np.int64)).to(device)  # [L, C]
        self.slot_index = torch.full((L, device_tier.capacity), -1, dtype=torch.int64, device=device)  # [L, cap]
        self.slot_index.scatter_(1, self.slots, torch.arange(C, device=device).expand(L, C))  # device slot -> c
        self.page = torch.full((L, C), -1, dtype=torch.int64, device=device)  # [L, C]
        self.stamp = torch.full((L, C), -1, dtype=torch.int64, device=device)  # [L, C]
        self.scratch = torch.from_numpy(scratch.astype(np.int64)).to(device)  # [L] a slot nothing reads
        self.step = torch.zeros((), dtype=torch.int64, device=device)
        self.max_pages = max_pages
        self.copied = torch.zeros((), dtype=torch.int64, device=device)  # pages copied in after their layer read them
        self.landed = torch.zeros((), dtype=torch.int64, device=device)  # pages admitted from their landing slot
        self.land = self.land_index = None
        if land is not None:
            self.land = torch.from_numpy(land.astype(np.int64)).to(device)  # [L, R, n]
            self.land_index = torch.full((L, land.shape[1], max_pages), -1, dtype=torch.int32, device=device)
        self.prefetched = torch.zeros((), dtype=torch.int64, device=device)  # pages copied in ahead of their layer
        self.predicted = torch.zeros((), dtype=torch.int64, device=device)  # of those, picked by the layer
        self.ahead = torch.zeros((L, C), dtype=torch.bool, device=device)
        self.device_tier, self.host_tier = device_tier, host_tier
        cuda = torch.device(device).type == "cuda"
        self.side = torch.cuda.Stream(device) if cuda else None  # the admissions after the reads
        self.ahead_side = torch.cuda.Stream(device) if cuda else None  # the prefetches, which a layer waits for
        self._fetched: dict[int, torch.cuda.Event] = {}  # layer -> the end of its prefetch copy, until it waits
        self._held: list[torch.Tensor] = []  # the side streams' index tensors, not reused before the join
        self._forked: set = set()  # the side streams this step used
        self._overlay = compile_step(overlay_recall, dynamic=False) if compile else overlay_recall
        self._admit = compile_step(plan_admission, dynamic=False) if compile else plan_admission

    def tensors(self) -> list[torch.Tensor]:
        """The state a step advances."""
        state = [self.page, self.stamp, self.step, self.copied, self.prefetched, self.predicted, self.ahead]
        if self.land is not None:  # admissions from the landing slots swap them with recall slots
            state += [self.slots, self.slot_index, self.land, self.landed]
        return state

    def landing(self, layer: int, B: int, K: int) -> dict:
        """The decode's landing arguments for ``layer``'s ``B`` rows and ``K`` listed pages (none without landing
        slots)."""
        if self.land is None:
            return {}
        return {"land_slots": self.land[layer, :B], "land_index": self.land_index[layer, :B, :K]}

    def overlay(self, home: torch.Tensor, table: torch.Tensor) -> None:
        """At the step's start, every layer: ``table [L, B, M] = home [L, B, M]``, with the cached pages pointing
        at their recall slots; a slot whose page went home to the device, was freed (home at the scratch slot) or
        whose row is outside the bucket (idle) is emptied, and so is one whose page was dropped for good."""
        self._overlay(home, table, self.page, self.slots)

    def wait(self, layer: int) -> None:
        """Before ``layer`` reads its pages: its prefetch copy, if any, has landed."""
        fetched = self._fetched.pop(layer, None)
        if fetched is not None:
            torch.cuda.current_stream().wait_event(fetched)

    def forget_row(self, row: int) -> None:
        """A new sequence takes ``row``: its old cached pages are stale."""
        self.page.masked_fill_(self.page // self.max_pages == row, -1)

    def admit(self, layers: range, picks: torch.Tensor, table: torch.Tensor) -> None:
        """Once ``layers`` (a batch of :func:`admission_batches`) have attended: copy the picked pages ``picks [L',
        B, K]`` (logical, -1 none) that were read from the host (``table [L', B, M]``: the step's overlay) into each
        layer's least recently picked slots (pages picked again keep theirs), for the next steps, in one copy;
        counts the slots filled ahead that their layer picked. The plan and the copy run on the side stream (on a
        GPU)."""
        at = slice(layers.start, layers.stop)
        landing = () if self.land is None else \
            (self.land_index[at, :picks.shape[1], :picks.shape[2]], self.land[at], self.landed)

        def work():
            src, dst = self._admit(picks, table, None, self.page[at], self.stamp[at], self.slots[at],
                                   self.slot_index[at], self.scratch[at], self.step, self.copied, self.ahead[at],
                                   self.predicted, False, *landing)  # [L', B*K] host slots, device slots
            first = torch.arange(layers.start, layers.stop, device=src.device)[:, None]  # [L', 1]
            src = torch.where(src >= 0, first * self.host_tier.capacity + src, -1).reshape(-1)
            dst = (first * self.device_tier.capacity + dst).reshape(-1)
            copy_pool_pages(self.host_tier.pools(), src, self.device_tier.pools(), dst)
            return picks, src, dst

        self._on_side(work, self.side)

    def prefetch(self, layer: int, picks: torch.Tensor, home: torch.Tensor, table: torch.Tensor) -> None:
        """Admit the predicted picks ``picks [B, K]`` of a layer that has not run (``home [B, M]``, ``table [B,
        M]``: its overlay) as :meth:`admit` does, and point ``table`` at the new slots (the pages they evicted back
        at home); the plan and the copy on the side stream (on a GPU), which the layer waits for (:meth:`wait`)
        before it reads. They count as picked this step."""
        at = slice(layer, layer + 1)
        picks = picks.clone()  # the layer's own choice may be written where the estimate's was

        def work():
            src, dst = self._admit(picks[None], table[None], home[None], self.page[at], self.stamp[at],
                                   self.slots[at], self.slot_index[at], self.scratch[at], self.step, self.prefetched,
                                   self.ahead[at], self.predicted, True)
            copy_pool_pages(self.host_tier.pool(layer), src[0], self.device_tier.pool(layer), dst[0])
            return picks, src, dst

        self._on_side(work, self.ahead_side)
        if self.ahead_side is not None:
            self._fetched[layer] = fetched = torch.cuda.Event()
            fetched.record(self.ahead_side)

    def _on_side(self, work, stream: torch.cuda.Stream | None) -> None:
        """``work()`` on a side ``stream`` after the work issued so far (on a GPU; else now); the tensors it returns
        are held until the join (the caching allocator does not hand them to the main stream before)."""
        if stream is None:
            work()
            return
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._held += list(work())
        self._forked.add(stream)

    def join(self) -> None:
        """The step waits for every copy on the side streams it used (a captured step joins them before its end)."""
        for stream in self._forked:
            torch.cuda.current_stream().wait_stream(stream)
        self._forked, self._held, self._fetched = set(), [], {}

    def next_step(self) -> None:
        self.step += 1


def overlay_recall(home: torch.Tensor, table: torch.Tensor, page: torch.Tensor, slots: torch.Tensor) -> None:
    """:meth:`RecallCache.overlay`: ``table [L, B, M]`` and ``page [L, C]`` in place."""
    L, B, M = home.shape
    valid = (page >= 0) & (page < B * M)
    at_home = home.reshape(L, -1).gather(1, torch.where(valid, page, 0))  # [L, C]
    keep = valid & (at_home < 0) & (at_home != DROPPED)  # still on the host (a page dropped for good goes)
    page.copy_(torch.where(keep, page, -1))
    flat = torch.cat([home.reshape(L, -1), home.new_zeros(L, 1)], 1)  # [L, B*M + 1]: the last column takes the dropped
    flat.scatter_(1, torch.where(keep, page, B * M), slots.to(home.dtype))
    table.copy_(flat[:, :-1].view(L, B, M))


def plan_admission(picks: torch.Tensor, table: torch.Tensor, home: torch.Tensor | None, page: torch.Tensor,
                   stamp: torch.Tensor, slots: torch.Tensor, slot_index: torch.Tensor, scratch: torch.Tensor,
                   step: torch.Tensor, copied: torch.Tensor, ahead: torch.Tensor, predicted: torch.Tensor,
                   fetch_ahead: bool, land_index: torch.Tensor | None = None, land: torch.Tensor | None = None,
                   landed: torch.Tensor | None = None):
    """The admission of ``L'`` layers' picks ``picks [L', B, K]`` read through ``table [L', B, M]``: updates
    ``page``/``stamp [L', C]`` and ``copied`` in place and returns each layer's copy, host slots and device slots
    ``[L', B*K]`` (-1 and the scratch slot: nothing to copy). A pick is cached when its table entry is a recall slot
    (``slot_index [L', cap]``: device slot -> its index, -1 none); a miss is admitted from the host tier only (a
    disk or remote page staged for the step is read from the staging pool again). ``fetch_ahead``: the picks are
    predicted, ``ahead [L', C]`` marks the slots filled, and the table points at them (the pages they evicted at ``home``); else
    ``predicted`` counts the marked slots picked, and the marks go. ``land_index [L', B, K]`` (each pick's landing
    slot index, -1 none) and ``land [L', R, n]`` (each row's landing slots): a miss that landed is admitted by
    swapping its landing slot with its victim's slot (``slots``, ``slot_index``, ``land`` in place; nothing to
    copy), counted in ``landed`` instead of ``copied``."""
    L, B, M = table.shape
    C = page.shape[1]
    pick = picks.reshape(L, -1).long()  # [L', N]
    picked = pick >= 0
    rows = torch.arange(B, device=picks.device).repeat_interleave(picks.shape[-1])  # [N]
    key = rows * M + pick.clamp(min=0)  # [L', N] cached-page key of each pick
    loc = table.reshape(L, -1).gather(1, key).long()  # [L', N] device slot, or -(host slot) - 1
    cached = slot_index.gather(1, loc.clamp(min=0))  # [L', N] recall slot of each pick, -1 none
    hit = picked & (loc >= 0) & (cached >= 0)
    hit_slots = torch.zeros(L, C + 1, dtype=torch.bool, device=picks.device)
    hit_slots = hit_slots.scatter(1, torch.where(hit, cached, C), True)[:, :C]  # [L', C]
    stamp.copy_(torch.where(hit_slots, step, stamp))  # picked again: fresh
    if not fetch_ahead:
        predicted.add_((ahead & hit_slots).sum())
        ahead.zero_()
    miss = picked & at_host(loc)  # [L', N] at home on the host (not staged), not in a recall slot
    n = min(miss.shape[1], C)
    # [L', n] oldest first, equal stamps the lower slot first: one sort launch (a GPU topk selects, then sorts)
    victims = torch.argsort(stamp, dim=1, stable=True)[:, :n]
    order = torch.cumsum(miss.long(), 1) - 1  # [L', N] rank of each miss
    victim = victims.gather(1, order.clamp(0, n - 1))  # [L', N] slot for each miss
    take = miss & (order < n) & (stamp.gather(1, victim) < step)  # never evict this step's picks
    swap = take & (land_index.reshape(L, -1) >= 0) if land_index is not None else torch.zeros_like(take)
    src = torch.where(take & ~swap, -loc - 1, -1)  # host slot
    dst = torch.where(take, slots.gather(1, victim), scratch[:, None])
    if land_index is not None:
        swap_landing(swap, victim, rows * land.shape[2] + land_index.reshape(L, -1).clamp(min=0).long(), slots,
                     slot_index, land)
        landed.add_(swap.sum())
    index = torch.where(take, victim, C)  # [L', N]; C: dropped
    new = torch.full((L, C + 1), -1, dtype=torch.int64, device=picks.device)
    new = new.scatter(1, index, torch.where(take, key, -1))[:, :C]  # [L', C]
    filled = new >= 0
    if fetch_ahead:  # the layer reads the new pages from their slots, the evicted ones from home
        evicted = filled & (page >= 0) & (page < B * M)
        flat = torch.cat([table.reshape(L, -1), table.new_zeros(L, 1)], 1)  # [L', B*M + 1]
        back = home.reshape(L, -1).gather(1, torch.where(evicted, page, 0))
        flat.scatter_(1, torch.where(evicted, page, B * M), back)
        flat.scatter_(1, torch.where(filled, new, B * M), slots.to(flat.dtype))
        table.copy_(flat[:, :-1].view(L, B, M))
        ahead.copy_(filled)
    page.copy_(torch.where(filled, new, page))
    stamp.copy_(torch.where(filled, step, stamp))
    copied.add_((take & ~swap).sum())
    return src, dst


def swap_landing(swap: torch.Tensor, victim: torch.Tensor, where: torch.Tensor, slots: torch.Tensor,
                 slot_index: torch.Tensor, land: torch.Tensor) -> None:
    """Where ``swap [L', N]``: recall slot ``victim`` takes the landing slot at flat index ``where`` of ``land [L',
    R, n]``, which takes the victim's old device slot (``slots [L', C]``, ``slot_index [L', cap]`` and ``land`` in
    place)."""
    L, C = slots.shape
    flat = land.view(L, -1)  # [L', R*n]
    new = flat.gather(1, where)  # [L', N] the landing slots
    old = slots.gather(1, victim)  # [L', N] the victims' slots

    def put(x: torch.Tensor, index: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """``x [L', W]`` with ``value`` at ``index`` where ``swap`` (the others into a column past the end)."""
        return torch.cat([x, x[:, :1]], 1).scatter(1, torch.where(swap, index, x.shape[1]), value)[:, :-1]

    slot_index.copy_(put(put(slot_index, old, torch.full_like(old, -1)), new, victim))
    slots.copy_(put(slots, victim, new))
    flat.copy_(put(flat, where, old))
