import math

import pytest
import torch

from kvtier import KVLayout
from kvtier.errors import ConfigError
from kvtier.layout import decode_arithmetic_intensity, footprint_table, kv_footprint_bytes


def test_seed_footprint_table_70b():
    rows = footprint_table()
    assert [r["GiB"] for r in rows[:3]] == [2.5, 40.0, 320.0]
    assert rows[3]["TiB"] == 2.5
    # the seed prints 2.56 GiB / 40.96 GiB / 327.68 GiB / 2.56 TiB
    assert [round(r["seed_printed"], 2) for r in rows] == [2.56, 40.96, 327.68, 2.56]


def test_per_token_bytes_matches_seed():
    layout = KVLayout(num_layers=80, num_kv_heads=8, head_dim=128, page_size=16, dtype="float16")
    assert layout.token_bytes == 327_680
    assert layout.page_bytes * 80 == 16 * 327_680
    assert kv_footprint_bytes(80, 8, 128, 2, 8192, 1) == 8192 * 327_680


def test_decode_intensity_seed_formula():
    # the seed's formula at B=1 is 2/P_bytes FLOP per byte for any context: memory-bound decode
    for s in (1_000, 1_000_000):
        assert math.isclose(decode_arithmetic_intensity(70e9, 80, 8, 128, 2, s), 1.0)
        assert math.isclose(decode_arithmetic_intensity(70e9, 80, 8, 128, 1, s), 2.0)
    # batching amortises the weights at short context; long context pulls it back to 2/P_bytes
    short = decode_arithmetic_intensity(70e9, 80, 8, 128, 2, 1_000, batch=64)
    long = decode_arithmetic_intensity(70e9, 80, 8, 128, 2, 1_000_000, batch=64)
    assert short > 40 and 1.0 < long < 1.5 and long < short


@pytest.mark.parametrize("field,kwargs", [
    ("page_size", dict(page_size=0)),
    ("page_size", dict(page_size=12)),
    ("num_layers", dict(num_layers=-1)),
    ("dtype", dict(dtype="int8")),
    ("head_dim", dict(head_dim=0)),
])
def test_bad_layout_names_field(field, kwargs):
    base = dict(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float32")
    with pytest.raises(ConfigError) as e:
        KVLayout(**{**base, **kwargs})
    assert e.value.field == field


def test_dtype_resolution():
    assert KVLayout(1, 1, 8, 4, "bfloat16").dtype is torch.bfloat16
    assert KVLayout(1, 1, 8, 4, torch.float16).page_bytes == 2 * 4 * 8 * 2
