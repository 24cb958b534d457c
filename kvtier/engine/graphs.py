"""StepGraphs: CUDA-graph capture and replay of steps.

A decode step is captured once per batch bucket; an iteration with prompt chunks whose every page is on the
device once per (decode rows, token bucket, prefill tiles). A capture runs the step once on a side stream (Triton
compiles, cuBLAS picks kernels), captures it, and puts back the device state the warm-up advanced; a replay reads
the step's static buffers (:class:`~kvtier.engine.step_buffers.StepBuffers`) the planner filled.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.engine.prefill import CAPTURE_TOKENS

TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, CAPTURE_TOKENS)  # chunk tokens a captured iteration is padded to


class StepGraphs:
    """The CUDA graphs of ``engine``'s steps; ``buckets``: the decode batch sizes a step's rows are padded to."""

    def __init__(self, engine, buckets: tuple[int, ...]):
        self.engine = engine
        self.buckets = buckets
        self.graphs: dict = {}  # decode bucket, or ("iteration", rows, tokens, tiles, version) -> CUDAGraph

    def clear(self) -> None:
        """Capture again at next use (what the captured steps list changed)."""
        self.graphs.clear()

    def token_bucket(self, T: int, all_logits: bool) -> int | None:
        """The padded token count of an iteration with ``T`` chunk tokens, if it can be captured (when every page
        it reads is on the device). Its per-layer work must be device work only: no per-token logits, no key /
        query / attention statistics of the chunks, 16/32-bit pages, the Triton kernel and a scratch slot for the
        padding."""
        e = self.engine
        capturable = bool(e.graphs) and not all_logits and e.keys is None and not e.feedback.wants and \
            "queries" not in e.policy.needs and not e.layout.scaled and e.config.max_batch > 1 and \
            e.prefill_attention.triton
        return next((b for b in TOKEN_BUCKETS if b >= T), None) if capturable else None

    def iteration(self, ids: list[torch.Tensor], pos: torch.Tensor, keep: np.ndarray, B: int) -> torch.Tensor:
        """Replay an iteration padded to its token bucket: the chunk tokens ``ids`` (each ``[q]``) at positions
        ``pos [T]`` into the static inputs, the kept tokens ``keep [k]``; their logits ``[k, V]``."""
        e = self.engine
        R, T, Tb = e.config.max_batch, int(pos.numel()), e.prefill_attention.tokens
        inputs = e.buffers.iteration_inputs()
        inputs["ids"][:Tb].copy_(torch.nn.functional.pad(torch.cat(ids), (0, Tb - T)))
        inputs["pos"][:Tb].copy_(torch.nn.functional.pad(pos, (0, Tb - T)), non_blocking=True)
        inputs["keep"][:B + R].copy_(torch.from_numpy(np.pad(keep, (0, B + R - keep.size))), non_blocking=True)
        self.replay(("iteration", B, Tb, e.prefill_attention.shape(), e.prefill_attention.version),
                    lambda: self._captured_iteration(B, Tb))
        return inputs["logits"][:keep.size].clone()

    def _captured_iteration(self, B: int, Tb: int) -> None:
        e = self.engine
        inputs, R, buffers = e.buffers.iteration_inputs(), e.config.max_batch, e.buffers
        row = torch.cat([buffers.tokens[:B], inputs["ids"][:Tb]])[None]  # [1, B + Tb]
        positions = torch.cat([buffers.positions[:B], inputs["pos"][:Tb]])[None]
        inputs["logits"][:B + R] = e.forward.iteration(row, positions, inputs["keep"][:B + R], B)

    def replay(self, key, work) -> None:
        """Replay the CUDA graph of ``key`` (a decode bucket, or an iteration's rows and token bucket), captured from
        ``work`` at its first use."""
        graph = self.graphs.get(key)
        if graph is None:
            saved = [t.clone() for t in self.state()]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                work()  # warm-up: Triton compiles, cuBLAS picks kernels
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                work()
            self.graphs[key] = graph
            recall = self.engine.recall
            warm = recall.page.clone() if recall is not None else None
            for t, before in zip(self.state(), saved):  # the warm-up step did not happen
                t.copy_(before)
            if warm is not None:  # but its admissions wrote pages into recall slots: those slots are emptied
                recall.page.masked_fill_(warm != recall.page, -1)
        graph.replay()

    def state(self) -> list[torch.Tensor]:
        """Device state a step advances besides the pages: input tokens, counters, statistics, the recall cache."""
        e = self.engine
        state = [e.buffers.tokens, e.buffers.counts, *e.feedback.state()]
        for stats in [*e.attention, *e.salience]:
            state += stats.tensors()
        if e.keys is not None:
            state += e.keys.tensors()
        if e.queries is not None:
            state += [e.queries.ring, e.queries.seen]
        if getattr(e.scope, "recent", None) is not None:
            state += [e.scope.recent, e.scope.seen]
        if e.recall is not None:
            state += e.recall.tensors()
        return state
