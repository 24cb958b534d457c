"""Engine: chunked prefill, then decode steps, of a HF causal LM over a TieredKVCache.

After every step the cache hands salience to the policy and the scheduler issues migrations
(see :mod:`kvtier.cache`). The engine times each step: TTFT is the whole prefill (up to the first
token's logits), TPOT one decode step; on a GPU both are synchronised wall times. Time the cache
spends in its fidelity pass (``cache.fidelity``, a measurement) is left out of both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvtier.cache import TieredKVCache
from kvtier.hook import use_hook
from kvtier.metrics import percentile, synchronize
from kvtier.scheduler.chunked_prefill import ChunkedPrefill


@dataclass
class Engine:
    model: torch.nn.Module
    prefill: ChunkedPrefill = field(default_factory=ChunkedPrefill)
    ttft_s: list = field(default_factory=list)
    tpot_s: list = field(default_factory=list)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def forward(self, cache: TieredKVCache, ids: torch.Tensor) -> torch.Tensor:
        """One step: ``ids [B, q]`` -> logits ``[B, q, V]`` (float32), the model's attention through the hook."""
        use_hook(self.model)
        cache.next_reserve = 1
        out = self.model(input_ids=ids.to(self.device), past_key_values=cache, use_cache=True)
        return out.logits.float()

    def run_prefill(self, cache: TieredKVCache, ids: torch.Tensor) -> torch.Tensor:
        """Prefill ``ids [B, S]`` chunk by chunk; returns the logits ``[B, S, V]`` of every position."""
        synchronize(self.device)
        t0, measuring = time.perf_counter(), cache.stats.fidelity_s
        logits = []
        chunks = self.prefill.chunks(ids.shape[1])
        for a, b in chunks:
            logits.append(self.forward(cache, ids[:, a:b]))
        cache.end_prefill()  # a budget with exact_prefill / mode "once" starts here
        synchronize(self.device)
        self.ttft_s.append(time.perf_counter() - t0 - (cache.stats.fidelity_s - measuring))
        return torch.cat(logits, dim=1)

    def decode_step(self, cache: TieredKVCache, token: torch.Tensor) -> torch.Tensor:
        """One decode step for ``token [B, 1]``: logits ``[B, V]``."""
        synchronize(self.device)
        t0, measuring = time.perf_counter(), cache.stats.fidelity_s
        logits = self.forward(cache, token)[:, -1]
        synchronize(self.device)
        self.tpot_s.append(time.perf_counter() - t0 - (cache.stats.fidelity_s - measuring))
        return logits

    def greedy(self, cache: TieredKVCache, ids: torch.Tensor, max_new_tokens: int,
               prefill_tokens: int | None = None) -> torch.Tensor:
        """Greedy continuation ``[B, max_new_tokens]`` of the prompt ``ids [B, S]``. With
        ``prefill_tokens`` only the first that many are prefilled; the rest (a question asked after
        the context was compressed) are fed one decode step each, under the cache's budget."""
        n = ids.shape[1] if prefill_tokens is None else prefill_tokens
        logits = self.run_prefill(cache, ids[:, :n])[:, -1]  # [B, V]
        for i in range(n, ids.shape[1]):
            logits = self.decode_step(cache, ids[:, i:i + 1])
        token = logits.argmax(-1, keepdim=True)  # [B, 1]
        out = [token]
        for _ in range(max_new_tokens - 1):
            token = self.decode_step(cache, token).argmax(-1, keepdim=True)
            out.append(token)
        cache.finish_step()
        return torch.cat(out, dim=1).cpu()

    def latency(self) -> dict:
        return {"ttft_s": self.ttft_s[-1] if self.ttft_s else float("nan"),
                "tpot_p50_s": percentile(self.tpot_s, 50), "tpot_p99_s": percentile(self.tpot_s, 99),
                "decode_steps": len(self.tpot_s)}
