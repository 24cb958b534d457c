"""EngineConfig: the engine's own settings (the recipe group ``engine``)."""

from dataclasses import dataclass
from typing import List, Optional

from kvtier.errors import ConfigError
from kvtier.engine.runner import RUNNERS


@dataclass
class EngineConfig:
    """How the engine runs a step (what it computes is the scope's, the budget's and the policy's).

    ``max_batch``: rows decoded together; ``max_context``: tokens per sequence (None: what the tiers
    hold); ``buckets``: batch sizes captured (None: powers of two up to ``max_batch``); ``graphs``: replay
    each decode step, and each iteration with prompt chunks whose pages are in HBM, as a CUDA graph (None: on a
    GPU, unless fidelity is measured); ``compile``:
    ``torch.compile`` the small ops between attention calls (None: on a GPU): decode steps per bucket,
    iterations with prompt chunks once for every token count; ``lookahead``: the
    policy hears step ``t``'s statistics before step ``t + lookahead`` is planned (1: before the next,
    the host waits for each step; 2: the host plans a step while the GPU runs the one before; 0: the
    policy hears nothing); ``runner``: ``auto`` (the compact Llama-family forward where it applies),
    ``hf`` (the model's own forward) or ``llama``; ``sync_timing``: synchronise around each step so
    that TTFT/TPOT are exact wall times (a benchmark that times with events turns it off).
    """

    max_batch: int = 1
    max_context: Optional[int] = None
    buckets: Optional[List[int]] = None
    graphs: Optional[bool] = None
    compile: Optional[bool] = None
    lookahead: int = 1
    runner: str = "auto"
    sync_timing: bool = True

    def __post_init__(self):
        for key, low in (("max_batch", 1), ("lookahead", 0)):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ConfigError(f"engine.{key}", f"must be an integer >= {low}, got {v!r}")
        if self.max_context is not None and (not isinstance(self.max_context, int) or self.max_context < 2):
            raise ConfigError("engine.max_context", f"must be an integer >= 2 or null, got {self.max_context!r}")
        if self.buckets is not None:
            self.buckets = tuple(self.buckets)
            if not self.buckets or any(not isinstance(b, int) or b < 1 or b > self.max_batch for b in self.buckets):
                raise ConfigError("engine.buckets", f"batch sizes in [1, max_batch={self.max_batch}], got "
                                                    f"{list(self.buckets)}")
        for key in ("graphs", "compile", "sync_timing"):
            v = getattr(self, key)
            if v is not None and not isinstance(v, bool):
                raise ConfigError(f"engine.{key}", f"must be true, false{' or null' if key != 'sync_timing' else ''}, "
                                                   f"got {v!r}")
        if self.runner not in RUNNERS:
            raise ConfigError("engine.runner", f"unknown runner {self.runner!r}; use one of {list(RUNNERS)}")
