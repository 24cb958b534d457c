"""Needle in a haystack of real text: one distinctive fact sentence is inserted at a given depth of a
``context_tokens`` excerpt of a book (Lady Susan by default); the model is asked about it and is
right when the answer word appears in its greedy answer.

The prompt format is the passkey task's (see :mod:`kvtier.eval.passkey`): the same for every
policy and scope, with a "Question:" label, which SmolLM2-135M-Instruct needs on real text. The
book's hard line wrapping is undone first. Each sample takes its excerpt from a seeded-random
paragraph start.

Measured (SmolLM2-135M-Instruct, fp32, scope ``all``): 3/3 at 2k; 6/9 at 4k, where depth 0.1 fails
(0/3): this model does not recall a fact ~3.7k tokens back in prose, though it does in the passkey's filler.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from kvtier.data import text
from kvtier.errors import ConfigError
from kvtier.eval.passkey import RetrievalTask

_SENTENCE_END = re.compile(r"[.!?][\"')\]]*(?=\s)")


def unwrap(text: str) -> str:
    """Undo the hard line wrapping of a Gutenberg text: one line per paragraph, one blank line between."""
    paragraphs = (" ".join(p.split()) for p in re.split(r"\n\s*\n", text))
    return "\n\n".join(p for p in paragraphs if p)


@dataclass
class Needle(RetrievalTask):
    """A fact sentence (``needle``) hidden in ``text``; ``answer`` must appear in the reply to ``question``."""

    max_new_tokens: int = 12
    text: str = "lady_susan"
    needle: str = "The secret ingredient in Mrs. Vernon's cake was cardamom."
    question: str = "What was the secret ingredient in Mrs. Vernon's cake?"
    answer: str = "cardamom"
    answer_prefix: str = "The secret ingredient in Mrs. Vernon's cake was"
    name: ClassVar[str] = "needle"
    intro: ClassVar[str] = ("There is an important fact hidden inside this excerpt from a book. "
                            "Find it and memorize it. I will quiz you about the important fact there.")
    question_sep: ClassVar[str] = "\n\nQuestion: "

    def __post_init__(self):
        super().__post_init__()
        text(self.text)  # known, installed, UTF-8: checked before the model loads
        for name in ("needle", "question", "answer"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(f"task.{name}", f"must be a non-empty string, got {value!r}")
        if not isinstance(self.answer_prefix, str):
            raise ConfigError("task.answer_prefix", f"must be a string (may be empty), got {self.answer_prefix!r}")
        if self.answer.lower() not in self.needle.lower():
            raise ConfigError("task.answer", f"{self.answer!r} does not occur in the needle {self.needle!r}")

    def cases(self, tokenizer, rng):
        book = unwrap(text(self.text))
        ends = [m.end() for m in _SENTENCE_END.finditer(book)]  # char offsets just after each sentence
        starts = [m.end() for m in re.finditer(r"\n\s*\n", book)]  # paragraph starts
        chars_needed = self.context_tokens * 6  # > chars of context_tokens tokens (about 4 per token)
        usable = [s for s in starts if s + chars_needed < len(book)] or starts[:1]
        before, after = self.template(tokenizer, self.question, self.answer_prefix)
        for depth in self.depths:
            for _ in range(self.samples):
                start = usable[int(rng.integers(len(usable)))]
                bounds = [start] + [e for e in ends if start < e <= start + chars_needed]

                def haystack(n, depth=depth, bounds=bounds):
                    at = bounds[round(depth * n)]
                    return f"{book[bounds[0]:at]} {self.needle}{book[at:bounds[n]]}".strip()

                ids, n = self.fit(tokenizer, before, after, haystack, len(bounds) - 1)
                if n == len(bounds) - 1 and ids.numel() < 0.9 * self.context_tokens:
                    raise ConfigError("task.context_tokens", f"{self.text!r} is too short for {self.context_tokens} "
                                                             f"tokens of context; use fewer or text 'opticks'")
                yield depth, ids, self.answer, {"start_char": start, "sentences": n}

    def score(self, output: str, expected: str) -> bool:
        return expected.lower() in output.lower()
