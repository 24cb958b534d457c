"""AttentionCallbacks: what the model's attention modules call per layer during a step.

:meth:`AttentionCallbacks.store` writes the K/V (:mod:`kvtier.mover.paged_io`); :meth:`AttentionCallbacks.attend`
takes the plan's page list or the scope's pick for this layer's query, then runs one decode kernel (prompt chunks:
:mod:`kvtier.engine.prefill`); :meth:`AttentionCallbacks.finish` ends the step with one batch of device ops per
layer group (the page tally, key / query statistics, the feedback's per-page statistics). Host logic and Triton
launches: left out of torch.compile (the engine's ``store`` / ``attend`` are its entry points).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from kvtier.compiling import compile_step
from kvtier.errors import ConfigError, KVTierError
from kvtier.eval.fidelity import attention_fidelity
from kvtier.mover.paged_io import store_rows, write_decode, write_tokens
from kvtier.scopes import All, StepView
from kvtier.scopes.base import KeyList, pages_of
from kvtier.scopes.recall import admission_batches
from kvtier.stats import QueryStats


def tally(table: torch.Tensor, lens: torch.Tensor, page_list: torch.Tensor | None, page_size: int,
          keys: bool = False) -> torch.Tensor:
    """``[2]``: pages (``keys``: keys of key lists, one per kv head) a group of layers attends for ``table [L', B,
    M]`` / ``lens [B]`` / ``page_list [L', B, (N_kv,) K]`` (None: all), and how many of them are in the device pool."""
    n_pages = (lens.long() + page_size - 1) // page_size  # [B]
    if page_list is None:
        listed = torch.arange(table.shape[-1], device=table.device) < n_pages[:, None]  # [B, M]
        on_dev = listed & (table >= 0)  # [L', B, M]
        return torch.stack([listed.sum() * table.shape[0], on_dev.sum()])
    lists = page_list.reshape(*table.shape[:-1], -1).long()  # [L', B, (N_kv *) K]
    listed = (lists >= 0) & (lists < (lens.long() if keys else n_pages)[:, None])
    pages = torch.where(listed, lists // page_size if keys else lists, 0)
    on_dev = listed & (table.gather(-1, pages) >= 0)
    return torch.stack([listed.sum(), on_dev.sum()])


class AttentionCallbacks:
    """The per-layer attention of ``engine``'s steps, read from its step plan and buffers; ``compiled``: the
    tally and the decode K/V write through torch.compile."""

    def __init__(self, engine, compiled: bool):
        self.engine = e = engine
        self.step_keys: dict = {}  # layer -> the decode keys [B, N_kv, D] written this step
        self.step_queries: dict = {}  # layer -> the first row's decode query [H, D]
        self.launches: dict = {}  # (B, H, listed, keys) -> the decode kernel's launch grid and work buffers
        self.counts: dict | None = None  # layer -> pages each row lists [B], of a backend that plans on the host
        self.tally = compile_step(tally, dynamic=False) if compiled else tally
        # the decode K/V write fused into one kernel (eager it is six launches a layer); 8-bit pages stay eager
        self.write_decode = compile_step(write_decode, dynamic=False) if compiled and not e.layout.scaled \
            else write_decode
        self.admit_after = admission_batches(e.groups) if e.recall is not None else {}  # last layer -> its batch

    def start(self, B: int) -> None:
        """At a step's start: the scope's per-step state goes; the block table of the ``B`` decode rows, every layer,
        from the host's placement and the recall slots' pages."""
        e = self.engine
        e.scope.start_step()
        if e.recall is not None and B:
            e.recall.overlay(e.buffers.home[:, :B], e.buffers.block_table[:, :B])

    def store(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write the step's K/V ``[B, N_kv, q, D]`` of ``layer`` into its pages."""
        e, plan = self.engine, self.engine.plan
        layout = e.layout
        if (key.shape[1], key.shape[-1]) != (layout.num_kv_heads, layout.head_dim):
            raise ConfigError("layout.head_dim", f"the model's K/V have {key.shape[1]} kv heads of {key.shape[-1]} "
                                                 f"dims, the layout {layout.num_kv_heads} of "
                                                 f"{layout.head_dim}: build it with kv_layout_for(model.config)")
        if plan.mode in ("prefill", "mixed"):
            self._store_chunks(layer, self.chunk_tokens(key), self.chunk_tokens(value))  # [T, N_kv, D]
            if plan.mode == "prefill":
                return
            key, value = self.decode_rows(key), self.decode_rows(value)
        B = plan.rows
        pos = e.buffers.positions[:B]  # [B]
        self.write_decode(e.table.tiers[0].pool(layer), e.buffers.block_table[layer, :B], pos, key, value,
                          layout.page_size, layout.scaled)
        if e.keys is not None:
            self.step_keys[layer] = key[:, :, 0]  # [B, N_kv, D], into the statistics when the step ends

    def _store_chunks(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The prompt chunks' K/V ``[T, N_kv, D]`` of ``layer`` into their pages (and the key statistics)."""
        e, prefill = self.engine, self.engine.prefill_attention
        planned = prefill.writes.get(layer)
        if prefill.own_contiguous:  # the chunks' own causal part reads them contiguous
            prefill.own_kv = (layer, keys, values)
        if planned is not None:  # every token's page on the device: one write of all chunks
            store_rows(e.layout, e.table.tiers[0].pool(layer), *planned, keys, values)
        for c in e.plan.chunks if planned is None or e.keys is not None else ():
            kv = torch.stack([keys[c.offset:c.offset + c.q_len], values[c.offset:c.offset + c.q_len]])
            if planned is None:
                write_tokens(e.table, layer, c.seq, kv, c.start)  # kv [2, q, N_kv, D]
            if e.keys is not None:
                pids = e.table.pages(c.seq)[np.arange(c.start, c.start + c.q_len) // e.layout.page_size]
                e.keys.add(layer, torch.from_numpy(pids).to(e.device), kv[0].to(e.device))

    def attend(self, layer: int, query: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
        """Attention of ``query [B, H, q, D]`` of ``layer``: ``[B, q, H, D]``."""
        e, mode = self.engine, self.engine.plan.mode
        if e.queries is None and "queries" in e.policy.needs:
            e.queries = QueryStats(e.layout.num_layers, max(1, e.policy.query_rows), query.shape[1],
                                   query.shape[-1], e.device)
            for stats in e.policy_stats:  # what the policy reads: the engine's, filled in place
                stats.queries = e.queries
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        if mode not in ("prefill", "decode", "mixed"):
            raise KVTierError("attend outside a step: the model's attention must run inside Engine.step or a "
                              "TieredKVCache")
        if mode != "decode" and e.keys is not None and e.keys.sketch is not None and not e.keys.fitted:
            e.keys.add_queries(layer, self.chunk_tokens(query))  # [T, H, D]: the sketch's maps weigh them
        if mode == "prefill":
            if e.queries is not None:  # the first chunk's newest query rows
                c = e.plan.chunks[0]
                last = self.chunk_tokens(query)[c.offset:c.offset + c.q_len][-e.queries.rows:]  # [r, H, D]
                e.queries.add(layer, last)
            out = self.attend_prefill(layer, self.chunk_tokens(query).contiguous(), scale)  # [T, H, D]
            return out.view(query.shape[0], -1, *out.shape[1:])  # [B, q, H, D]
        decode = self.decode_rows(query) if mode == "mixed" else query  # [B, H, 1, D]
        if e.queries is not None:
            self.step_queries[layer] = decode[0, :, 0]  # [H, D], into the ring when the step ends
        out = self.attend_decode(layer, decode, scale)  # [B, 1, H, D]
        if mode == "decode":
            return out
        chunks = self.attend_prefill(layer, self.chunk_tokens(query).contiguous(), scale)  # [T, H, D]
        return torch.cat([out[:, 0], chunks])[None]  # [1, B + T, H, D]

    def accessed(self, layers, calls: list) -> None:
        """The pages chunk calls attend in a layer, or alike in each of ``layers [L']``: counted, heard by the policy."""
        e = self.engine
        attended = np.concatenate([c.pids for c in calls])
        n = np.size(layers)
        e.stats.attended_pages += attended.size * n
        e.stats.resident_pages += int(sum(c.resident.sum() for c in calls)) * n
        if np.ndim(layers) == 0:
            e.policy.on_access(int(layers), attended, e.step_idx)
        elif n == e.layout.num_layers:
            e.policy.on_access(slice(None), attended, e.step_idx)
        else:
            e.policy.on_access(np.repeat(layers, attended.size), np.tile(attended, n), e.step_idx)

    def chunk_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """The prefill chunks' tokens of an attention input ``x [B', N, q, D]``, one chunk after another:
        ``[T, N, D]`` (mixed: the token row after the decode rows; prefill: every row's ``q``)."""
        plan = self.engine.plan
        if plan.mode == "mixed":
            return x[0, :, plan.rows:].transpose(0, 1)
        return x.transpose(1, 2).reshape(-1, *x.shape[1:2], x.shape[-1])

    def decode_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The decode rows of a mixed iteration's attention input ``x [1, N, B + T, D]``: ``[B, N, 1, D]``."""
        return x[0, :, :self.engine.plan.rows].transpose(0, 1)[:, :, None]

    def attend_prefill(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """The chunks' queries ``q [T, H, D]`` over their rows' pages: ``[T, H, D]``; their statistics to the
        policy."""
        e = self.engine
        chunks, want, prefill = e.plan.chunks, e.feedback.wants, e.prefill_attention
        calls = prefill.calls(layer)
        out, lse = prefill.run(calls, q, scale)
        if layer not in prefill.planned:
            self.accessed(layer, calls)
        if "salience" in want:
            last = torch.tensor([c.offset + c.q_len - 1 for c in chunks], device=q.device)  # [R]
            for pids, sal in prefill.salience(calls, q[last], lse[last], scale):
                for stats in e.salience:
                    stats.add(layer, torch.from_numpy(pids).to(e.device), sal)
        rows = e.policy.attention_rows
        if e.attention and rows != 0:  # one row of the policy's window per query row, all calls' pages
            for i, c in enumerate(chunks):
                r = c.q_len if rows is None else min(rows, c.q_len)
                a = c.offset + c.q_len - r
                pos = torch.arange(c.start + c.q_len - r, c.start + c.q_len, device=q.device)
                parts = prefill.mass(calls, i, q[a:a + r], lse[a:a + r], pos, scale, layer)
                pids = torch.from_numpy(np.concatenate([p for p, _ in parts])).to(e.device)  # [n]
                for stats in e.attention:
                    stats.add(layer, pids, torch.cat([m for _, m in parts], 1))  # [r, n, N_kv]
        return out

    def attend_decode(self, layer: int, query: torch.Tensor, scale: float) -> torch.Tensor:
        """The decode rows' ``query [B, H, 1, D]`` of ``layer`` over the plan's (or the scope's) pages:
        ``[B, 1, H, D]``; its statistics to the feedback, its host reads to the recall cache."""
        e, plan = self.engine, self.engine.plan
        B, H, _, D = query.shape
        q = query[:, :, 0].contiguous()  # [B, H, D]
        table, lens = e.buffers.block_table[layer, :B], e.buffers.seq_lens[:B]  # [B, M], [B]
        view = self.view(B)
        if plan.lists is None:
            plan.lists = self.page_lists(view) if e.scope.query_free else {}
        choice = plan.lists[layer] if e.scope.query_free else e.scope.pick(layer, q, view)
        keys = choice.keys if isinstance(choice, KeyList) else None  # [B, N_kv, W] single keys
        picks = keys if keys is not None else choice  # [B, (N_kv,) K] the listed entries (None: every page)
        host, stage = self._far_pools(layer)
        budgeted = e.budget is not None and layer >= e.dense_layers
        stats = e.feedback.buffers(B, picks, H)
        if e.recall is not None:
            e.recall.wait(layer)  # its pages fetched ahead have landed
        landing = e.recall.landing(layer, B, picks.shape[-1]) if e.recall is not None and picks is not None else {}
        pool = e.table.tiers[0].pool(layer)
        launch = self.host_plan(layer, q, pool, scale) if e.kernel.can.host_plan else \
            self.launch(B, H, D, None if picks is None else picks.shape[-1], keys is not None)
        out, lse = e.kernel.decode(q, pool, host, table, lens, launch, scale,
                                   page_list=None if keys is not None else picks, key_list=keys,
                                   window_left=self.window_left(layer),
                                   spans=e.buffers.spans[:B] if budgeted and keys is None else None,
                                   stage_pool=stage, **stats, **landing)  # a key list shows its keys: no spans
        e.feedback.observe(layer, picks, lse, keys is not None)
        batch = self.admit_after.get(layer)
        if batch is not None and picks is not None:  # a batch of layers attended: their host reads into recall slots
            e.recall.admit(batch, e.feedback.group_pages(batch), e.buffers.block_table[batch.start:batch.stop, :B])
        if e.fidelity is not None:
            self.measure_fidelity(layer, q, out, lse, scale, view)
        return out[:, None]  # [B, 1, H, D]

    def _far_pools(self, layer: int) -> tuple:
        """``layer``'s pinned host pool and staging pool (None: none) the decode kernel reads off the device."""
        e = self.engine
        return (e.host.pool(layer) if e.host is not None else None,
                e.staging.pool(layer) if e.staging is not None else None)

    def page_lists(self, view: StepView) -> dict:
        """The page lists of every layer of a ``query_free`` scope, one batch of device ops per layer group."""
        lists = {}
        for layers in self.engine.groups:
            planned = self.engine.scope.plan(layers, view)  # [L', B, (N_kv,) K] or None
            lists.update({layer: None if planned is None else planned[i] for i, layer in enumerate(layers)})
        return lists

    def finish(self, B: int) -> None:
        """The step's batched tail, per layer group: the attended-page tally, the step's keys and queries into
        their statistics, the feedback's per-page statistics (once every layer has attended); the recall cache's
        copies joined."""
        e, buffers = self.engine, self.engine.buffers
        if not e.feedback.complete():
            if e.recall is not None:
                e.recall.join()
            return
        if e.keys is not None and self.step_keys:
            pos = buffers.positions[:B]
            pids = buffers.pid_table[:B].gather(1, (pos // e.layout.page_size)[:, None])[:, 0].long()  # [B]
            live = (buffers.seq_lens[:B] > 0) & (pids >= 0)  # idle rows of the bucket write nothing real
            e.keys.add_step(pids.clamp(min=0), torch.stack([self.step_keys[i] for i in sorted(self.step_keys)]),
                            live)
        if self.step_queries:
            e.queries.add_step(torch.stack([self.step_queries[i] for i in sorted(self.step_queries)]))
        for layers in e.groups:
            picks, keys = e.feedback.group_lists(layers)  # [L', B, (N_kv,) K] or None; of keys or pages
            table = buffers.block_table[layers.start:layers.stop, :B]  # [L', B, M]
            buffers.counts += self.tally(table, buffers.seq_lens[:B], picks, e.layout.page_size, keys)
            e.feedback.finish(layers, B, picks, self.visible_tokens(layers, B, picks, keys))
        if e.recall is not None:  # the recall copies of the step, on their side stream, end with it
            e.recall.join()
        self.drop_step()

    def drop_step(self) -> None:
        """Forget the step's page lists, keys and queries (a step done, or one an error left)."""
        self.engine.plan.lists, self.step_keys, self.step_queries, self.counts = None, {}, {}, None
        self.engine.feedback.drop_step()

    def visible_tokens(self, layers: range, B: int, picks: torch.Tensor | None, keys: bool = False) -> torch.Tensor:
        """Keys the step's query of each row sees in each of ``layers`` (a group), mean over rows (and kv-head
        lists): ``[L']``; ``keys``: the lists are key lists."""
        e = self.engine
        P = e.layout.page_size
        window = e.layout.window(layers[0])
        lens = e.buffers.seq_lens[:B].long()[:, None]  # [B, 1]
        if picks is None:
            seen = lens[:, 0].clamp(max=window) if window else lens[:, 0]
            return seen.float().mean().expand(len(layers))
        lists = picks.reshape(len(layers), B, -1).long()  # [L', B, (N_kv *) K]
        lo = (lens - window).clamp(min=0) if window else torch.zeros_like(lens)
        start, end = torch.maximum(lists * P, lo), torch.minimum(lists * P + P, lens)
        count = (end - start).clamp(min=0)
        if keys:  # each entry one key
            count = ((lists >= lo) & (lists < lens)).long()
        elif e.budget is not None and layers[0] >= e.dense_layers:  # the sinks and the window's keys, or whole
            sinks, win = (x[:, None] for x in e.buffers.spans[:B].long().unbind(1))
            middle = (lists >= -(-sinks // P)) & (lists < win // P)
            spans = (torch.minimum(end, sinks) - start).clamp(min=0) + (end - torch.maximum(start, win)).clamp(min=0)
            count = torch.where(middle, count, spans)
        count = count * (lists >= 0)
        return count.sum(-1).float().mean(-1) / (picks.shape[-2] if picks.dim() == 4 else 1)

    def view(self, B: int, host: bool = False) -> StepView:
        """What a scope reads of the step of ``B`` decode rows: the step's device buffers, or (``host``) the plan's
        host copies of them (no policy priority: a scope that reads it runs on the device)."""
        e, buffers, plan = self.engine, self.engine.buffers, self.engine.plan
        once = e.budget is not None and e.budget.mode == "once"
        rows = (buffers.block_table, buffers.seq_lens, buffers.spans, buffers.pid_table, buffers.priority) if not host \
            else (*map(torch.from_numpy, (plan.table, plan.lens, plan.spans, plan.pids)), None)
        return StepView(*rows, B, e.layout.page_size, e.budget, once, e.dense_layers, e.layout.sliding_windows)

    def host_plan(self, layer: int, q: torch.Tensor, pool: torch.Tensor, scale: float):
        """A backend's plan of ``layer``'s decode call of ``q [B, H, D]`` over ``pool`` made on the host
        (``kernel.can.host_plan``), from the pages each row lists: the scope's lists planned over the host's copy of
        the step's table, which the device's lists equal (once a step)."""
        e, plan = self.engine, self.engine.plan
        B, P = q.shape[0], e.layout.page_size
        if self.counts is None:
            n_pages = (plan.lens[:B] + P - 1) // P  # [B] every page
            self.counts = {i: n_pages if lists is None else (lists >= 0).sum(-1).numpy()
                           for i, lists in self.page_lists(self.view(B, host=True)).items()}
        shape = (q.shape[1], e.layout.num_kv_heads, q.shape[2], P)
        return e.kernel.plan_decode(self.counts[layer], plan.lens[:B], self.window_left(layer), shape, scale,
                                    (q.dtype, pool.dtype))

    def measure_fidelity(self, layer, q, out, lse, scale, view) -> None:
        """Attend every live page (uncounted) and record the scope's recall and error; its time goes to
        ``stats.fidelity_s`` so that TPOT leaves it out."""
        e = self.engine
        e._sync()
        t0 = time.perf_counter()
        B = q.shape[0]
        every = All()
        every.engine = e
        picks = every.pick(layer, q, dataclasses.replace(view, budget=None, once=False, dense_layers=0))  # [B, M]
        host, stage = self._far_pools(layer)
        out_all, lse_all = e.kernel.decode(q, e.table.tiers[0].pool(layer), host, e.buffers.block_table[layer, :B],
                                           e.buffers.seq_lens[:B], self.launch(B, q.shape[1], q.shape[2],
                                           None if picks is None else picks.shape[-1]), scale, page_list=picks,
                                           window_left=self.window_left(layer), stage_pool=stage)
        e.fidelity.add(layer, *attention_fidelity(out, lse, out_all, lse_all))
        e._sync()
        e.stats.fidelity_s += time.perf_counter() - t0

    def window_left(self, layer: int) -> int:
        """FlashInfer's ``window_left`` of ``layer`` (HF's sliding window W is W - 1; -1: global)."""
        window = self.engine.layout.window(layer)
        return window - 1 if window else -1

    def launch(self, B: int, H: int, D: int, listed: int | None, keys: bool = False):
        """The decode kernel's launch grid and work buffers for ``B`` rows of ``H`` heads of ``D`` dims over
        ``listed`` entries (None: every page), made once per shape."""
        from kvtier.kernels.triton_decode import plan_static_decode

        key = (B, H, listed, keys)
        if key not in self.launches:
            e = self.engine
            self.launches[key] = plan_static_decode(B, e.max_pages, H, e.layout.num_kv_heads, D,
                                                    e.layout.page_size, e.device, max_listed=listed,
                                                    kv_bytes=e.layout.kv_dtype.itemsize, keys=keys)
        return self.launches[key]

    def ahead(self, layer: int, hidden: torch.Tensor, rope: tuple) -> None:
        """Prediction ahead (the compact runner calls it in layer ``layer - 1``, at the predictor's point):
        ``layer``'s query estimated from ``hidden [B, 1, hidden]``, its pages chosen for the estimate and fetched
        into its recall slots."""
        e = self.engine
        self._prefetch(layer, e.predictor.query(e.runner, layer, hidden, rope))

    @torch.compiler.disable
    def _prefetch(self, layer: int, query: torch.Tensor) -> None:
        """The scope's choice of ``layer``'s pages for the estimated query ``[B, H, D]``, admitted ahead."""
        e = self.engine
        B = e.plan.rows
        picks = pages_of(e.scope.pick(layer, query.contiguous(), self.view(B)), e.max_pages, e.layout.page_size)
        if picks is not None:
            e.recall.prefetch(layer, picks, e.buffers.home[layer, :B], e.buffers.block_table[layer, :B])
