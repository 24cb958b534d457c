"""DiskTier on real files: bit-exact round trips, batching, config errors, lifecycle."""

import os
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvtier.errors import ConfigError, PageCorruptedError, TierFullError, TierIOError
from kvtier.layout import KVLayout
from kvtier.tiers.disk import DiskTier

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]


def layout_of(dtype=torch.bfloat16, layers=2):
    return KVLayout(num_layers=layers, num_kv_heads=2, head_dim=16, page_size=4, dtype=dtype)


def rand_pages(layout, n, seed=0):
    """Random pages ``[n, 2, P, N_kv, D]`` in the layout's dtype."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *layout.page_shape), generator=g).to(layout.dtype)


def same_bits(a, b):
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_is_bit_identical(tmp_path, dtype):
    layout = layout_of(dtype)
    tier = DiskTier(layout, 16, tmp_path / "kv")
    rng = np.random.default_rng(1)
    written = []
    for layer in range(layout.num_layers):
        slots = torch.from_numpy(rng.permutation(16)[:9])  # random order, not contiguous
        pages = rand_pages(layout, 9, seed=layer)
        tier.write(layer, slots, pages)
        order = rng.permutation(9)
        got = tier.read(layer, slots[order])
        assert got.device.type == "cpu" and got.dtype == dtype and got.shape == pages.shape
        assert same_bits(got, pages[order])
        written.append((slots, pages))
    for layer, (slots, pages) in enumerate(written):  # layers do not overwrite each other
        assert same_bits(tier.read(layer, slots), pages)
    tier.close()


def test_read_into_out(tmp_path):
    layout = layout_of()
    tier = DiskTier(layout, 8, tmp_path)
    pages = rand_pages(layout, 3)
    slots = torch.tensor([5, 0, 6])
    tier.write(1, slots, pages)
    out = torch.empty_like(pages)
    assert tier.read(1, slots, out=out) is out and same_bits(out, pages)
    strided = torch.empty((3, 2, *layout.page_shape), dtype=layout.dtype)[:, 1]  # not contiguous
    assert tier.read(1, slots, out=strided) is strided and same_bits(strided, pages)
    tier.close()


def test_consecutive_slots_are_one_io(tmp_path, monkeypatch):
    layout = layout_of()
    tier = DiskTier(layout, 32, tmp_path)
    tier.write(0, torch.arange(32), rand_pages(layout, 32))
    calls = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: calls.append(off) or real(fd, bufs, off))
    tier.read(0, torch.arange(4, 20))
    assert calls == [4 * layout.page_bytes]
    calls.clear()
    tier.read(0, torch.tensor([1, 2, 3, 10, 11, 30]))  # three runs
    assert len(calls) == 3
    tier.close()


@settings(max_examples=25, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 11), min_size=1, max_size=6, unique=True),
                              st.integers(0, 2**31)), min_size=1, max_size=12))
def test_matches_a_dict_model(ops):
    """Any interleaving of batched writes and reads returns the last bytes written to each slot."""
    layout = layout_of(torch.float16, layers=1)
    with tempfile.TemporaryDirectory() as d:
        tier = DiskTier(layout, 12, d)
        model = {}
        for is_write, slots, seed in ops:
            if is_write:
                pages = rand_pages(layout, len(slots), seed)
                tier.write(0, torch.tensor(slots), pages)
                model.update({s: pages[i] for i, s in enumerate(slots)})
            else:
                known = [s for s in slots if s in model]
                if known:
                    got = tier.read(0, torch.tensor(known))
                    assert same_bits(got, torch.stack([model[s] for s in known]))
                unknown = [s for s in slots if s not in model]
                if unknown:
                    with pytest.raises(PageCorruptedError):
                        tier.read(0, torch.tensor(unknown))
        tier.close()


def test_unwritten_and_freed_slots_never_read(tmp_path):
    layout = layout_of()
    tier = DiskTier(layout, 4, tmp_path)
    slots = tier.alloc(0, 2)
    with pytest.raises(PageCorruptedError, match=r"layer 0: slots \[\d\] hold no complete page"):
        tier.read(0, slots[:1])
    tier.write(0, slots, rand_pages(layout, 2))
    tier.free(0, slots[:1])
    with pytest.raises(PageCorruptedError, match=f"slots \\[{int(slots[0])}\\]"):
        tier.read(0, slots)
    assert tier.read(0, slots[1:]).shape[0] == 1
    with pytest.raises(ValueError, match="outside"):
        tier.read(0, torch.tensor([4]))
    tier.close()


def test_capacity_is_enforced(tmp_path):
    tier = DiskTier(layout_of(), 4, tmp_path)
    tier.alloc(0, 4)
    with pytest.raises(TierFullError, match="'disk' layer 0"):
        tier.alloc(0, 1)
    assert tier.num_free(1) == 4
    tier.close()


def test_files_are_reserved_and_deleted_on_close(tmp_path):
    layout = layout_of()
    d = tmp_path / "new" / "dir"
    tier = DiskTier(layout, 10, d)
    tier.write(0, torch.tensor([3]), rand_pages(layout, 1))
    files = sorted(p.name for p in d.iterdir())
    assert files == ["layer_000.kv", "layer_000.sum", "layer_001.kv", "layer_001.sum"]
    assert os.path.getsize(d / "layer_001.kv") == 10 * layout.page_bytes
    assert os.stat(d / "layer_001.kv").st_blocks * 512 >= 10 * layout.page_bytes  # allocated, not sparse
    tier.close()
    tier.close()  # idempotent
    assert not d.exists()
    with pytest.raises(TierIOError, match="closed"):
        tier.read(0, torch.tensor([3]))


def test_keep_and_open_existing(tmp_path):
    layout = layout_of(torch.float32)
    tier = DiskTier(layout, 6, tmp_path, keep=True, fsync=True)
    pages = rand_pages(layout, 3)
    tier.write(1, torch.tensor([4, 1, 2]), pages)
    tier.close()
    again = DiskTier.open_existing(tmp_path, layout)
    assert again.capacity == 6
    assert again.valid_slots(1).tolist() == [1, 2, 4] and again.valid_slots(0).size == 0
    assert same_bits(again.read(1, torch.tensor([4, 1, 2])), pages)
    again.close()
    assert (tmp_path / "layer_000.kv").exists()  # open_existing keeps by default


@pytest.mark.parametrize("where", ["under_a_file", "is_a_file", "proc"])
def test_unusable_path_is_a_config_error(tmp_path, where):
    (tmp_path / "afile").write_text("x")
    path = {"under_a_file": tmp_path / "afile" / "sub", "is_a_file": tmp_path / "afile",
            "proc": "/proc/kvtier-cannot-exist"}[where]
    with pytest.raises(ConfigError, match=str(path)) as e:
        DiskTier(layout_of(), 4, path)
    assert e.value.field == "tiers.stack.disk.path"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # nothing written


def test_one_live_tier_per_directory(tmp_path):
    first = DiskTier(layout_of(), 4, tmp_path, name="ssd")
    with pytest.raises(ConfigError, match="in use") as e:
        DiskTier(layout_of(), 4, tmp_path, name="ssd")
    assert e.value.field == "tiers.stack.ssd.path"
    first.close()
    DiskTier(layout_of(), 4, tmp_path).close()


def test_bad_pages_are_rejected_before_any_io(tmp_path):
    tier = DiskTier(layout_of(torch.float16), 4, tmp_path)
    with pytest.raises(ValueError, match="dtype"):
        tier.write(0, torch.tensor([0]), rand_pages(layout_of(torch.float32), 1))
    with pytest.raises(ValueError, match="shape"):
        tier.write(0, torch.tensor([0, 1]), rand_pages(layout_of(torch.float16), 1))
    tier.close()
