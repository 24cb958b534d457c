"""Benchmarks that score a model's greedy answer to long prompts (RULER, LongBench, InfiniteBench, the needle sweep).

A task lists its :class:`Sample` s (each prompt tokenized, its references, its group: RULER's subtask, LongBench's
dataset) before anything runs, then :meth:`AnswerTask.run_with` sends each through ``generate(ids, prefill_tokens,
max_new_tokens, stop)``: a fresh kvtier engine (:func:`engine_generate`) or any other generator (kvpress's presses,
``kvtier/eval/kvpress.py``). The answer is cut at the first stop token, decoded and scored by the benchmark's own
metric on its own scale (0-100); the result has the score per group and their mean (``score``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, ClassVar, Iterator

import numpy as np
import torch

from kvtier.checks import check_positions
from kvtier.errors import ConfigError, partial_on_stop
from kvtier.eval.perplexity import progress_task

if TYPE_CHECKING:  # the engine imports kvtier.eval.fidelity
    from kvtier.engine import Engine


@dataclass
class Sample:
    """One prompt: ``ids [S]`` (the whole prompt, its question last), the references its answer is scored
    against, its group, how many tokens to generate, and what to keep beside its score."""

    group: str
    ids: torch.Tensor
    refs: list
    max_new_tokens: int
    info: dict = field(default_factory=dict)


def greedy(engine: Engine, ids: torch.Tensor, max_new_tokens: int, prefill_tokens: int | None = None,
           stop: frozenset = frozenset()) -> list[int]:
    """Greedy continuation of the prompt ``ids [S]`` (at most ``max_new_tokens`` ids, ending at the first id in
    ``stop``). With ``prefill_tokens`` only the first that many are prefilled; the rest (a question asked after
    the context was compressed) are fed one decode step each, under the engine's budget."""
    S = int(ids.numel())
    n = S if prefill_tokens is None else prefill_tokens
    seq = engine.open(S + max_new_tokens)
    logits = engine.prefill_sequence(seq, ids[:n])[-1]  # [V]
    engine.start_decode(seq, ids[n] if n < S else logits.argmax())
    row = engine.row_seq.index(seq)
    for i in range(n, S):
        logits = engine.step({seq: int(ids[i])})[row]
    out = [int(logits.argmax())]
    while len(out) < max_new_tokens and out[-1] not in stop:
        out.append(int(engine.step({seq: out[-1]})[row].argmax()))
    engine.feedback.take(upto=engine.step_idx)
    return out


def engine_generate(make_engine: Callable[[], Engine], task) -> Callable:
    """``generate(ids, prefill_tokens, max_new_tokens, stop) -> (ids, {"tier1_hit_rate"})``: each prompt through a
    fresh engine from ``make_engine``, checked against the model's positions first."""
    def generate(ids: torch.Tensor, prefill_tokens: int, max_new_tokens: int, stop: frozenset = frozenset()):
        engine = make_engine()
        check_positions(task, engine.model.config)
        try:
            out = greedy(engine, ids, max_new_tokens, prefill_tokens=prefill_tokens, stop=stop)
            return out, {"tier1_hit_rate": engine.hit_rate()}
        finally:
            engine.close()
    return generate


def cut_at_stop(out: list[int], stop: frozenset) -> list[int]:
    """``out`` up to (without) its first id in ``stop``."""
    return next((out[:i] for i, t in enumerate(out) if t in stop), out)


def stop_ids(tokenizer, newline: bool = False) -> frozenset:
    """The ids that end an answer: the tokenizer's EOS (and ``\\n`` with ``newline``, as LongBench's samsum)."""
    ids = {tokenizer.eos_token_id} - {None}
    if newline:
        ids.add(tokenizer("\n", add_special_tokens=False)["input_ids"][-1])
    return frozenset(ids)


def _mean(values) -> float:
    return float(np.mean(values)) if len(values) else float("nan")


class AnswerTask:
    """Base of the benchmark tasks (dataclasses): :meth:`samples` and :meth:`score` are theirs; ``length`` (their
    recipe key, ``context_key``) bounds each prompt in tokens. Generated tokens come on top, up to ``new_tokens``."""

    name: ClassVar[str] = "answer"
    context_key: ClassVar[str] = "length"
    question_tokens: ClassVar[int] = 0  # the question is inside the prompt (prefilled with the context)

    @property
    def context_tokens(self) -> int:
        return self.length

    @property
    def new_tokens(self) -> int:
        raise NotImplementedError

    def samples(self, tokenizer) -> Iterator[Sample]:
        raise NotImplementedError

    def score(self, output: str, sample: Sample) -> float:
        """The answer's score in [0, 100] by the benchmark's metric."""
        raise NotImplementedError

    def stop(self, tokenizer, sample: Sample) -> frozenset:
        return stop_ids(tokenizer)

    def skipped(self) -> dict[str, str]:
        """Groups asked for that cannot run here, each with a one-line reason (a dataset not in the cache)."""
        return {}

    def check_length(self, ids: list[int], what: str) -> None:
        if len(ids) > self.length:
            raise ConfigError(f"task.{self.context_key}", f"{what} needs {len(ids)} tokens, more than "
                                                          f"{self.context_key}={self.length}; raise it")

    def run(self, make_engine: Callable[[], Engine], tokenizer, progress=None) -> dict:
        """Every sample through a fresh engine from ``make_engine`` (greedy)."""
        return self.run_with(engine_generate(make_engine, self), tokenizer, progress)

    @torch.no_grad()
    def run_with(self, generate, tokenizer, progress=None) -> dict:
        """Score every sample's answer from ``generate(ids [S], prefill_tokens, max_new_tokens, stop) -> (ids,
        extra)``; ``extra`` joins the sample's record."""
        samples = list(self.samples(tokenizer))  # every prompt made (and checked) before the first runs
        advance = progress_task(progress, f"{self.name} ({self.length} tok)", len(samples))
        records = []
        with partial_on_stop(lambda: self._result(records)):
            for s in samples:
                stop = self.stop(tokenizer, s)
                out, extra = generate(s.ids, s.ids.numel() - self.question_tokens, s.max_new_tokens, stop)
                text = tokenizer.decode(cut_at_stop(out, stop), skip_special_tokens=True)
                records.append({"group": s.group, "score": self.score(text, s), "output": text, "refs": s.refs,
                                "prompt_tokens": int(s.ids.numel()), **extra, **s.info})
                advance()
        return self._result(records)

    def _result(self, records: list[dict]) -> dict:
        """The mean score per group over the finished ``records`` and the mean over groups (``score``), the
        groups skipped with their reasons, the tier-1 hit rate over the records that have one."""
        groups = {g: _mean([r["score"] for r in records if r["group"] == g]) for g in dict.fromkeys(
            r["group"] for r in records)}
        return {"task": self.name, "score": _mean([v for v in groups.values() if not math.isnan(v)]),
                "per_group": groups, "skipped": self.skipped(), "samples": len(records),
                "context_tokens": _mean([r["prompt_tokens"] for r in records]),
                "tier1_hit_rate": _mean([r["tier1_hit_rate"] for r in records if "tier1_hit_rate" in r]),
                "records": records}
