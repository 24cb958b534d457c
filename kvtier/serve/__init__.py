"""Serving on the engine: request scheduler (over the engine's radix prefix cache, :mod:`kvtier.radix`), trace replay.

Each name is imported on first use (:mod:`kvtier.lazy`): the trace reader (:mod:`kvtier.serve.trace`) needs no torch.
"""

from kvtier.lazy import lazy_exports

lazy_exports(__name__, {"kvtier.serve.scheduler": ("Request", "ServeScheduler"), "kvtier.serve.task": ("ServeTrace",)})
