"""Prediction ahead for the recall cache (:class:`~kvtier.scopes.recall.RecallCache`): a layer's pages chosen
before the layer runs, so that those on the host are copied into its recall slots on a side stream while the
layer before it computes.

A predictor estimates the query the layer will have; the scope then chooses the layer's pages for that estimate
as it will for the real query (Quest's bounds), and the recall cache admits the chosen pages read from the host.
When the layer runs it chooses again with its real query: a page predicted right is read from HBM, a page
predicted wrong costs a copy and nothing else (the layer reads a missed page in place from the host, as without
prediction). The engine counts the pages fetched ahead and those the layer then picked. Decode steps only (an
iteration with prompt chunks fetches nothing ahead); the first layer has no layer before it.
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
