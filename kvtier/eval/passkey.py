"""Passkey retrieval: a five-digit key planted at a given depth of repetitive filler, asked for at
the end (the Landmark-Attention / LongLoRA test). Exact match of the number the model answers.

The prompt (the same for every policy and scope) is, by default, the original plain format::

    <intro> <filler ... needle ... filler>\\n<question> The pass key is

so the model's first tokens are the key (``chat_template=True`` wraps the same parts in the
tokenizer's chat template instead). The filler is whole sentences, as many as fit in
``context_tokens``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar

import numpy as np
import torch

from kvtier.data import prompt_ids
from kvtier.errors import ConfigError, partial_on_stop
from kvtier.eval.generation import engine_generate
from kvtier.eval.perplexity import check_int, progress_task

if TYPE_CHECKING:  # the engine imports kvtier.eval.fidelity
    from kvtier.engine import Engine

FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
_PLACEHOLDER = "\x00HAYSTACK\x00"
QUESTION_PLACEMENTS = ("inside", "after")


def check_depths(depths) -> tuple[float, ...]:
    """Depths as a tuple of floats in [0, 1]; ConfigError("task.depths") otherwise."""
    try:
        values = tuple(float(d) for d in depths)
    except (TypeError, ValueError):
        raise ConfigError("task.depths", f"must be a list of fractions in [0, 1], got {depths!r}") from None
    if not values or any(not 0.0 <= d <= 1.0 for d in values) or any(isinstance(d, bool) for d in depths):
        raise ConfigError("task.depths", f"must be a non-empty list of fractions in [0, 1], got {depths!r}")
    return values


@dataclass
class RetrievalTask:
    """Shared fields and machinery of passkey and needle: prompt building, fitting to a length,
    scoring runs. Subclasses (dataclasses) implement :meth:`cases` and :meth:`score`.
    """

    context_tokens: int = 4096
    depths: tuple = (0.1, 0.5, 0.9)
    samples: int = 1  # cases per depth
    seed: int = 0
    max_new_tokens: int = 10
    chat_template: bool = False
    question_at: str = "inside"  # inside: prefilled with the context; after: fed token by token once it is in
    name: ClassVar[str] = "retrieval"
    intro: ClassVar[str] = ""
    min_context: ClassVar[int] = 128
    question_sep: ClassVar[str] = "\n"  # between the haystack and the question (plain format)
    context_key: ClassVar[str] = "context_tokens"

    @property
    def new_tokens(self) -> int:
        return self.max_new_tokens

    def __post_init__(self):
        check_int("context_tokens", self.context_tokens, self.min_context)
        self.depths = check_depths(self.depths)
        check_int("samples", self.samples, 1)
        check_int("seed", self.seed, 0)
        check_int("max_new_tokens", self.max_new_tokens, 1, 256)
        if not isinstance(self.chat_template, bool):
            raise ConfigError("task.chat_template", f"must be true or false, got {self.chat_template!r}")
        if self.question_at not in QUESTION_PLACEMENTS:
            raise ConfigError("task.question_at",
                              f"must be one of {list(QUESTION_PLACEMENTS)}, got {self.question_at!r}")

    # -- prompts -------------------------------------------------------------------------------
    def template(self, tokenizer, question: str, answer_prefix: str) -> tuple[str, str]:
        """The prompt text before and after the haystack.

        Plain (the default; the Landmark-Attention format):
        ``<intro> <haystack><question_sep><question> <answer_prefix>``.
        Chat: the tokenizer's chat template, user turn ``<intro>, <haystack>, <question>`` (blank lines between),
        assistant turn opened with ``<answer_prefix>``. SmolLM2-135M-Instruct answers the plain form
        (9/9 passkeys at 4k) but drifts off in the chat form (0/3), so plain is the default.
        """
        if not self.chat_template:
            return f"{self.intro} ", f"{self.question_sep}{question} {answer_prefix}".rstrip()
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("task.chat_template", "the tokenizer has no chat template; set chat_template: false")
        user = f"{self.intro}\n\n{_PLACEHOLDER}\n\n{question}"
        text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                             add_generation_prompt=True)
        before, after = text.split(_PLACEHOLDER)
        return before, after + answer_prefix

    def fit(self, tokenizer, before: str, after: str, haystack: Callable[[int], str], max_units: int):
        """The longest prompt ``before + haystack(n) + after`` of at most ``context_tokens`` tokens
        (binary search over the number of haystack units ``n``): ``(ids LongTensor [S], n)``. With
        ``question_at="after"`` the two parts are tokenized apart (the split is a token boundary) and
        ``self.question_tokens`` holds the length of the second. The prompt starts with the model's BOS where its
        tokenizer adds one (:func:`kvtier.data.prompt_ids`)."""
        tail = tokenizer(after, add_special_tokens=False, verbose=False)["input_ids"]
        self.question_tokens = len(tail) if self.question_at == "after" else 0

        def encode(n):
            if self.question_at == "after":
                return prompt_ids(tokenizer, before + haystack(n)) + tail
            return prompt_ids(tokenizer, before + haystack(n) + after)

        lo, hi = 0, max_units
        if len(encode(0)) > self.context_tokens:
            raise ConfigError("task.context_tokens", f"{self.context_tokens} tokens do not even hold the question; "
                                                     f"use at least {len(encode(0)) + 64}")
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(encode(mid)) <= self.context_tokens:
                lo = mid
            else:
                hi = mid - 1
        return torch.tensor(encode(lo), dtype=torch.long), lo

    # -- running -------------------------------------------------------------------------------
    def cases(self, tokenizer, rng: np.random.Generator):
        """Yields ``(depth, ids [S], expected, info dict)`` for every sample."""
        raise NotImplementedError

    def score(self, output: str, expected: str) -> bool:
        raise NotImplementedError

    def run(self, make_engine: Callable[[], Engine], tokenizer, progress=None) -> dict:
        """Every case through a fresh engine from ``make_engine`` (greedy, :func:`kvtier.eval.generation.greedy`)."""
        return self.run_with(engine_generate(make_engine, self), tokenizer, progress)

    @torch.no_grad()
    def run_with(self, generate, tokenizer, progress=None) -> dict:
        """Score every case's answer from ``generate(ids [S], prefill_tokens, max_new_tokens) -> (ids, extra)``
        (the first ``prefill_tokens`` prefilled, the question after them fed later); ``extra`` joins the record."""
        rng = np.random.default_rng(self.seed)
        advance = progress_task(progress, f"{self.name} ({self.context_tokens} tok)", len(self.depths) * self.samples)
        records = []
        with partial_on_stop(lambda: self._result(records)):
            for depth, ids, expected, info in self.cases(tokenizer, rng):
                out, extra = generate(ids, ids.numel() - self.question_tokens, self.max_new_tokens)
                text = tokenizer.decode(out, skip_special_tokens=True)
                records.append({"depth": depth, "expected": expected, "output": text,
                                "correct": self.score(text, expected), "prompt_tokens": int(ids.numel()),
                                **extra, **info})
                advance()
        return self._result(records)

    def _result(self, records: list[dict]) -> dict:
        """Accuracy overall and per depth over the finished samples ``records`` (the tier-1 hit rate over
        those that have one)."""
        def mean(values):
            return float(np.mean(values)) if len(values) else float("nan")

        per_depth = {f"{d:g}": mean([r["correct"] for r in records if r["depth"] == d]) for d in self.depths}
        return {"task": self.name, "accuracy": mean([r["correct"] for r in records]), "samples": len(records),
                "context_tokens": mean([r["prompt_tokens"] for r in records]), "per_depth": per_depth,
                "tier1_hit_rate": mean([r["tier1_hit_rate"] for r in records if "tier1_hit_rate" in r]),
                "records": records}


@dataclass
class Passkey(RetrievalTask):
    """Passkey retrieval over synthetic filler; ``samples`` keys per depth from a seeded RNG."""

    name: ClassVar[str] = "passkey"
    intro: ClassVar[str] = ("There is an important piece of information hidden inside a lot of irrelevant text. "
                            "Find it and memorize it. I will quiz you about the important information there.")
    question: ClassVar[str] = "What is the pass key?"
    answer_prefix: ClassVar[str] = "The pass key is"

    def cases(self, tokenizer, rng):
        before, after = self.template(tokenizer, self.question, self.answer_prefix)
        max_units = self.context_tokens // 4  # a filler sentence is 5-6 tokens
        for depth in self.depths:
            for _ in range(self.samples):
                key = str(int(rng.integers(10000, 100000)))
                needle = f"The pass key is {key}. Remember it. {key} is the pass key."

                def haystack(n, depth=depth, needle=needle):
                    sentences = [FILLER[i % len(FILLER)] for i in range(n)]
                    sentences.insert(round(depth * n), needle)
                    return " ".join(sentences)

                ids, n = self.fit(tokenizer, before, after, haystack, max_units)
                yield depth, ids, key, {"filler_sentences": n}

    def score(self, output: str, expected: str) -> bool:
        numbers = re.findall(r"\d+", output)
        return bool(numbers) and numbers[0] == expected
