"""Streaming perplexity (StreamingLLM-style): prefill a short prefix, then feed the text one token
per decode step and score the next token's NLL, so every scored token sees the cache exactly as a
long generation would (resident scope: only the pages the policy kept on the device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar

import torch

from kvtier.data import bos_ids, text, token_stream
from kvtier.checks import check_positions
from kvtier.errors import ConfigError, partial_on_stop

if TYPE_CHECKING:  # the engine imports kvtier.eval.fidelity
    from kvtier.engine import Engine


def check_int(field: str, value, low: int, high: int | None = None) -> None:
    """Raise ConfigError("task.<field>") unless ``low <= value (<= high)`` is an integer."""
    bad = not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high)
    if bad:
        allowed = f"an integer in [{low}, {high}]" if high is not None else f"an integer >= {low}"
        raise ConfigError(f"task.{field}", f"must be {allowed}, got {value!r}")


def progress_task(progress, description: str, total: int):
    """``advance()`` for a rich Progress task (a no-op without a Progress)."""
    if progress is None:
        return lambda n=1: None
    task_id = progress.add_task(description, total=total)
    return lambda n=1: progress.advance(task_id, n)


@dataclass
class Perplexity:
    """Perplexity of ``text`` (``length`` tokens: the model's BOS where its tokenizer adds one, then the text from
    token ``offset``) fed token by token after a ``prefix``.

    Scored: the ``length - prefix`` tokens after the prefix (the first from the prefill's last
    logits, each later one from the decode step of the token before it). A long ``prefix`` with a
    cache built with ``exact_prefill`` is the "exact context, then the budget" protocol.
    """

    text: str = "opticks"
    length: int = 4096
    prefix: int = 16
    block_tokens: int = 256  # granularity of the returned NLL curve
    offset: int = 0  # first token of the text used
    name: ClassVar[str] = "perplexity"
    context_key: ClassVar[str] = "length"  # the field that sets context_tokens
    new_tokens: ClassVar[int] = 0  # tokens generated after the context

    @property
    def context_tokens(self) -> int:
        return self.length

    @property
    def prompt_tokens(self) -> int:
        """Tokens prefilled (the rest come one per decode step)."""
        return self.prefix

    def __post_init__(self):
        text(self.text)  # known, installed, UTF-8: checked before the model loads
        check_int("prefix", self.prefix, 1)
        if isinstance(self.length, int) and not isinstance(self.length, bool) and 2 <= self.length <= self.prefix:
            raise ConfigError("task.length", f"task.length={self.length} leaves no token to score after the "
                                             f"task.prefix={self.prefix} tokens prefilled: give task.length > "
                                             f"{self.prefix}, or a smaller task.prefix")
        check_int("length", self.length, 2)
        check_int("block_tokens", self.block_tokens, 1)
        check_int("offset", self.offset, 0)

    def tokens(self, tokenizer) -> torch.Tensor:
        """The ``length`` token ids scored from, BOS first where the tokenizer adds one (:func:`kvtier.data.bos_ids`):
        LongTensor ``[length]``."""
        bos = torch.tensor(bos_ids(tokenizer), dtype=torch.long)  # [0 or 1]
        text_ids = token_stream(tokenizer, self.text, self.offset + self.length - bos.numel())[self.offset:]
        return torch.cat([bos, text_ids])

    @torch.no_grad()
    def run(self, make_engine: Callable[[], Engine], tokenizer, progress=None) -> dict:
        """The perplexity result; on Ctrl-C or a tier's fault, :class:`Interrupted` or :class:`TierFailed`
        carrying the tokens scored so far."""
        engine = make_engine()
        check_positions(self, engine.model.config)
        ids = self.tokens(tokenizer)  # [length]
        advance = progress_task(progress, f"perplexity {self.text} ({self.length} tok)", self.length - self.prefix)
        nll = torch.empty(self.length - self.prefix, dtype=torch.float64)
        done = 0
        try:
            with partial_on_stop(lambda: self._result(nll[:done], engine.tpot_s, engine)):
                seq = engine.open(self.length)
                logits = engine.prefill_sequence(seq, ids[: self.prefix])[-1:]  # [1, V]
                nll[0] = _nll(logits, ids[self.prefix])
                done = 1
                advance()
                engine.start_decode(seq, ids[self.prefix])
                row = engine.row_seq.index(seq)
                for i in range(self.prefix, self.length - 1):
                    logits = engine.step({seq: int(ids[i])})[row:row + 1]  # [1, V]
                    nll[i + 1 - self.prefix] = _nll(logits, ids[i + 1])
                    done += 1
                    advance()
                engine.feedback.take(upto=engine.step_idx)
        finally:
            engine.close()
        return self._result(nll, engine.tpot_s, engine)

    def _result(self, nll: torch.Tensor, tpot: list, engine) -> dict:
        mean = float(nll.mean()) if nll.numel() else float("nan")
        tpot = sorted(tpot)
        return {"task": self.name, "perplexity": math.exp(mean), "nll_mean": mean, "samples": 1,
                "context_tokens": self.length, "scored_tokens": int(nll.numel()), "text": self.text,
                "prefix": self.prefix, "nll_blocks": [float(b.mean()) for b in nll.split(self.block_tokens)],
                "block_tokens": self.block_tokens, "tier1_hit_rate": engine.hit_rate(),
                "offset": self.offset, "attended_tokens": engine.stats.attended_tokens_mean,
                "tpot_p50_s": tpot[len(tpot) // 2] if tpot else float("nan")}


def _nll(logits: torch.Tensor, target: torch.Tensor) -> float:
    """NLL of ``target`` (a 0-d token id) under ``logits [1, V]``."""
    logp = torch.log_softmax(logits[0].double().cpu(), dim=-1)
    return float(-logp[int(target)])
