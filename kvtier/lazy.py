"""Lazy package exports: a package names what it exports and the module each name comes from, and imports that
module on first use (PEP 562), so importing a light part of kvtier (the simulator, the trace reader) does not pay
for torch and transformers. ``dir()``, ``__all__`` and ``from package import name`` stay as with eager imports.
"""

from __future__ import annotations

import importlib
import sys
import types


class LazyPackage(types.ModuleType):
    """A package module whose exports (``_exports``: name -> module) are imported when first looked up."""

    _exports: dict[str, str]

    def __getattr__(self, name: str):  # only reached when ``name`` is not yet in the package's namespace
        module = self._exports.get(name)
        if module is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(self, name, value)
        return value

    def __dir__(self) -> list[str]:
        return sorted(set(self.__dict__) | set(self._exports))

    def __setattr__(self, name: str, value) -> None:
        # The import system binds each submodule it loads on its package: an export named like the submodule it
        # comes from (kvtier.offload, the function of kvtier/offload.py) keeps the export, as an eager import did.
        if isinstance(value, types.ModuleType) and self._exports.get(name) == value.__name__:
            value = getattr(value, name)
        super().__setattr__(name, value)


def lazy_exports(package: str, exports: dict[str, tuple[str, ...]]) -> None:
    """Make ``package`` (its ``__name__``) export each name of ``exports`` (module -> names) on first use; sets
    ``__all__``."""
    module = sys.modules[package]
    flat = {name: source for source, names in exports.items() for name in names}
    module.__all__ = sorted(flat)
    module._exports = flat
    module.__class__ = LazyPackage
