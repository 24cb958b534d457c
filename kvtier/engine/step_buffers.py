"""StepBuffers: the step's static device buffers, which a captured step reads in place.

The planner's :class:`~kvtier.engine.plan.StepPlan` is copied into them every step (:meth:`StepBuffers.upload`:
lengths, positions, spans, the block-table rows that changed); the decode kernels and the scopes read them
through :class:`~kvtier.scopes.base.StepView`; the forward writes the logits and greedy next tokens.
"""

from __future__ import annotations

import torch

from kvtier.engine.prefill import CAPTURE_TOKENS


class StepBuffers:
    """Device buffers of ``R`` rows for a step over the plan's host ``table [L, R, M]`` and ``pids [R, M]``.

    ``vocab``: the model's vocabulary (None: no model, no logits); ``priority_pids``: pids of the policy's priority
    a scope reads (None: none); ``overlay``: the recall cache writes its own block table over the host's."""

    def __init__(self, plan, vocab: int | None, priority_pids: int | None, overlay: bool, device: torch.device):
        R, L = plan.pids.shape[0], plan.table.shape[0]
        self.device = dev = device
        self.home = torch.from_numpy(plan.table).to(dev)  # [L, R, M] int32: where the host placed each page
        # [L, R, M] what attention reads (the recall overlay writes its own, never the host's copy)
        self.block_table = self.home.clone() if overlay else self.home
        self.pid_table = torch.from_numpy(plan.pids).to(dev)  # [R, M]
        self.seq_lens = torch.zeros(R, dtype=torch.int32, device=dev)  # [R] tokens incl. the one being fed
        self.positions = torch.zeros(R, dtype=torch.int64, device=dev)  # [R] position of the token fed
        self.tokens = torch.zeros(R, dtype=torch.int64, device=dev)  # [R] input, then the greedy next token
        self.logits = torch.zeros(R, vocab, device=dev) if vocab is not None else None  # [R, V]
        self.spans = torch.zeros(R, 2, dtype=torch.int32, device=dev)  # [R] (sinks, win_start) of the budget
        # [L, pids] the policy's priority of every pid, for scopes that choose by the policy
        self.priority = torch.zeros(L, priority_pids, dtype=torch.float64, device=dev) \
            if priority_pids is not None else None
        self.counts = torch.zeros(2, dtype=torch.int64, device=dev)  # attended pages, of which on the device
        self.vocab = vocab
        self._inputs: dict | None = None

    def upload(self, plan, no_overlay: bool) -> None:
        """Lengths, positions and spans every step; the block-table rows that changed (``plan.dirty``, cleared)."""
        lens = torch.from_numpy(plan.lens)
        self.seq_lens.copy_(lens, non_blocking=True)
        self.positions.copy_((lens - 1).clamp(min=0), non_blocking=True)
        self.spans.copy_(torch.from_numpy(plan.spans), non_blocking=True)
        if 2 * len(plan.dirty) > plan.lens.size:
            self.home.copy_(torch.from_numpy(plan.table), non_blocking=True)
            self.pid_table.copy_(torch.from_numpy(plan.pids), non_blocking=True)
        else:
            for r in plan.dirty:
                self.home[:, r].copy_(torch.from_numpy(plan.table[:, r]), non_blocking=True)
                self.pid_table[r].copy_(torch.from_numpy(plan.pids[r]), non_blocking=True)
        if no_overlay and self.block_table is not self.home:
            self.block_table.copy_(self.home)
        plan.dirty.clear()

    def iteration_inputs(self) -> dict:
        """Static inputs and outputs of captured iterations: chunk token ids and positions ``[CAPTURE_TOKENS]``, the
        kept token indices ``[2R]`` and their logits ``[2R, V]``."""
        if self._inputs is None:
            R, dev = self.tokens.shape[0], self.device
            self._inputs = {"ids": torch.zeros(CAPTURE_TOKENS, dtype=torch.int64, device=dev),
                            "pos": torch.zeros(CAPTURE_TOKENS, dtype=torch.int64, device=dev),
                            "keep": torch.zeros(2 * R, dtype=torch.int64, device=dev),
                            "logits": torch.zeros(2 * R, self.vocab, device=dev)}
        return self._inputs
