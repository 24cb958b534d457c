"""kvpress's presses beside kvtier's policies: ``kvtier-run method=kvpress:<press>`` and the ``kvpress:<press>``
configurations of :mod:`bench.policy_study` (the ``[compare]`` extra), on the same model, task, prompts and budget
as kvtier's.

kvpress 0.5.5 needs transformers<5.3: its presses' hooks read the attention's ``cache_position``, which
transformers 5.17's Llama attention no longer receives (each of the six presses below fails there with
KeyError). So it runs from its own environment, ``.venv-compare`` (``make compare-env``: transformers
5.2, kvpress and this package), where kvtier's configurations run too, to the same perplexities as in
``.venv``; both kinds of row come from one command, into one JSON, table and plot.

Protocol (kvpress's own): the press compresses the prefill once, in each layer after its attention (so
the prefill's logits are exact); every later token is fed at its original position against the
compressed cache and kept (kvtier's ``once`` scope is the same protocol).

- perplexity (``ctx2k``, ``stream``): the prefix is compressed, the tokens after it are scored teacher-forced
  (one forward over the compressed cache, causal within the continuation);
- passkey / needle: question ``inside``: the whole prompt is compressed; ``after``: the context is
  compressed and the question fed afterwards; then ``max_new_tokens`` greedy tokens (no early stop, as
  kvtier's :func:`kvtier.eval.passkey.greedy`).

Budget: at kvtier's budget ``B`` (``round(fraction x context)`` keys a decode step attends) a press keeps
``B`` KV pairs of an ``n``-token prefill in every layer and kv head: ``compression_ratio = (n - B - 0.5) / n``,
whose ``int(n * (1 - ratio))`` (kvpress's count kept) is ``B``; ``0`` when ``n <= B`` (nothing dropped).
The count kept is read back from the cache and checked. ``--sinks`` is StreamingLLM's and Expected
Attention's ``n_sink``, ``--window`` SnapKV's observation window (4 and 64: kvpress's defaults too).
"""

from __future__ import annotations

import importlib.metadata
import math

import torch

from kvtier.checks import check_positions
from kvtier.errors import ConfigError, MissingDependencyError
from kvtier.eval import Perplexity
from kvtier.eval.perplexity import _nll

PRESSES = {"streaming_llm": "StreamingLLMPress", "tova": "TOVAPress", "snapkv": "SnapKVPress",
           "observed_attention": "ObservedAttentionPress", "expected_attention": "ExpectedAttentionPress",
           "knorm": "KnormPress"}
ENV = ".venv-compare, built by make compare-env"


def press_name(config: str, key: str = "configs") -> str:
    """The press of a ``kvpress:<press>`` configuration (``key``'s value); ConfigError names the known ones."""
    kind, _, name = config.partition(":")
    if kind != "kvpress" or name not in PRESSES:
        raise ConfigError(key, f"unknown press {config!r}; use kvpress:<press> with one of {sorted(PRESSES)}")
    return name


def load_kvpress():
    """The kvpress module (importing it wraps transformers' attention functions); MissingDependencyError
    without it, ConfigError where this environment's transformers is not one it supports."""
    from packaging.requirements import Requirement
    import transformers

    try:
        import kvpress
    except ImportError:
        raise MissingDependencyError("kvpress", "compare", f"a kvpress:<press> config (run from {ENV})") from None
    needs = [Requirement(r) for r in importlib.metadata.requires("kvpress") or []]
    for req in needs:
        if req.name == "transformers" and not req.marker and transformers.__version__ not in req.specifier:
            raise ConfigError("method", f"kvpress {importlib.metadata.version('kvpress')} needs transformers{req.specifier}, "
                                        f"this environment has {transformers.__version__}: run from {ENV}")
    return kvpress


KNOBS = {"streaming_llm": {"n_sink": "sinks"}, "expected_attention": {"n_sink": "sinks"},
         "snapkv": {"window_size": "window"}}  # press -> its argument -> the setting it takes (cache.<setting>)


