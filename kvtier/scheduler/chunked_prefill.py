"""ChunkedPrefill: how a long prompt is cut into chunks of at most ``chunk_size`` tokens (seed 001)."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.errors import ConfigError


@dataclass
class ChunkedPrefill:
    chunk_size: int = 512

    def __post_init__(self):
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ConfigError("scheduler.prefill.chunk_size",
                              f"must be a positive number of tokens, got {self.chunk_size!r}")

    def chunks(self, n_tokens: int) -> list[tuple[int, int]]:
        """``[(start, end), ...]`` covering ``range(n_tokens)``."""
        return [(s, min(s + self.chunk_size, n_tokens)) for s in range(0, n_tokens, self.chunk_size)]
