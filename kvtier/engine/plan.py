"""StepPlan and Planner: the host plan of a step, as values.

The :class:`Planner` builds each step's :class:`StepPlan` on the host (step ``plan`` of
:mod:`kvtier.engine.engine`): the policy hears the past, pages leave sliding windows, the scheduler plans the
moves and the mover issues them, rows grow, the budget's spans are computed; the plan's changed rows go to the
step's device buffers (:class:`~kvtier.engine.step_buffers.StepBuffers`). The attention callbacks
(:mod:`kvtier.engine.attention`) and the graph replay (:mod:`kvtier.engine.graphs`) read the plan; nothing in
the run writes it back but the page lists a ``query_free`` scope plans at the step's first layer.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from kvtier.engine.prefill import Chunk
from kvtier.errors import KVTierError, TierFullError
from kvtier.kernels.base import DROPPED
from kvtier.layout import KVLayout
from kvtier.scheduler.base import Ranking, pairs
from kvtier.tiers.base import rank_in_layer
from kvtier.window import out_of_window


def layer_groups(layout: KVLayout, dense_layers: int) -> list[range]:
    """Runs of consecutive layers that share a sliding window and are all dense or all budgeted: what a step
    plans and finishes with one batch of device ops each."""
    key = [(layer < dense_layers, layout.window(layer)) for layer in range(layout.num_layers)]
    cuts = [0] + [i for i in range(1, len(key)) if key[i] != key[i - 1]] + [len(key)]
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


@dataclasses.dataclass
class StepPlan:
    """The host plan of the step being computed. The rows' host copies (``row_seq`` .. ``spans``) last across
    steps and change in place (``dirty``: rows whose table changed since the last upload); the rest is the step's
    own: its mode, decode rows, prompt chunks, token bucket and page lists."""

    row_seq: list  # [R] the sequence on each row (None: idle)
    prefilling: set  # rows opened and not yet decoding (their table row: the scratch slot)
    table: np.ndarray  # [L, R, M] int32 where each page is read: device slot, host slot -s - 1, staged, dropped
    pids: np.ndarray  # [R, M] int32 the pid of each logical page (-1: none)
    lens: np.ndarray  # [R] int64 tokens incl. the one being fed (its position: lens - 1)
    spans: np.ndarray  # [R, 2] int32 the budget's (sinks, win_start)
    rows: int  # B: the decode bucket's row count (0: no decode rows)
    dirty: set = dataclasses.field(default_factory=set)
    mode: str = "idle"  # idle | prefill | decode | mixed (decode rows, then prefill chunks, in one token row)
    chunks: list = dataclasses.field(default_factory=list)  # the prompt chunks (prefill.Chunk)
    bucket: int | None = None  # the chunks' padded token count when the iteration is captured
    lists: dict | None = None  # layer -> page list of a query_free scope (None: not planned yet)

    def running_rows(self) -> list[int]:
        """Rows decoding now."""
        return [r for r, s in enumerate(self.row_seq) if s is not None and r not in self.prefilling]


class Planner:
    """Builds ``engine``'s :class:`StepPlan` (``plan``) step after step; ``scratch [L]`` is the device slot per
    layer that idle rows point at."""

    def __init__(self, engine, scratch: np.ndarray):
        self.engine = e = engine
        L, R, M = e.layout.num_layers, e.config.max_batch, e.max_pages
        table = np.repeat(scratch[:, None, None], R, 1).repeat(M, 2)  # [L, R, M]
        self.plan = StepPlan([None] * R, set(), table, np.full((R, M), -1, dtype=np.int32),
                             np.zeros(R, dtype=np.int64), np.zeros((R, 2), dtype=np.int32), R)
        self.scratch = scratch
        self.layers = np.arange(L)  # [L]
        self.step_idx = -1
        self.next_seq = 0
        self.dropped_any = False  # some page was dropped for good (compress-once)
        self.win_start: dict[int, int] = {}  # sequence -> the window's start fixed by compress-once
        self.prompt_room = 0  # device slots per layer each step keeps free for a prompt chunk (keep_room)
        self.ranking = None  # the policy's Ranking of the step being planned (None: not asked yet)
        self.prefill_queued = False  # a prefill step's K/V writes may still be queued on the GPU
        self.to_free: list[tuple[int, object]] = []  # (sequence, event of the last step that used it)

    # -- rows ----------------------------------------------------------------------------------
    def new_seq(self) -> int:
        """A fresh sequence id."""
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        return seq

    def open(self, prefix_pids, prefix_len: int) -> tuple[int, int]:
        """A new sequence on a free row, prefilling, sharing the pages ``prefix_pids`` that hold its first
        ``prefix_len`` tokens: ``(sequence, row)``."""
        plan = self.plan
        row = next((r for r, s in enumerate(plan.row_seq) if s is None), None)
        if row is None:
            raise KVTierError(f"all {len(plan.row_seq)} rows are busy; finish a sequence or raise max_batch")
        self.free_finished(block=False)  # the rest once room runs short (grow): no wait for the step in flight
        seq = self.new_seq()
        self.engine.table.add_sequence(seq, prefix_pids, prefix_len)
        plan.row_seq[row] = seq
        plan.prefilling.add(row)  # its table row stays the scratch slot until start_decode
        plan.pids[row] = -1
        return seq, row

    def prefilling_row(self, seq: int) -> int:
        row = self.plan.row_seq.index(seq) if seq in self.plan.row_seq else None
        if row is None or row not in self.plan.prefilling:
            raise KVTierError(f"sequence {seq} is not being prefilled: open() it first")
        return row

    def finish(self, seq: int) -> None:
        """``seq``'s row goes idle now; its pages are freed once no queued step can use them."""
        plan = self.plan
        if seq not in plan.row_seq:
            raise KVTierError(f"finish of unknown sequence {seq!r}; running: {[s for s in plan.row_seq if s is not None]}")
        row = plan.row_seq.index(seq)
        plan.row_seq[row] = None
        plan.prefilling.discard(row)
        plan.lens[row] = 0
        plan.table[:, row] = self.scratch[:, None]
        plan.pids[row] = -1
        plan.spans[row] = 0
        self.win_start.pop(seq, None)
        plan.dirty.add(row)
        self.to_free.append((seq, self.queued_fence()))

    def place_row(self, row: int, seq: int) -> None:
        """Point ``row``'s table at ``seq``'s pages (a sequence that starts decoding)."""
        table, plan = self.engine.table, self.plan
        pids = table.pages(seq)
        self.engine.transfer.wait(None, pids)  # pages moved while it prefilled are read at their new place
        plan.table[:, row, :pids.size] = self.encode(self.layers[:, None], pids)
        plan.pids[row, :pids.size] = pids
        plan.lens[row] = table.seq_len(seq)
        plan.dirty.add(row)

    def compress_once(self, seqs: list[int]) -> None:
        """Drop for good the middle pages of ``seqs``' prompts the policy ranks below a ``once`` budget."""
        e = self.engine
        budget, table = e.budget, e.table
        e.feedback.take(upto=self.step_idx)
        prio = self.priority()
        for seq in seqs:
            view = budget.view(table.seq_len(seq) + 1)  # the first decode token's spans
            if view is None:
                continue
            self.win_start[seq] = view.win_start
            pids = table.pages(seq)
            for layer in range(e.layout.num_layers):
                cand = view.candidates(table.tier_of[layer, pids] >= 0)
                keep = np.argsort(-prio[layer, pids[cand]], kind="stable")[:budget.middle_pages]
                drop = pids[np.delete(cand, keep)]
                e.transfer.wait(layer, drop)
                e.stats.compressed_pages += table.drop(layer, drop).size
                if not self.dropped_any:  # steps captured before list every page as live: capture again
                    e.capture.clear()
                self.dropped_any = True

    # -- a step --------------------------------------------------------------------------------
    def begin(self, prefill: list[tuple[int, int]], decode: bool, tokens: dict[int, int] | None = None,
              bucket: int | None = None) -> int:
        """Plan an iteration (host work, uploads): a decode row for every running sequence (``decode``) and the
        prompt chunks ``prefill`` (``(sequence, tokens)``), padded to ``bucket`` tokens (a captured iteration) when
        every page they read is then on the device. Its decode bucket's row count (0: no decode rows)."""
        e, plan = self.engine, self.plan
        active = plan.running_rows() if decode else []
        if decode and not active:
            raise KVTierError("no running sequence: add() one first")
        if not decode and not prefill:
            raise KVTierError("an iteration needs decode rows or prompt chunks")
        rows = [self.prefilling_row(s) for s, _ in prefill]
        offsets = np.concatenate([[0], np.cumsum([q for _, q in prefill])]).tolist()
        chunks = [Chunk(s, r, e.table.seq_len(s), q, a) for (s, q), r, a in zip(prefill, rows, offsets)]
        if len(set(rows)) < len(rows):
            raise KVTierError(f"two chunks of one sequence in one iteration: {[s for s, _ in prefill]}")
        e.callbacks.drop_step()  # what a step that did not finish (an error mid-forward) left
        if active:  # before any row grows: every sequence's stored tokens are written
            e.scope.prepare()
        self.open_step(active + rows, [1] * len(active) + [c.q_len for c in chunks])
        B = next(b for b in e.capture.buckets if b > max(active)) if active else 0
        if active:
            self.plan_decode(active, tokens)
        self.prefill_queued = bool(chunks)
        plan.chunks = chunks
        if chunks:
            self.plan_chunks(chunks, bucket)
        plan.rows = B
        plan.mode = "mixed" if chunks and active else "prefill" if chunks else "decode"
        return B

    def plan_decode(self, active: list[int], tokens: dict[int, int] | None) -> None:
        """The decode rows ``active``: moved pages switched, written pages on the device, spans, forced input
        tokens, the policy's priority and the changed rows uploaded."""
        e, plan = self.engine, self.plan
        self.switch_moved()
        self.ensure_tails(active)
        for r in active:
            plan.spans[r] = self.spans_of(plan.row_seq[r], int(plan.lens[r]))
        for seq, tok in (tokens or {}).items():
            if seq not in plan.row_seq:
                raise KVTierError(f"token for unknown sequence {seq!r}")
            e.buffers.tokens[plan.row_seq.index(seq)] = int(tok)
        if e.buffers.priority is not None:
            self.upload_priority()
        e.buffers.upload(plan, e.recall is None)

    def plan_chunks(self, chunks: list, bucket: int | None) -> None:
        """The prompt chunks' prefill calls, padded to ``bucket`` tokens when every page they read is on the
        device; the pages they attend, heard by the policy now."""
        e = self.engine
        T = sum(c.q_len for c in chunks)
        device_only = e.scope.device_only and not e.exact_prefill
        e.prefill_attention.begin(chunks, device_only, bucket or T)
        if bucket is not None and not e.prefill_attention.planned_all:  # some call reads pages off the device
            bucket = None
            e.prefill_attention.begin(chunks, device_only, T)
        self.plan.bucket = bucket
        for layers, calls in e.prefill_attention.groups:  # what they attend is known now: the policy hears it
            e.callbacks.accessed(layers, calls)

    def open_step(self, rows: list[int], q_lens: list[int]) -> None:
        """The policy hears the past, pages leave sliding windows, the scheduler moves pages, rows grow."""
        e = self.engine
        e.feedback.take(upto=self.step_idx + 1 - e.lookahead if e.lookahead else None)
        self.ranking = None
        self.free_finished(block=False)
        self.drop_out_of_window()
        # pages a prefill step wrote may still be queued: the copies wait for the compute stream then; a decode
        # step's unsettled pages are pinned instead (pin_unsettled), so its copies need not wait
        self.move(reserve=self.reserve(rows) + self.prompt_room, after_compute=self.prefill_queued)
        self.prefill_queued = False
        self.step_idx += 1
        e.policy.on_step(self.step_idx)
        for r, q in zip(rows, q_lens):
            self.grow(self.plan.row_seq[r], r, q)
        e.stats.observe_occupancy(self.step_idx, e.table)

    def reserve(self, rows: list[int]) -> int:
        """Device pages kept free for the rows' next pages: one each when the host waits for every step
        (lookahead <= 1), else those the next ``lookahead + 2`` steps append."""
        e = self.engine
        if e.lookahead <= 1:
            return len(rows)
        ahead, pages_for = e.lookahead + 2, e.layout.pages_for
        active = self.plan.lens[[s is not None for s in self.plan.row_seq]]
        return int((pages_for(active + ahead) - pages_for(active)).sum())

    def grow(self, seq: int, row: int, n: int) -> None:
        """Append ``n`` tokens to ``seq`` (room made on the device first) and point the table at new pages."""
        e, plan, table = self.engine, self.plan, self.engine.table
        P = e.layout.page_size
        need = e.layout.pages_for(table.seq_len(seq) + n) - table.num_pages(seq)
        if need and self.device_free() < need and self.to_free:
            self.free_finished(block=True)  # finished sequences' pages first, once the steps that read them ran
        if need and self.device_free() < need:
            self.move(reserve=need, after_compute=True)
            if self.device_free() < need:
                self.wait_room()
        new, cow = table.append(seq, n)
        for old, fresh in cow:  # a shared, partly filled last page copied before its first write
            if e.keys is not None:
                e.keys.on_copy(old, fresh)
        if new or cow:
            if e.keys is not None and new:
                e.keys.on_append(np.asarray(new, dtype=np.int64), self.step_idx)
            first = table.num_pages(seq) - len(new) - len(cow)  # the copied page is pointed at anew too
            pids = table.pages(seq)[first:]
            e.policy.on_append(pids, self.step_idx)
            plan.pids[row, first:first + pids.size] = pids
            if row not in plan.prefilling:
                plan.table[:, row, first:first + pids.size] = self.encode(self.layers[:, None], pids)
            plan.dirty.add(row)
        length = table.seq_len(seq)
        if row not in plan.prefilling:
            plan.lens[row] = length
        if length > e.max_pages * P:
            raise KVTierError(f"sequence {seq} outgrew max_context={e.max_pages * P}")

    def encode(self, layer, pids: np.ndarray) -> np.ndarray:
        """Block-table values of ``pids`` in ``layer`` (an int, or layers broadcast against ``pids``; the broadcast
        shape): device slot, host slot ``-s - 1``, staged slot, or dropped."""
        e = self.engine
        tiers, slots = e.table.locate(layer, pids)
        loc = np.where(tiers == 0, slots, -slots - 1)
        far = (tiers > 1) | ((tiers == 1) & (e.host is None))
        if far.any():
            if e.staging is None:
                loc[far] = DROPPED
            else:
                layers, pids = np.broadcast_arrays(layer, pids)
                loc[far] = e.staging.encode(layers[far], pids[far])
        return np.where(tiers < 0, DROPPED, loc).astype(np.int32)

    def spans_of(self, seq: int, n: int) -> tuple[int, int]:
        """The budget's ``(sinks, win_start)`` for a sequence of ``n`` tokens (``(0, 0)``: attended whole)."""
        budget = self.engine.budget
        if budget is None:
            return 0, 0
        view = budget.view(n, self.win_start.get(seq))
        return (0, 0) if view is None else (view.sinks, view.win_start)

    def priority(self, ranking: Ranking | None = None) -> np.ndarray:
        """The policy's priority of every live page by pid ``[L, pid capacity]`` (0 for a pid no page holds), from
        ``ranking`` (None: asked now)."""
        e = self.engine
        ranking = ranking or Ranking.of(e.table, e.policy, self.step_idx)
        prio = np.zeros((e.layout.num_layers, e.table.ref.size))
        prio[:, ranking.info.pids] = ranking.priority  # [1 or L, n]
        return prio

    def upload_priority(self) -> None:
        """The policy's priority of every live page into the step's ``priority [L, pids]``, for scopes that choose by
        the policy (on the device, higher first, equal ones the earlier page: :func:`~kvtier.scopes.base.best_of`);
        -inf and NaN as the lowest finite values, in the order a host sort puts them (-inf, then NaN). The step's
        placement plan's ranking serves when the policy has heard nothing since that changes an old page's priority
        (pages appended since are each sequence's newest: in the budget's window, never ranked)."""
        e = self.engine
        prio = self.priority(None if e.policy.hears_step else self.ranking)  # [L, pids]
        low = np.finfo(np.float64).min
        host = np.zeros(tuple(e.buffers.priority.shape))  # [L, pids]
        host[:, :prio.shape[1]] = np.where(prio > -np.inf, prio, np.where(np.isnan(prio), low, np.nextafter(low, 0)))
        e.buffers.priority.copy_(torch.from_numpy(host), non_blocking=True)

    # -- moves ---------------------------------------------------------------------------------
    def device_free(self) -> int:
        return int(self.engine.table.tiers[0].num_free(self.layers).min())

    def move(self, reserve: int, after_compute: bool) -> None:
        """Plan and issue moves (every step: a policy's priorities follow its statistics, the positions, the
        queries); the device keeps ``reserve`` slots free per layer."""
        e = self.engine
        table, transfer = e.table, e.transfer
        if len(table.tiers) < 2:
            return
        self.switch_moved()  # moves give their source slots back once their copy and fence pass
        self.pin_unsettled(True)
        step = max(self.step_idx, 0)
        self.ranking = Ranking.of(table, e.policy, step)
        try:
            moves = e.scheduler.plan(table, e.policy, step, reserve=reserve, ranking=self.ranking)
        except TierFullError:  # slots of moves still in flight: wait for their fences, once
            self.wait_room()
            moves = e.scheduler.plan(table, e.policy, step, reserve=reserve, ranking=self.ranking)
        finally:
            self.pin_unsettled(False)
        e.stats.planned_pages += moves.num_pages()
        for dst in sorted({m.dst for m in moves.demote}, reverse=True):  # a cascade: the lowest tier makes room first
            layers, pids = pairs([m for m in moves.demote if m.dst == dst])
            try:
                transfer.migrate_many(layers, pids, dst, after_compute=after_compute, fenced=True)
            except TierFullError:  # room the tier above frees once its moves' fences pass
                self.wait_room()
                transfer.migrate_many(layers, pids, dst, after_compute=after_compute, fenced=True)
        layers, pids = pairs(moves.promote)  # [n]
        wanted = np.bincount(layers, minlength=e.layout.num_layers)  # [L]
        free = table.tiers[0].num_free(self.layers) - reserve  # [L]
        if e.lookahead <= 1 and (wanted > free).any():
            # slots the demotions free once copied: the host waits for the copies only (its last step is done),
            # so promotions land as on a CPU, where copies are synchronous; with lookahead >= 2 the host does
            # not wait for the GPU, and such promotions follow a step later
            self.wait_room()
            free = table.tiers[0].num_free(self.layers) - reserve
        fits = rank_in_layer(layers, wanted) < free[layers]  # [n] each layer's first promotions, as many as fit
        transfer.migrate_many(layers[fits], pids[fits], 0, after_compute=after_compute, fenced=True)
        self.switch_moved()

    def pin_unsettled(self, pinned: bool) -> None:
        """Each row's page before the newest may still be written by a queued step (the host runs ahead of the
        GPU when lookahead >= 2): not movable."""
        table = self.engine.table
        if self.engine.lookahead < 2:
            return
        prev = [table.seqs[s].pids[-2] for s in self.plan.row_seq if s is not None and table.num_pages(s) > 1]
        if prev:
            table.set_pinned(prev, pinned)

    def switch_moved(self) -> None:
        """Point the table at the new place of every move issued (the step's compute waits for the copies): every
        row's entries of a moved ``(layer, pid)``, found through a mask of the moved pairs (``BlockTable.marked``)."""
        table, plan = self.engine.table, self.plan
        layers, pids = self.engine.transfer.take_moved(fence=self.queued_fence)  # [n]
        rows = plan.running_rows()
        if not pids.size or not rows:
            return
        pages = [table.pages(plan.row_seq[r]) for r in rows]
        sizes = np.array([p.size for p in pages])
        held = np.concatenate(pages)  # [N] every row's pages (a shared page: each holder)
        with table.marked(layers, pids) as moved:
            layer, entry = np.nonzero(moved[:, held])  # [m] (layer, held entry) pairs moved
        if not layer.size:
            return
        row_of = np.repeat(rows, sizes)[entry]  # [m]
        logical = entry - np.repeat(np.cumsum(sizes) - sizes, sizes)[entry]  # [m]
        plan.table[layer, row_of, logical] = self.encode(layer, held[entry])
        plan.dirty.update(np.unique(row_of).tolist())

    def ensure_tails(self, active: list[int]) -> None:
        """The page each row writes this step must be in the device pool."""
        table, plan = self.engine.table, self.plan
        tails = (plan.lens[active] - 1) // self.engine.layout.page_size  # [A]
        off = (plan.table[:, active, tails] < 0).any(0)  # [A]
        if not off.any():
            return
        missing = [(active[i], tails[i]) for i in np.flatnonzero(off)]
        self.move(reserve=0, after_compute=True)
        self.wait_room()
        for r, page in missing:
            pid = table.pages(plan.row_seq[r])[page]
            for layer in np.flatnonzero(plan.table[:, r, page] < 0):
                if table.tier_of[layer, pid] != 0:
                    raise KVTierError(f"layer {layer}: no device room for the page being written; the policy "
                                      "pins more pages than the device tier holds")
                plan.table[layer, r, page] = self.encode(int(layer), np.array([pid]))[0]
            plan.dirty.add(r)

    def queued_fence(self):
        """An event after everything queued on the compute stream so far (every decode step and prefill chunk that
        may still read a page's old place); None on a CPU, where nothing is queued."""
        if self.engine.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def wait_room(self) -> None:
        """Block until fenced moves release their device slots and finished sequences their pages."""
        self.switch_moved()
        if self.engine.feedback.last_event is not None:
            self.engine.feedback.last_event.synchronize()
        self.engine.transfer.synchronize()
        self.switch_moved()
        self.free_finished(block=True)

    def drop_out_of_window(self) -> None:
        """On each sliding layer, free the pages no sequence's next query can see (never read again)."""
        e = self.engine
        layout = e.layout
        for window in set(layout.sliding_windows) - {0}:
            pids = out_of_window(e.table.seqs, layout.page_size, window)
            for layer in range(layout.num_layers):
                if pids.size and layout.window(layer) == window:
                    e.transfer.wait(layer, pids)
                    n = e.table.drop(layer, pids).size
                    e.stats.dropped_pages += n
                    e.stats.dropped_bytes += n * layout.page_bytes

    def free_finished(self, block: bool) -> None:
        """Free the pages of finished sequences whose last step ran (``block``: waiting for it)."""
        still = []
        for seq, event in self.to_free:
            if event is None or block or event.query():
                if event is not None:
                    event.synchronize()
                freed = self.engine.table.free(seq)
                if self.engine.staging is not None:
                    self.engine.staging.forget(freed)
            else:
                still.append((seq, event))
        self.to_free = still
