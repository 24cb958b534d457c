"""kvtier.data: the real texts (shipped with kvtier or in pip packages) and their token streams (SmolLM2 tokenizer)."""

import hashlib
import importlib.metadata

import pytest
import torch
from transformers import AutoTokenizer

from kvtier import data
from kvtier.errors import ConfigError
from kvtier.models import ensure_smollm2

# Whole-text token counts with the SmolLM2 tokenizer, no special tokens (transformers 5.2 and 5.17).
TOKENS = {"opticks": 145736, "lady_susan": 31398}
OPTICKS_SHA256 = "d4a9ac22462b35e7821a4f2706c211093da678620a8f9997989ee7cf8d507bbd"  # kvtier/texts/README.md


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ensure_smollm2(), local_files_only=True)


def test_opticks_text():
    text = data.opticks_text()
    assert len(text) == 567038
    assert "OPTICKS" in text[:400] and "Sir _ISAAC NEWTON_" in text[:1000]


def test_lady_susan_text():
    text = data.lady_susan_text()
    assert len(text) == 127431
    assert text.startswith("***The Project Gutenberg Etext of Lady Susan, by Jane Austen***")


@pytest.mark.parametrize("name", sorted(TOKENS))
def test_token_stream_is_a_prefix_of_the_whole_text(tokenizer, name):
    whole = data.token_stream(tokenizer, name, TOKENS[name])  # [TOKENS[name]]
    assert whole.dtype == torch.long and whole.shape == (TOKENS[name],)
    assert int(whole.max()) < 49152 and int(whole.min()) >= 0
    head = data.token_stream(tokenizer, name, 100)
    assert torch.equal(head, whole[:100])
    assert torch.equal(data.token_stream(tokenizer, name), whole)  # no length: every token
    assert data.text(name).startswith(tokenizer.decode(head))


@pytest.mark.parametrize("name", sorted(TOKENS))
def test_token_stream_longer_than_the_text(tokenizer, name):
    with pytest.raises(ConfigError, match=f"only {TOKENS[name]} tokens") as err:
        data.token_stream(tokenizer, name, TOKENS[name] + 1)
    assert err.value.field == "task.text"


@pytest.mark.parametrize("name, length", [("wikitext", 16), ("Opticks", 16), ("opticks", 0),
                                          ("opticks", -5), ("opticks", 2.0), ("opticks", True)])
def test_token_stream_rejects_bad_requests(tokenizer, name, length):
    with pytest.raises(ConfigError) as err:
        data.token_stream(tokenizer, name, length)
    assert err.value.field == "task.text"


def missing(name):
    raise importlib.metadata.PackageNotFoundError(name)


def test_missing_package_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ConfigError, match="pip install --no-deps 'music21==10.5.0'") as err:
        data.lady_susan_text()
    assert err.value.field == "task.text"


def test_opticks_ships_with_kvtier(monkeypatch):
    """No pip package is read for Opticks: the gzipped copy in kvtier/texts is the text."""
    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    text = data.opticks_text()
    assert hashlib.sha256(text.encode()).hexdigest() == OPTICKS_SHA256
