"""Attention scopes: which pages each row attends in a decode step, chosen on the device.

``all`` (:class:`All`, exact), ``resident`` (:class:`Resident`, the device pages; under a token budget the
policy's best of them) and ``topk`` (:class:`TopK`, Quest's bound). A user's own scope is a
:class:`Scope` subclass named by ``_target_`` in a recipe (``scope._target_=...``).
"""

from kvtier.errors import ConfigError
from kvtier.scopes.base import DROPPED, Scope, StepView
from kvtier.scopes.simple import All, Resident
from kvtier.scopes.topk import TopK

SCOPES = {"all": All, "resident": Resident, "topk": TopK}


def make_scope(scope) -> Scope:
    """A :class:`Scope` from an instance or one of the names in :data:`SCOPES`."""
    if isinstance(scope, Scope):
        return scope
    if scope not in SCOPES:
        raise ConfigError("scope", f"unknown scope {scope!r}; use one of {list(SCOPES)} or a kvtier.scopes.Scope")
    return SCOPES[scope]()


__all__ = ["All", "DROPPED", "Resident", "SCOPES", "Scope", "StepView", "TopK", "make_scope"]
