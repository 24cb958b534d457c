"""RedisTier against a real redis-server on loopback: round trips, batching, namespaces, capacity."""

import numpy as np
import pytest
import torch

from kvtier.errors import ConfigError, MissingDependencyError, PageCorruptedError, TierFullError, TierIOError
from kvtier.layout import KVLayout
from kvtier.tiers.redis import RedisTier
from kvtier.tiers.redis_server import LocalRedis

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]


def layout_of(dtype=torch.bfloat16, layers=2):
    return KVLayout(num_layers=layers, num_kv_heads=2, head_dim=16, page_size=4, dtype=dtype)


def rand_pages(layout, n, seed=0):
    """Random pages ``[n, 2, P, N_kv, D]`` in the layout's dtype."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *layout.page_shape), generator=g).to(layout.dtype)


def same_bits(a, b):
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.fixture(scope="module")
def server():
    with LocalRedis() as srv:
        yield srv


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_is_bit_identical(server, dtype):
    layout = layout_of(dtype)
    tier = RedisTier(layout, 32, server.url)
    rng = np.random.default_rng(2)
    written = []
    for layer in range(layout.num_layers):
        slots = torch.from_numpy(rng.permutation(32)[:11])  # random order, not contiguous
        pages = rand_pages(layout, 11, seed=10 + layer)
        tier.write(layer, slots, pages)
        order = rng.permutation(11)
        got = tier.read(layer, slots[order])
        assert got.device.type == "cpu" and got.dtype == dtype and same_bits(got, pages[order])
        written.append((slots, pages))
    for layer, (slots, pages) in enumerate(written):
        out = torch.empty_like(pages)
        assert tier.read(layer, slots, out=out) is out and same_bits(out, pages)
    tier.close()


def test_two_tiers_on_one_server_do_not_mix_and_close_deletes_only_their_keys(server):
    layout = layout_of()
    a, b = RedisTier(layout, 4, server.url, name="a"), RedisTier(layout, 4, server.url, name="b")
    assert a.namespace != b.namespace
    pa, pb = rand_pages(layout, 2, seed=1), rand_pages(layout, 2, seed=2)
    a.write(0, torch.tensor([0, 1]), pa)
    b.write(0, torch.tensor([0, 1]), pb)
    assert same_bits(a.read(0, torch.tensor([0, 1])), pa) and same_bits(b.read(0, torch.tensor([0, 1])), pb)
    assert b._db.exists(a.key(0, 0), a.key(0, 1)) == 2
    a.close()
    assert b._db.exists(a.key(0, 0), a.key(0, 1)) == 0  # close removed a's pages from the server
    assert same_bits(b.read(0, torch.tensor([0, 1])), pb)
    b.close()


def test_one_round_trip_per_batch(server):
    """A batch of 64 pages is one pipelined SET batch and one MGET, counted by the server itself."""
    layout = layout_of()
    tier = RedisTier(layout, 64, server.url)

    def calls():
        stats = tier._db.info("commandstats")
        return {c: stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("set", "mget", "get")}

    before = calls()
    tier.write(1, torch.arange(64).flip(0), rand_pages(layout, 64))
    tier.read(1, torch.arange(0, 64, 3))
    after = calls()
    assert {c: after[c] - before[c] for c in after} == {"set": 64, "mget": 1, "get": 0}
    tier.close()


def test_unwritten_and_freed_slots_never_read_and_free_deletes_the_keys(server):
    layout = layout_of()
    tier = RedisTier(layout, 4, server.url)
    slots = tier.alloc(1, 3)
    tier.write(1, slots, rand_pages(layout, 3))
    tier.free(1, slots[1:2])
    assert tier._db.exists(tier.key(1, int(slots[1]))) == 0
    with pytest.raises(PageCorruptedError, match=rf"'remote' layer 1: slots \[{int(slots[1])}\] hold no complete"):
        tier.read(1, slots)
    assert tier.read(1, slots[[0, 2]]).shape[0] == 2
    tier.close()


def test_alloc_beyond_capacity_is_tier_full(server):
    tier = RedisTier(layout_of(), 8, server.url)
    tier.alloc(0, 6)
    with pytest.raises(TierFullError, match="asked for 3 pages, 2 of 8 free"):
        tier.alloc(0, 3)
    tier.close()


def test_server_too_small_fails_at_construction_and_a_full_server_refuses_the_write():
    with LocalRedis(maxmemory=4 << 20) as small:
        with pytest.raises(TierIOError, match=r"has \d+ of 4194304 bytes \(maxmemory\) free.*raise the server's"):
            RedisTier(layout_of(), 4096, small.url)
        layout = KVLayout(num_layers=1, num_kv_heads=8, head_dim=128, page_size=64, dtype=torch.bfloat16)  # 256 KiB
        a, b = RedisTier(layout, 8, small.url, name="a"), RedisTier(layout, 8, small.url, name="b")  # 2 MiB each
        pages = rand_pages(layout, 8)
        a.write(0, torch.arange(8), pages)
        with pytest.raises(TierIOError, match=r"refused \d+ of 8 pages .*maxmemory.*raise its maxmemory"):
            b.write(0, torch.arange(8), pages)
        with pytest.raises(PageCorruptedError, match="hold no complete page"):
            b.read(0, torch.arange(8))  # nothing of a refused batch is readable
        assert same_bits(a.read(0, torch.arange(8)), pages)
        a.close()
        b.close()


def test_config_errors(server):
    with pytest.raises(ConfigError, match="tiers.stack.remote.url"):
        RedisTier(layout_of(), 4, "localhost:6379")
    with pytest.raises(ConfigError, match="tiers.stack.remote.timeout_s"):
        RedisTier(layout_of(), 4, server.url, timeout_s=0)
    with pytest.raises(ConfigError, match="tiers.stack.remote.ttl_s"):
        RedisTier(layout_of(), 4, server.url, ttl_s=-1)
    with pytest.raises(ConfigError, match="capacity: tier .remote."):
        RedisTier(layout_of(), 0, server.url)


def test_missing_extra_names_it(server, monkeypatch):
    import sys

    import redis.utils

    monkeypatch.setattr(redis.utils, "HIREDIS_AVAILABLE", False)
    with pytest.raises(MissingDependencyError, match=r"needs the 'hiredis' package: pip install 'kvtier\[redis\]'"):
        RedisTier(layout_of(), 4, server.url)
    monkeypatch.setitem(sys.modules, "redis", None)  # import redis now raises ImportError
    with pytest.raises(MissingDependencyError, match=r"needs the 'redis' package: pip install 'kvtier\[redis\]'"):
        RedisTier(layout_of(), 4, server.url)


def test_server_listens_on_loopback_only(server):
    tier = RedisTier(layout_of(), 1, server.url)
    assert tier._db.config_get("bind") == {"bind": "127.0.0.1"}
    assert tier._db.config_get("save") == {"save": ""} and tier._db.config_get("appendonly")["appendonly"] == "no"
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if state == "0A" and int(p, 16) == server.port:
                listening.append(addr)
    assert listening == ["0100007F"]  # 127.0.0.1, little-endian hex; no 0.0.0.0 nor IPv6
    tier.close()
