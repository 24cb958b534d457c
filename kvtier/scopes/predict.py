"""Prediction ahead for the recall cache (:class:`~kvtier.scopes.recall.RecallCache`): a predictor estimates the
query a layer will have, the scope chooses that layer's pages for the estimate (Quest's bounds) and the recall cache
copies those on the host into its slots on a side stream while the layer before computes. The layer then chooses
again with its real query: a page predicted wrong costs a copy and nothing else. Decode steps only; the engine
counts the pages fetched ahead and those the layer then picked.
"""

from __future__ import annotations

import torch

from kvtier.errors import ConfigError


class NextLayerQuery:
    """InfiniGen's estimate (Lee et al., OSDI 2024, arXiv:2406.19707): layer ``l``'s query from the hidden state
    entering layer ``l - 1``, through layer ``l``'s own input norm, query projection and rotary embedding. The
    residual stream changes little from one layer to the next, so the estimate's bounds rank pages much as the
    real query's do. Costs one query projection per layer (InfiniGen keeps a few of its columns); the copy has the
    whole of layer ``l - 1`` to hide behind."""

    name = "next_layer"
    point = "layer_input"  # where the runner hands the hidden state: entering layer l - 1

    def query(self, runner, layer: int, hidden: torch.Tensor, rope: tuple) -> torch.Tensor:
        """``hidden [B, 1, hidden]`` (at :attr:`point` of layer ``layer - 1``) -> layer ``layer``'s estimated query
        ``[B, H, D]``."""
        return runner.layer_query(layer, hidden, rope)[:, :, -1]


class AfterAttentionQuery(NextLayerQuery):
    """The same estimate from the residual stream after layer ``l - 1``'s attention: one step closer to layer
    ``l``'s input, so more of its picks are right, but the copy hides behind layer ``l - 1``'s MLP only."""

    name = "after_attention"
    point = "after_attention"


PREDICTORS = {p.name: p for p in (NextLayerQuery, AfterAttentionQuery)}
POINTS = ("layer_input", "after_attention")


def make_predictor(spec):
    """A predictor from its name (:data:`PREDICTORS`), an object with ``query(runner, layer, hidden, rope)`` and a
    ``point`` of :data:`POINTS`, or None."""
    if spec is None:
        return None
    if not hasattr(spec, "query"):
        if spec not in PREDICTORS:
            raise ConfigError("scope.predictor", f"unknown predictor {spec!r}; use one of {sorted(PREDICTORS)} or "
                                                 "null")
        spec = PREDICTORS[spec]()
    if getattr(spec, "point", None) not in POINTS:
        raise ConfigError("scope.predictor", f"a predictor's point must be one of {list(POINTS)}, got "
                                             f"{getattr(spec, 'point', None)!r}")
    return spec
