"""RemoteTier against a real server subprocess: round trips, batching, capacity, lifecycle."""

import socket

import numpy as np
import pytest
import torch

from kvtier.errors import ConfigError, PageCorruptedError, TierFullError, TierIOError
from kvtier.layout import KVLayout
from kvtier.tiers import remote_server as proto
from kvtier.tiers.remote import RemoteTier, start_local_server

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
    proc, address = start_local_server(capacity_bytes=64 << 20)
    yield address
    proc.terminate()
    proc.wait()


@pytest.fixture
def small_server():
    """A server with room for 2 layers x 8 pages of the bf16 test layout (512 B each)."""
    proc, address = start_local_server(capacity_bytes=2 * 8 * 512)
    yield address
    proc.terminate()
    proc.wait()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_is_bit_identical(server, dtype):
    layout = layout_of(dtype)
    tier = RemoteTier(layout, 32, server)
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


def test_two_tiers_on_one_server_do_not_mix(server):
    layout = layout_of()
    a, b = RemoteTier(layout, 4, server, name="a"), RemoteTier(layout, 4, server, name="b")
    pa, pb = rand_pages(layout, 2, seed=1), rand_pages(layout, 2, seed=2)
    a.write(0, torch.tensor([0, 1]), pa)
    b.write(0, torch.tensor([0, 1]), pb)
    assert same_bits(a.read(0, torch.tensor([0, 1])), pa) and same_bits(b.read(0, torch.tensor([0, 1])), pb)
    a.close()
    b.close()


def test_one_request_per_call(server, monkeypatch):
    layout = layout_of()
    tier = RemoteTier(layout, 64, server)
    sent = []
    real = socket.socket.sendall
    monkeypatch.setattr(socket.socket, "sendall", lambda self, data: sent.append(len(data)) or real(self, data))
    tier.write(1, torch.arange(64).flip(0), rand_pages(layout, 64))
    tier.read(1, torch.arange(0, 64, 3))
    # one header+slots send and one payload send for 64 pages, one header send for 22 pages
    assert len(sent) == 3 and sent[1] == 64 * layout.page_bytes
    tier.close()


def test_unwritten_and_freed_slots_never_read(server):
    layout = layout_of()
    tier = RemoteTier(layout, 4, server)
    slots = tier.alloc(1, 3)
    tier.write(1, slots, rand_pages(layout, 3))
    tier.free(1, slots[1:2])
    with pytest.raises(PageCorruptedError, match=f"'remote' layer 1: slots \\[{int(slots[1])}\\]"):
        tier.read(1, slots)
    assert tier.read(1, slots[[0, 2]]).shape[0] == 2
    tier.close()


def test_alloc_beyond_capacity_is_tier_full(server):
    tier = RemoteTier(layout_of(), 8, server)
    tier.alloc(0, 6)
    with pytest.raises(TierFullError, match="asked for 3 pages, 2 of 8 free"):
        tier.alloc(0, 3)
    tier.close()


def test_server_too_small_fails_at_construction(small_server):
    with pytest.raises(TierIOError, match=rf"{small_server}.*needs {2 * 9 * 512}.*--capacity-bytes"):
        RemoteTier(layout_of(), 9, small_server)


def test_server_overflow_is_refused_whole(small_server):
    """Two tiers that each fit alone share a server too small for both: the overflowing batch fails."""
    layout = layout_of()
    a = RemoteTier(layout, 8, small_server, name="a")
    b = RemoteTier(layout, 8, small_server, name="b")
    pages = rand_pages(layout, 8)
    a0, a1, b0, b1 = a.alloc(0, 8), a.alloc(1, 4), b.alloc(0, 4), b.alloc(1, 2)
    a.write(0, a0, pages)
    a.write(1, a1, pages[:4])
    b.write(0, b0, pages[4:])  # fills the store exactly
    with pytest.raises(TierIOError, match="store full.*--capacity-bytes"):
        b.write(1, b1, pages[:2])
    with pytest.raises(PageCorruptedError):
        b.read(1, b1)  # nothing of the refused batch is readable
    assert same_bits(a.read(0, a0), pages) and same_bits(b.read(0, b0), pages[4:])
    b.write(0, b0, pages[:4])  # replacing pages needs no new room
    a.free(0, a0)  # free returns bytes to the store
    b.write(1, b1, pages[:2])
    a.close()
    b.close()
    RemoteTier(layout, 8, small_server).close()  # close released everything


def test_config_errors(server):
    with pytest.raises(ConfigError, match="tiers.remote.address"):
        RemoteTier(layout_of(), 4, "localhost")
    with pytest.raises(ConfigError, match="tiers.remote.timeout_s"):
        RemoteTier(layout_of(), 4, server, timeout_s=0)
    with pytest.raises(ConfigError, match="tiers.remote.capacity"):
        RemoteTier(layout_of(), 0, server)


def test_server_listens_on_loopback_only(server):
    port = int(server.rsplit(":", 1)[1])
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if state == "0A" and int(p, 16) == port:
                listening.append(addr)
    assert listening == ["0100007F"]  # 127.0.0.1, little-endian hex; no 0.0.0.0 nor IPv6


def test_malformed_requests_are_refused_and_the_stream_stays_in_step(server):
    host, port = server.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        def ask(op, n, payload):
            sock.sendall(proto.REQUEST.pack(op, 7, 0, n, len(payload)) + bytes(8 * n) + payload)
            status, nbytes = proto.RESPONSE.unpack(proto.recv_exact(sock, proto.RESPONSE.size))
            return status, bytes(proto.recv_exact(sock, nbytes))

        assert ask(proto.OP_PUT, 2, bytes(3))[0] == proto.ERR_BAD  # 3 bytes are not 2 equal pages
        assert ask(proto.OP_PUT, 1, bytes((64 << 20) + 1))[0] == proto.ERR_FULL  # drained, not stored
        assert ask(99, 1, b"")[0] == proto.ERR_BAD
        assert ask(proto.OP_GET, 1, b"") == (proto.ERR_MISSING, b"layer 0: slots [0] are not stored here")
        status, body = ask(proto.OP_STAT, 0, b"")
        assert status == proto.OK and proto.STAT.unpack(body)[0] == 64 << 20
