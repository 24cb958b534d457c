"""``model=hf model.id=<org/name>``: a Hub model from a temporary local HF cache, offline, and a named error
when the id is not cached."""

import os
import shutil

import pytest
import torch

from kvtier.build import plan
from kvtier.errors import ConfigError
from kvtier.models import ensure_smollm2, load_model, random_llama
from kvtier.run import execute, job_configs

REPO = "kvtier-test/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    """An HF home whose hub cache holds REPO as the Hub lays it out: refs/main -> snapshots/<commit>/."""
    home = tmp_path_factory.mktemp("hf_home")
    repo = home / "hub" / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    model = random_llama(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                         vocab_size=49152, max_position_embeddings=2048, dtype="float32", device="cpu", seed=3)
    model.save_pretrained(snapshot)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # SmolLM2's tokenizer: the same 49152 ids
        shutil.copy(ensure_smollm2() / name, snapshot / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return home, model


@pytest.fixture(params=["HF_HOME", "HF_HUB_CACHE"])
def cached(request, hf_home, monkeypatch):
    """The environment pointing at the temporary cache, by ``HF_HOME`` or by ``HF_HUB_CACHE``."""
    home, model = hf_home
    monkeypatch.delenv("HF_HOME" if request.param == "HF_HUB_CACHE" else "HF_HUB_CACHE", raising=False)
    monkeypatch.setenv(request.param, str(home if request.param == "HF_HOME" else home / "hub"))
    return model


def test_load_model_by_hub_id_from_the_local_cache(cached):
    model, tokenizer = load_model(id=REPO, dtype="float32")
    assert model.config.num_hidden_layers == 2 and len(tokenizer) == 49152
    for (name, mine), theirs in zip(model.state_dict().items(), cached.state_dict().values()):
        assert torch.equal(mine, theirs), name


def test_recipe_model_hf_runs_offline(hf_home, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(hf_home[0]))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # kvtier sets it itself
    (cfg,) = job_configs(["model=hf", f"model.id={REPO}", "model.dtype=float32", "model.device=cpu",
                          "task.length=128", "task.prefix=96", "scheduler.prefill.chunk_size=16", "progress=false",
                          "budget.fraction=0.5", "logger=none", "cache.fidelity=false"])
    assert plan(cfg).labels["model"] == "tiny-llama"
    metrics = execute(cfg, tmp_path / "run")
    assert metrics["perplexity"] > 1000  # random weights over a 49152-token vocabulary
    assert os.environ["HF_HUB_OFFLINE"] == "1"


@pytest.mark.parametrize("override, hint", [
    ("model.id=kvtier-test/not-cached", "hf download kvtier-test/not-cached`"),
    ("model.revision=v2", "hf download kvtier-test/tiny-llama --revision v2`"),
    ("model.id=two words", "write it as org/name"),
])
def test_an_id_not_in_the_cache_names_the_command_that_fetches_it(cached, override, hint):
    with pytest.raises(ConfigError) as err:
        for cfg in job_configs(["model=hf", f"model.id={REPO}", override]):
            plan(cfg)
    assert err.value.field == "model.id" and hint in str(err.value)
