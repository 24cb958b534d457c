"""Model-free attention fidelity: how much of the exact attention a scope (resident, topk) keeps.

For one attention call, the scoped result ``(o, lse)`` over a subset of the keys and the exact
result ``(o_all, lse_all)`` over every key of the sequence give, with no attention matrix formed:

* attention-mass recall ``Σ_{k attended} softmax_all(q·k) = exp(lse - lse_all)`` per (row, head):
  the share of the exact attention probability that fell on the attended pages;
* output relative error ``‖o - o_all‖ / ‖o_all‖`` per row (over heads and head_dim).

:class:`FidelityStats` keeps one mean of each per attention call (layer, decode step) and sums
them up per run and per layer. The figures depend on the keys and queries only, not on the task.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


def attention_fidelity(out: torch.Tensor, lse: torch.Tensor, out_all: torch.Tensor,
                       lse_all: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Recall ``[N, H]`` and relative error ``[N]`` of a scoped call against the exact one.

    ``out``/``out_all``: ``[N, H, D]``; ``lse``/``lse_all``: ``[N, H]`` natural-log LSE.
    """
    recall = torch.exp(lse.float() - lse_all.float())  # [N, H]
    diff = (out.float() - out_all.float()).flatten(1).norm(dim=1)  # [N]
    ref = out_all.float().flatten(1).norm(dim=1).clamp_min(torch.finfo(torch.float32).tiny)  # [N]
    return recall, diff / ref


@dataclass
class FidelityStats:
    """Per attention call: ``(layer, mean recall, min recall, mean relative error)``."""

    calls: list = field(default_factory=list)

    def add(self, layer: int, recall: torch.Tensor, rel_err: torch.Tensor) -> None:
        r, e = recall.detach().float(), rel_err.detach().float()
        mean, low, err = torch.stack([r.mean(), r.min(), e.mean()]).tolist()  # one device-to-host copy
        self.calls.append((layer, mean, low, err))

    def summary(self) -> dict:
        """Run-level figures (empty when nothing was measured)."""
        if not self.calls:
            return {}
        layer, mean, low, err = (np.asarray(c) for c in zip(*self.calls))
        layers = np.unique(layer)
        return {"attention_mass_recall": float(mean.mean()),
                "attention_mass_recall_p10": float(np.percentile(mean, 10)),
                "attention_mass_recall_min": float(low.min()),
                "attention_rel_err": float(err.mean()),
                "attention_rel_err_p90": float(np.percentile(err, 90)),
                "fidelity_calls": len(self.calls),
                "attention_mass_recall_per_layer": [float(mean[layer == i].mean()) for i in layers],
                "attention_rel_err_per_layer": [float(err[layer == i].mean()) for i in layers]}
