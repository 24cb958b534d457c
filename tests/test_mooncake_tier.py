"""MooncakeTier against a real Mooncake store (its master started by the tier), in a private network
namespace: the client listens on every address, so the tests below run in a pytest started under
``unshare -rn`` by :func:`test_in_a_private_network_namespace`."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtier import ASPE, DeviceTier, HostTier, TieredKVCache, bytes_moved, kv_layout_for, tiny_llama
from kvtier.errors import ConfigError, MissingDependencyError, PageCorruptedError, PageEvictedError
from kvtier.hook import use_hook
from kvtier.loopback import in_private_network, private_network_command, private_network_unavailable
from kvtier.tiers.mooncake import MooncakeTier

from test_remote_tier import layout_of, rand_pages, same_bits

try:
    import mooncake.store  # noqa: F401
    UNLOADABLE = None
except ImportError as err:
    UNLOADABLE = f"the [mooncake] extra is not installed or does not load ({err})"

ROOT = Path(__file__).resolve().parents[1]
needs_mooncake = pytest.mark.skipif(UNLOADABLE is not None, reason=str(UNLOADABLE))
inside = pytest.mark.skipif(UNLOADABLE is not None or not in_private_network(),
                            reason=UNLOADABLE or "runs in the namespace of test_in_a_private_network_namespace")


def test_without_the_extra_the_error_names_it(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'kvtier\[mooncake\]'"):
        MooncakeTier(layout_of(), 8, name="mooncake")


@needs_mooncake
def test_in_a_private_network_namespace():
    if in_private_network():
        pytest.skip("already inside: the tests below run here")
    if reason := private_network_unavailable():
        pytest.skip(reason)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(private_network_command([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                                   "-rs", __file__]), cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "5 passed, 2 skipped" in proc.stdout, proc.stdout[-2000:]


@needs_mooncake
def test_refused_outside_a_private_network():
    if in_private_network():
        pytest.skip("inside a private network namespace")
    with pytest.raises(ConfigError, match="unshare -rn") as err:
        MooncakeTier(layout_of(), 8, name="mooncake")
    assert err.value.field == "tiers.mooncake._target_"


@pytest.fixture(scope="module")
def tier():
    """One tier (and its master) for the module: each starts a master and a transfer engine."""
    made = MooncakeTier(layout_of(torch.float32), 32, name="mooncake")
    yield made
    made.close()


@inside
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)  # bytes: any dtype alike
def test_round_trip_is_bit_identical(dtype):
    layout = layout_of(dtype)
    tier = MooncakeTier(layout, 16, name="mooncake")
    try:
        for layer in range(layout.num_layers):
            slots = torch.tensor([9, 2, 14, 5, 0])
            pages = rand_pages(layout, 5, seed=layer)
            tier.write(layer, slots, pages)
            got = tier.read(layer, slots[[3, 0, 4]])
            assert got.dtype == dtype and same_bits(got, pages[[3, 0, 4]])
    finally:
        tier.close()


@inside
def test_a_page_gone_from_the_store_or_changed_behind_its_back_is_never_returned(tier):
    layout = tier.layout
    slots = tier.alloc(0, 3)
    tier.write(0, slots, rand_pages(layout, 3))
    tier._store.remove(tier.key(0, int(slots[0])), True)  # as an eviction by the master would
    with pytest.raises(PageEvictedError, match=rf"slots \[{int(slots[0])}\] are gone from the Mooncake store"):
        tier.read(0, slots)
    other = rand_pages(layout, 1, seed=9).view(torch.uint8).reshape(-1).numpy()
    tier._store.upsert(tier.key(0, int(slots[1])), bytes(other) + b"\0\0\0\0")
    with pytest.raises(PageCorruptedError, match="failed their checksum"):
        tier.read(0, slots[1:])
    tier.free(0, slots)
    assert tier._store.batch_is_exist([tier.key(0, int(s)) for s in slots]) == [0, 0, 0]


@inside
def test_a_cache_over_device_host_and_mooncake_matches_device_and_host_alone():
    """Exact attention (scope all) over pages spread down to the store gives what host DRAM alone gives."""
    model = tiny_llama(seed=1)
    use_hook(model)
    layout = kv_layout_for(model.config, page_size=4, dtype=torch.float32)
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(0))
    outs, caches = [], []
    for lower in ([HostTier(layout, 16, name="host")],
                  [HostTier(layout, 4, name="host"), MooncakeTier(layout, 16, name="mooncake")]):
        cache = TieredKVCache(layout, [DeviceTier(layout, 4, name="device"), *lower], ASPE(sinks=4, window=4))
        outs.append(model.generate(ids, past_key_values=cache, max_new_tokens=6, do_sample=False))
        caches.append(cache)
        cache.close()
    assert torch.equal(outs[0], outs[1])
    assert bytes_moved(caches[1])["host->mooncake"] > 0 and bytes_moved(caches[1])["mooncake->device"] > 0
