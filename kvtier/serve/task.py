"""ServeTrace: the ``serve_trace`` experiment's task. Replays a slice of a Mooncake trace through the
request scheduler on the engine the recipe builds (its model, tiers, policy, scope, kernel, scheduler)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvtier.errors import ConfigError
from kvtier.eval.perplexity import check_int
from kvtier.serve.replay import SLO, replay, trace_requests
from kvtier.serve.scheduler import PREEMPT_MODES, ServeScheduler
from kvtier.serve.trace import BLOCK, load_trace


@dataclass
class ServeTrace:
    """Requests ``start .. start + requests`` of ``trace``, arrivals divided by ``time_scale``, each hash
    block shrunk to ``block_tokens`` tokens (512: the trace's own lengths), served with a per-iteration
    ``token_budget``, up to ``max_batch`` rows, prefix reuse (``prefix_cache``) and preemption
    (``preempt``, ``swap_tokens``: :mod:`kvtier.serve.scheduler`); scored by goodput under the SLOs."""

    trace: str = "conversation"
    start: int = 0
    requests: int = 8
    time_scale: float = 1.0
    block_tokens: int = 16
    max_context: int = 1024  # per request: prompts are cut so that prompt + output fit
    max_batch: int = 4
    token_budget: int = 256
    prefix_cache: bool = True
    preempt: str = "auto"
    swap_tokens: int = 0
    slo_ttft_ms: float = 250.0
    slo_itl_ms: float = 12.0
    name: ClassVar[str] = "serve_trace"
    context_key: ClassVar[str] = "max_context"
    new_tokens: ClassVar[int] = 0  # outputs count inside max_context

    @property
    def context_tokens(self) -> int:
        return self.max_context

    def __post_init__(self):
        check_int("start", self.start, 0)
        check_int("requests", self.requests, 1)
        check_int("block_tokens", self.block_tokens, 1, BLOCK)
        check_int("max_context", self.max_context, 2)
        check_int("max_batch", self.max_batch, 1)
        check_int("token_budget", self.token_budget, self.max_batch + 1)
        check_int("swap_tokens", self.swap_tokens, 0)
        if self.preempt not in PREEMPT_MODES:
            raise ConfigError("task.preempt", f"use one of {PREEMPT_MODES}, got {self.preempt!r}")
        if not (self.time_scale > 0 and self.slo_ttft_ms > 0 and self.slo_itl_ms > 0):
            raise ConfigError("task", "time_scale, slo_ttft_ms and slo_itl_ms must be > 0")
        self.slice = load_trace(self.trace, self.time_scale, self.start, self.requests)

    def run(self, make_engine, tokenizer, progress=None) -> dict:
        engine = make_engine(max_batch=self.max_batch, max_context=self.max_context)
        sched = ServeScheduler(engine, self.token_budget, self.prefix_cache, self.preempt, self.swap_tokens)
        reqs = trace_requests(self.slice, engine.model.config.vocab_size, self.block_tokens, self.max_context)
        bar = progress.add_task("serve", total=len(reqs)) if progress is not None else None
        tick = (lambda: progress.advance(bar)) if bar is not None else None
        out = replay(sched, reqs, SLO(self.slo_ttft_ms / 1000, self.slo_itl_ms / 1000), tick)
        return {"task": self.name, "goodput_rps": out["goodput_rps"], "samples": len(reqs),
                "context_tokens": self.max_context, "decode_hit_rate": engine.hit_rate(), **out}