def make_press(name: str, n: int, budget: int, sinks: int, window: int):
    """The press ``name`` keeping ``min(budget, n)`` KV pairs of an ``n``-token prefill."""
    settings = {"sinks": sinks, "window": window}
    press = getattr(load_kvpress(), PRESSES[name])
    return press(compression_ratio=max(0.0, (n - budget - 0.5) / n),
                 **{arg: settings[key] for arg, key in KNOBS.get(name, {}).items()})


def prefill(model, ids: torch.Tensor, press, kept: int):
    """Prefill ``ids [n]`` under ``press``: ``(logits [V] of the last token, the compressed DynamicCache)``;
    RuntimeError unless every layer kept ``kept`` KV pairs."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with press(model):
        logits = model(ids[None], past_key_values=cache, logits_to_keep=1).logits[0, -1]
    counts = [layer.keys.shape[2] for layer in cache.layers]
    if set(counts) != {kept}:
        raise RuntimeError(f"{type(press).__name__} kept {sorted(set(counts))} KV pairs per layer of "
                           f"{ids.numel()}, not the budget's {kept}")
    return logits, cache


def feed(model, cache, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Logits ``[m, V]`` of ``ids [m]`` fed at positions ``start, ..., start + m - 1`` against ``cache``
    (kvpress's pipeline: a compressed cache keeps the original positions)."""
    positions = torch.arange(start, start + ids.numel(), device=ids.device)[None]
    return model(ids[None], past_key_values=cache, position_ids=positions).logits[0]


@torch.no_grad()
def run_press(task, name: str, budget: int, model, tokenizer, sinks: int, window: int, progress=None) -> dict:
    """``task`` (Perplexity, Passkey or Needle) with the press ``name`` at ``budget`` tokens: the task's result
    keys that :func:`bench.policy_study.run_one` reads, plus ``kept_tokens`` (per layer, mean over samples)."""
    check_positions(task, model.config)
    if isinstance(task, Perplexity):
        return _perplexity(task, name, budget, model, tokenizer, sinks, window)

    def generate(ids: torch.Tensor, n: int, max_new_tokens: int, stop: frozenset = frozenset()):
        ids, kept = ids.to(model.device), min(budget, n)
        logits, cache = prefill(model, ids[:n], make_press(name, n, budget, sinks, window), kept)
        if n < ids.numel():  # the question, after the compressed context
            logits = feed(model, cache, ids[n:], n)[-1]
        out = [int(logits.argmax())]
        while len(out) < max_new_tokens and out[-1] not in stop:
            step = torch.tensor([out[-1]], device=model.device)
            out.append(int(feed(model, cache, step, ids.numel() + len(out) - 1)[-1].argmax()))
        return out, {"kept_tokens": kept}

    result = task.run_with(generate, tokenizer, progress)
    return {**result, "kept_tokens": sum(r["kept_tokens"] for r in result["records"]) / result["samples"]}


def _perplexity(task: Perplexity, name: str, budget: int, model, tokenizer, sinks: int, window: int) -> dict:
    """Perplexity of the ``length - prefix`` tokens after the compressed prefix (the first from the prefill's
    logits, the rest teacher-forced against the compressed cache)."""
    P, m = task.prefix, task.length - task.prefix - 1  # m: tokens fed after the prefill
    if m < 1:
        raise ConfigError("task.length", "a press is scored on at least 2 tokens after the context (the first "
                                         "comes from the exact prefill)")
    ids, kept = task.tokens(tokenizer).to(model.device), min(budget, P)  # [length]
    first, cache = prefill(model, ids[:P], make_press(name, P, budget, sinks, window), kept)
    logits = torch.cat([first[None], feed(model, cache, ids[P:-1], P)])  # [m + 1, V]
    nll = torch.tensor([_nll(logits[i:i + 1], ids[P + i]) for i in range(m + 1)], dtype=torch.float64)
    mean = float(nll.mean())
    # the i-th token fed (i = 1..m) attends the kept pairs, the i - 1 fed before it and itself
    return {"perplexity": math.exp(mean), "nll_mean": mean, "scored_tokens": m + 1, "text": task.text,
            "attended_tokens": kept + (m + 1) / 2, "kept_tokens": kept}
