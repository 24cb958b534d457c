"""A device-managed recall cache for the ``topk`` scope: no host work per pick.

The host places pages at *home* (its block table, uploaded as ``home [L, R, M]``: device slot or
host slot). Each layer also owns ``C`` device slots that the captured step manages by itself:
after attention (which reads a missed page in place from host memory), the pages picked this step
that are still at home on the host are copied into the least recently picked recall slots, and the
next steps read them from HBM. A slot's page is dropped when the host moves the page home to the
device or frees it. Everything is static-shape device work, captured with the rest of the step.

On a GPU the copies run on a side stream, behind the compute of the layers after: the step waits for them at its
end (:meth:`RecallCache.join`). With a predictor (:mod:`kvtier.scopes.predict`) a layer's predicted picks are
admitted the same way before the layer runs (:meth:`RecallCache.prefetch`); the layer waits for that copy before
it reads.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.tiers.copy_kernel import copy_pool_pages


class RecallCache:
    """``C`` recall slots per layer: device slot ``slots [L, C]``, cached page ``page [L, C]``
    (``row * M + logical``, -1 empty), last step picked ``stamp [L, C]``; ``ahead [L, C]`` the slots filled by
    this step's prediction that the layer has not picked from yet.

    ``compile``: the per-layer bookkeeping runs as torch.compile'd kernels (a few fused launches).
    """

    def __init__(self, slots: np.ndarray, max_pages: int, scratch: np.ndarray, device, compile: bool = False):
        L, C = slots.shape
        self.slots = torch.from_numpy(slots.astype(np.int64)).to(device)  # [L, C]
        self.page = torch.full((L, C), -1, dtype=torch.int64, device=device)  # [L, C]
        self.stamp = torch.full((L, C), -1, dtype=torch.int64, device=device)  # [L, C]
        self.scratch = torch.from_numpy(scratch.astype(np.int64)).to(device)  # [L] a slot nothing reads
        self.step = torch.zeros((), dtype=torch.int64, device=device)
        self.max_pages = max_pages
        self.copied = torch.zeros((), dtype=torch.int64, device=device)  # pages copied in after their layer read them
        self.prefetched = torch.zeros((), dtype=torch.int64, device=device)  # pages copied in ahead of their layer
        self.predicted = torch.zeros((), dtype=torch.int64, device=device)  # of those, picked by the layer
        self.ahead = torch.zeros((L, C), dtype=torch.bool, device=device)
        self.side = torch.cuda.Stream(device) if torch.device(device).type == "cuda" else None  # the copies
        self._landed: dict[int, torch.cuda.Event] = {}  # layer -> the end of its prefetch copy, until it waits
        self._held: list[torch.Tensor] = []  # the side stream's index tensors, not reused before the join
        self._overlay = torch.compile(overlay_recall, dynamic=False) if compile else overlay_recall
        self._admit = torch.compile(plan_admission, dynamic=False) if compile else plan_admission

    def overlay(self, layer: int, home: torch.Tensor, table: torch.Tensor) -> None:
        """``table [B, M] = home [B, M]``, with the cached pages pointing at their recall slots; a slot
        whose page went home to the device, was freed (home at the scratch slot) or whose row is
        outside the bucket (idle) is emptied. The layer's prefetch copy, if any, lands first."""
        landed = self._landed.pop(layer, None)
        if landed is not None:
            torch.cuda.current_stream().wait_event(landed)
        self._overlay(home, table, self.page[layer], self.slots[layer])

    def forget_row(self, row: int) -> None:
        """A new sequence takes ``row``: its old cached pages are stale."""
        self.page.masked_fill_(self.page // self.max_pages == row, -1)

    def admit(self, layer: int, picks: torch.Tensor, table: torch.Tensor, dev_pool: torch.Tensor,
              host_pool: torch.Tensor) -> None:
        """Copy the picked pages ``picks [B, K]`` (logical, -1 none) read from the host this step into the
        least recently picked slots (pages picked again keep theirs), for the next steps; counts the slots
        filled ahead that the layer picked."""
        src, dst = self._admit(picks, table, self.page[layer], self.stamp[layer], self.slots[layer],
                               self.scratch[layer], self.step, self.copied, self.ahead[layer], self.predicted, False)
        self._copy(host_pool, src, dev_pool, dst)

    def prefetch(self, layer: int, picks: torch.Tensor, table: torch.Tensor, dev_pool: torch.Tensor,
                 host_pool: torch.Tensor) -> None:
        """Admit the predicted picks ``picks [B, K]`` of a layer that has not run (``table [B, M]``: its overlay)
        as :meth:`admit` does, the copy on the side stream (on a GPU); they count as picked this step."""
        src, dst = self._admit(picks, table, self.page[layer], self.stamp[layer], self.slots[layer],
                               self.scratch[layer], self.step, self.prefetched, self.ahead[layer], self.predicted,
                               True)
        self._copy(host_pool, src, dev_pool, dst)
        if self.side is not None:
            self._landed[layer] = landed = torch.cuda.Event()
            landed.record(self.side)

    def _copy(self, host_pool: torch.Tensor, src: torch.Tensor, dev_pool: torch.Tensor, dst: torch.Tensor) -> None:
        """Host slots ``src [n]`` into device slots ``dst [n]`` (:func:`copy_pool_pages`), on the side stream after
        the work issued so far (on a GPU)."""
        if self.side is None:
            copy_pool_pages(host_pool, src, dev_pool, dst)
            return
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            copy_pool_pages(host_pool, src, dev_pool, dst)
        self._held += [src, dst]

    def join(self) -> None:
        """The step waits for every copy on the side stream (a captured step joins it before its end)."""
        if self._held:
            torch.cuda.current_stream().wait_stream(self.side)
            self._held, self._landed = [], {}

    def next_step(self) -> None:
        self.step += 1


def overlay_recall(home: torch.Tensor, table: torch.Tensor, page: torch.Tensor, slots: torch.Tensor) -> None:
    """:meth:`RecallCache.overlay` on one layer: ``table [B, M]`` and ``page [C]`` in place."""
    B, M = home.shape
    table.copy_(home)
    valid = (page >= 0) & (page < B * M)
    at_home = home.reshape(-1).gather(0, torch.where(valid, page, 0))  # [C]
    keep = valid & (at_home < 0)
    page.copy_(torch.where(keep, page, -1))
    flat = torch.cat([table.reshape(-1), table.new_zeros(1)])  # [B*M + 1]: the last entry takes the dropped
    flat.scatter_(0, torch.where(keep, page, B * M), slots.to(table.dtype))
    table.copy_(flat[:-1].view(B, M))


def plan_admission(picks: torch.Tensor, table: torch.Tensor, page: torch.Tensor, stamp: torch.Tensor,
                   slots: torch.Tensor, scratch: torch.Tensor, step: torch.Tensor, copied: torch.Tensor,
                   ahead: torch.Tensor, predicted: torch.Tensor, fetch_ahead: bool):
    """One layer's admission: updates ``page``/``stamp [C]`` and ``copied`` in place and returns the copy's
    host slots and device slots ``[B*K]`` (-1 and the scratch slot: nothing to copy). ``fetch_ahead``: the picks
    are predicted, ``ahead [C]`` marks the slots filled; else ``predicted`` counts the marked slots picked, and
    the marks go."""
    B, M = table.shape
    C = page.shape[0]
    loc = table.gather(1, picks.clamp(min=0).long())  # [B, K]
    rows = torch.arange(B, device=picks.device)[:, None]  # [B, 1]
    key = (rows * M + picks.long()).reshape(-1)  # [B*K] cached-page key of each pick
    picked = (picks >= 0).reshape(-1)
    hit = (page[None, :] == key[:, None]) & picked[:, None]  # [B*K, C]
    hit_slots = hit.any(0)  # [C]
    stamp.copy_(torch.where(hit_slots, step, stamp))  # picked again: fresh
    if not fetch_ahead:
        predicted.add_((ahead & hit_slots).sum())
        ahead.zero_()
    miss = picked & (loc.reshape(-1) < 0)  # [B*K] at home on the host, not in a recall slot
    n = min(miss.numel(), C)
    # [n] oldest first, equal stamps the lower slot first: one sort launch (a GPU topk selects, then sorts)
    victims = torch.argsort(stamp, stable=True)[:n]
    order = torch.cumsum(miss.long(), 0) - 1  # [B*K] rank of each miss
    victim = victims[order.clamp(0, n - 1)]  # [B*K] slot for each miss
    take = miss & (order < n) & (stamp[victim] < step)  # never evict this step's picks
    src = torch.where(take, -loc.reshape(-1) - 1, -1)  # host slot
    dst = torch.where(take, slots[victim], scratch)
    index = torch.where(take, victim, C)  # [B*K]; C: dropped
    new = torch.full((C + 1,), -1, dtype=torch.int64, device=picks.device)
    new = new.scatter(0, index, torch.where(take, key, -1))[:C]  # [C]
    filled = new >= 0
    page.copy_(torch.where(filled, new, page))
    stamp.copy_(torch.where(filled, step, stamp))
    copied.add_(take.sum())
    if fetch_ahead:
        ahead.copy_(filled)
    return src, dst
