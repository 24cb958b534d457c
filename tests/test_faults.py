"""Real faults under the disk and remote tiers: bit flips, truncation, interrupted and killed
writers, full disks; a real Redis killed, restarted empty, frozen, evicting, or rewritten behind
our back. Corrupted bytes must never come back as data."""

import errno
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import redis
import torch

from kvtier.errors import PageCorruptedError, PageEvictedError, TierIOError
from kvtier.layout import KVLayout
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.redis import RedisTier
from kvtier.tiers.redis_server import LocalRedis

ROOT = Path(__file__).resolve().parents[1]
PAGE_SRC = textwrap.dedent('''
    def page_for(layout, slot, gen):
        """The page a writer puts in ``slot`` at generation ``gen``: ``[1, 2, P, N_kv, D]``."""
        g = torch.Generator().manual_seed(1000 * gen + slot)
        return torch.randn((1, *layout.page_shape), generator=g).to(layout.dtype)
''')
exec(PAGE_SRC)


def layout_of(dtype=torch.bfloat16, layers=1, page_size=4, heads=2, head_dim=16):
    return KVLayout(num_layers=layers, num_kv_heads=heads, head_dim=head_dim, page_size=page_size, dtype=dtype)


def rand_pages(layout, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *layout.page_shape), generator=g).to(layout.dtype)


def raw(t):
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], -1)


def same_bits(a, b):
    return torch.equal(raw(a), raw(b))


def python(code, *args, **kw):
    """Run ``code`` in a fresh interpreter that imports kvtier from this checkout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def readline(proc, timeout_s=30.0):
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, f"child said nothing within {timeout_s} s"
    line = proc.stdout.readline()
    assert line, f"child died: {proc.stderr.read()}"
    return line.strip()


@pytest.fixture
def written(tmp_path):
    """A disk tier with 8 pages written to slots 0..7 of layer 0: ``(tier, pages, data file)``."""
    layout = layout_of()
    tier = DiskTier(layout, 8, tmp_path / "kv")
    pages = rand_pages(layout, 8)
    tier.write(0, torch.arange(8), pages)
    yield tier, pages, tmp_path / "kv" / "layer_000.kv"
    tier.close()


# -- disk: corruption at rest --------------------------------------------------------------------
def test_flipped_byte_is_detected_and_never_returned(written):
    tier, pages, path = written
    pb = tier.layout.page_bytes
    with open(path, "r+b") as f:  # a raw write behind the tier's back
        f.seek(5 * pb + 17)
        byte = f.read(1)[0]
        f.seek(5 * pb + 17)
        f.write(bytes([byte ^ 0x01]))
    out = torch.ones_like(pages)
    with pytest.raises(PageCorruptedError, match=r"disk tier 'disk' layer 0: slots \[5\] failed their checksum"):
        tier.read(0, torch.arange(8), out=out)
    assert (raw(out)[5] == 0).all()  # the corrupted page's bytes did not reach the caller
    good = torch.tensor([7, 0, 1, 2, 3, 4, 6])
    assert same_bits(tier.read(0, good), pages[good])
    tier.write(0, torch.tensor([5]), pages[5:6])  # rewriting heals the slot
    assert same_bits(tier.read(0, torch.arange(8)), pages)


def test_truncated_file_is_detected(written):
    tier, pages, path = written
    pb = tier.layout.page_bytes
    os.truncate(path, 5 * pb + pb // 2)
    with pytest.raises(PageCorruptedError, match=r"slots \[5, 6, 7\] are cut off .* truncated"):
        tier.read(0, torch.arange(8))
    with pytest.raises(PageCorruptedError, match=r"slots \[6\]"):
        tier.read(0, torch.tensor([6]))
    assert same_bits(tier.read(0, torch.arange(5)), pages[:5])


# -- disk: interrupted and killed writers --------------------------------------------------------
@pytest.mark.parametrize("fault, raised", [(OSError(errno.EIO, "injected I/O error"), TierIOError),
                                           (KeyboardInterrupt(), KeyboardInterrupt)], ids=["EIO", "interrupt"])
def test_interrupted_write_leaves_the_slot_invalid(written, fault, raised):
    tier, pages, path = written
    pb = tier.layout.page_bytes
    new = rand_pages(tier.layout, 1, seed=99)

    def interrupt(layer, slots):
        raise fault

    tier._write_hook = interrupt
    with pytest.raises(raised):
        tier.write(0, torch.tensor([2]), new)
    tier._write_hook = None
    on_disk = np.fromfile(path, dtype=np.uint8)[2 * pb:3 * pb]
    assert (on_disk[:pb // 2] == raw(new)[0, :pb // 2].numpy()).all()  # the page really is torn:
    assert (on_disk[pb // 2:] == raw(pages)[2, pb // 2:].numpy()).all()  # new first half, old second half
    with pytest.raises(PageCorruptedError, match=r"slots \[2\] hold no complete page"):
        tier.read(0, torch.tensor([2]))
    others = torch.tensor([0, 1, 3, 4, 5, 6, 7])
    assert same_bits(tier.read(0, others), pages[others])


_CHILD_PRELUDE = textwrap.dedent('''
    import sys, time, torch
    from kvtier.layout import KVLayout
    from kvtier.tiers.disk import DiskTier
''') + PAGE_SRC


def test_writer_killed_mid_page_is_detected_after_reopen(tmp_path):
    """SIGKILL a writer halfway through a page; the reopened files flag exactly that page."""
    child = _CHILD_PRELUDE + textwrap.dedent('''
        layout = KVLayout(1, 2, 16, 4, dtype=torch.bfloat16)
        tier = DiskTier(layout, 8, sys.argv[1], keep=True)
        for gen in range(2):
            for slot in range(8):
                if (gen, slot) == (1, 3):
                    tier._write_hook = lambda layer, s: (print("mid", flush=True), time.sleep(60))
                tier.write(0, torch.tensor([slot]), page_for(layout, slot, gen))
    ''')
    proc = python(child, tmp_path)
    assert readline(proc) == "mid"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    layout = layout_of()
    tier = DiskTier.open_existing(tmp_path, layout)
    assert tier.valid_slots(0).tolist() == [0, 1, 2, 4, 5, 6, 7]
    for slot in range(8):
        if slot == 3:
            with pytest.raises(PageCorruptedError, match=r"slots \[3\]"):
                tier.read(0, torch.tensor([slot]))
        else:
            assert same_bits(tier.read(0, torch.tensor([slot])), page_for(layout, slot, int(slot < 3)))
    pb = layout.page_bytes
    torn = np.fromfile(tmp_path / "layer_000.kv", dtype=np.uint8)[3 * pb:4 * pb]
    assert (torn[:pb // 2] == raw(page_for(layout, 3, 1))[0, :pb // 2].numpy()).all()
    assert (torn[pb // 2:] == raw(page_for(layout, 3, 0))[0, pb // 2:].numpy()).all()
    tier.close()


def test_writer_killed_at_a_random_time_loses_at_most_the_page_in_flight(tmp_path):
    """Kill a writer at a random instant: every page called valid is exactly one it wrote whole,
    and the only page that may be invalid is the one it was writing."""
    child = _CHILD_PRELUDE + textwrap.dedent('''
        layout = KVLayout(1, 8, 256, 128, dtype=torch.bfloat16)  # 1 MiB pages
        tier = DiskTier(layout, 8, sys.argv[1], keep=True)
        pages = [[page_for(layout, slot, gen) for slot in range(8)] for gen in range(2)]
        for i in range(10**9):
            tier.write(0, torch.tensor([i % 8]), pages[(i // 8) % 2][i % 8])
            sys.stdout.write(f"{i}\\n")  # one write: a kill cannot split the line
            sys.stdout.flush()
    ''')
    layout = layout_of(page_size=128, heads=8, head_dim=256)
    expected = [[page_for(layout, slot, gen) for slot in range(8)] for gen in range(2)]
    rng = np.random.default_rng()
    proc = python(child, tmp_path)
    done = [readline(proc) for _ in range(int(rng.integers(10, 30)))]
    time.sleep(rng.uniform(0, 0.005))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done += proc.stdout.read().split("\n")[:-1]  # whole lines printed before the kill
    k = int(done[-1]) + 1  # the write in flight when the kill came
    tier = DiskTier.open_existing(tmp_path, layout)
    valid = set(tier.valid_slots(0).tolist())
    assert set(range(8)) - valid <= {k % 8}
    for slot in valid:
        got = tier.read(0, torch.tensor([slot]))
        last = k - (k - slot) % 8  # the last write begun on this slot
        options = [last] if slot != k % 8 else [k, k - 8]  # in flight: either it finished or it had not begun
        assert any(i >= 0 and same_bits(got, expected[(i // 8) % 2][slot]) for i in options), (slot, k)
    tier.close()


# -- disk: full disks ----------------------------------------------------------------------------
@pytest.fixture
def tiny_fs(tmp_path):
    """A real 1 MiB tmpfs mounted under tmp_path (needs root)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode:
        pytest.skip(f"cannot mount a 1 MiB tmpfs to fill up (needs root): {res.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_disk_too_small_fails_at_construction(tiny_fs):
    layout = layout_of(layers=2)  # 512 B pages
    path = tiny_fs / "kv"
    need = 2 * 2048 * (layout.page_bytes + 8)
    with pytest.raises(TierIOError, match=rf"{path} has \d+ bytes free; it needs {need} bytes.*larger disk"):
        DiskTier(layout, 2048, path)
    assert list(tiny_fs.iterdir()) == []  # nothing written, not even the directory
    DiskTier(layout, 256, path).close()  # what fits, fits


def test_disk_full_during_write_is_an_io_error(tiny_fs):
    layout = layout_of()
    tier = DiskTier(layout, 64, tiny_fs / "kv")
    pages = rand_pages(layout, 4)
    tier.write(0, torch.arange(4), pages)
    os.truncate(tier._data_path(0), 4 * layout.page_bytes)  # give the reservation back ...
    with open(tiny_fs / "filler", "wb") as f:  # ... and let someone else take the disk
        with pytest.raises(OSError, match="No space"):
            while True:
                f.write(b"\0" * 65536)
                f.flush()
    with pytest.raises(TierIOError, match=rf"slots \[40\] to {tier._data_path(0)} failed .*No space.*free space"):
        tier.write(0, torch.tensor([40]), pages[:1])
    with pytest.raises(PageCorruptedError, match=r"slots \[40\]"):
        tier.read(0, torch.tensor([40]))
    assert same_bits(tier.read(0, torch.arange(4)), pages)  # nothing corrupted
    tier.close()


def test_file_size_limit_fails_the_reservation(tmp_path):
    """RLIMIT_FSIZE in a forked child: posix_fallocate is refused, the error names path and bytes."""
    path = tmp_path / "kv"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child makes file system calls only (no torch ops), so forking is safe
        try:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail with EFBIG instead of dying
            resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
            DiskTier(layout_of(layers=2), 1024, path)  # 512 KiB per layer file
            msg = "constructed"
        except BaseException as e:
            msg = f"{type(e).__name__}: {e}"
        finally:
            os.write(w, msg.encode())
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        msg = f.read()
    os.waitpid(pid, 0)
    assert msg.startswith("TierIOError") and "refused the reservation" in msg, msg
    assert str(path) in msg and f"needs {2 * 1024 * 520} bytes" in msg
    assert not path.exists()  # the partly reserved files, and the directory the tier made, were removed


# -- remote (a real redis-server on loopback) ------------------------------------------------------
def test_server_killed_mid_run_is_an_io_error():
    server = LocalRedis()
    layout = layout_of()
    tier = RedisTier(layout, 8, server.url, timeout_s=2.0)
    pages = rand_pages(layout, 4)
    tier.write(0, torch.arange(4), pages)
    assert same_bits(tier.read(0, torch.arange(4)), pages)
    server.stop()
    with pytest.raises(TierIOError, match=f"Redis server at {server.url} is unreachable"):
        tier.read(0, torch.arange(4))
    with pytest.raises(TierIOError, match=server.url):
        tier.write(0, torch.arange(4), pages)
    with pytest.raises(TierIOError, match=rf"{server.url} is unreachable \(.*refused"):
        RedisTier(layout, 8, server.url)
    tier.close()  # closing against a dead server does not raise


def test_server_restarted_empty_is_a_named_error_and_rewriting_heals():
    with LocalRedis() as server:
        layout = layout_of(layers=2)
        tier = RedisTier(layout, 8, server.url, timeout_s=2.0)
        pages = rand_pages(layout, 4)
        tier.write(1, torch.arange(4), pages)
        server.restart()  # same port, nothing persisted
        out = torch.ones_like(pages)
        with pytest.raises(PageEvictedError, match=r"layer 1: slots \[0, 1, 2, 3\] are gone .*restarted empty"):
            tier.read(1, torch.arange(4), out=out)
        assert (raw(out) == 0).all()
        with pytest.raises(PageCorruptedError, match="hold no complete page"):  # known lost from now on
            tier.read(1, torch.tensor([2]))
        tier.write(1, torch.tensor([2]), pages[2:3])
        assert same_bits(tier.read(1, torch.tensor([2])), pages[2:3])
        tier.close()


def test_frozen_server_times_out():
    with LocalRedis() as server:
        layout = layout_of(page_size=64, heads=8, head_dim=128)
        tier = RedisTier(layout, 128, server.url, timeout_s=0.3)
        pages = rand_pages(layout, 2)
        tier.write(0, torch.tensor([1, 2]), pages)
        server.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(TierIOError, match=rf"no answer from {server.url} within 0.3 s.*timeout_s"):
                tier.read(0, torch.tensor([1, 2]))
            with pytest.raises(TierIOError, match=rf"no answer from {server.url} within 0.3 s"):
                tier.write(0, torch.arange(128), rand_pages(layout, 128))  # 32 MiB: more than socket buffers hold
        finally:
            server.proc.send_signal(signal.SIGCONT)
        with pytest.raises(PageCorruptedError, match=r"slots \[0, 1, 2, 3"):
            tier.read(0, torch.arange(4))  # the timed-out write left its slots invalid
        tier.write(0, torch.tensor([1, 2]), pages)  # a fresh connection works again
        assert same_bits(tier.read(0, torch.tensor([1, 2])), pages)
        tier.close()


def test_silent_peer_times_out_at_construction():
    with socket.socket() as listener:  # accepts connections (backlog), never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
        with pytest.raises(TierIOError, match=f"no answer from {url} within 0.2 s"):
            RedisTier(layout_of(), 4, url, timeout_s=0.2)


def test_page_overwritten_behind_kvtiers_back_is_detected():
    """Another client rewrites keys: with different bytes of the right size, with a self-consistent
    page (its own checksum correct) from another slot, and with a short value. None comes back as data."""
    with LocalRedis() as server:
        layout = layout_of(torch.float16)
        tier = RedisTier(layout, 16, server.url)
        other = redis.Redis.from_url(server.url)
        slots = torch.tensor([9, 2, 14, 0, 5, 11, 7])
        pages = rand_pages(layout, 7)
        tier.write(0, slots, pages)
        value = other.get(tier.key(0, 14))
        other.set(tier.key(0, 14), bytes([value[0] ^ 1]) + value[1:])  # one flipped bit
        other.set(tier.key(0, 11), other.get(tier.key(0, 9)))  # a valid page, but not this slot's
        other.set(tier.key(0, 7), value[:100])  # truncated
        out = torch.ones_like(pages)
        with pytest.raises(PageCorruptedError, match=r"layer 0: slots \[14, 11, 7\] from .* checksum .*behind kvtier"):
            tier.read(0, slots, out=out)
        assert (raw(out)[[2, 5, 6]] == 0).all()
        good = [0, 1, 3, 4]
        assert same_bits(tier.read(0, slots[good]), pages[good])
        tier.write(0, slots[[2]], pages[[2]])  # rewriting heals the slot
        assert same_bits(tier.read(0, slots[[2]]), pages[[2]])
        other.close()
        tier.close()


def test_pages_evicted_under_maxmemory_or_expired_are_named_errors():
    with LocalRedis(maxmemory=4 << 20, policy="allkeys-random") as server:
        layout = KVLayout(num_layers=1, num_kv_heads=8, head_dim=128, page_size=64, dtype=torch.bfloat16)  # 256 KiB
        tier = RedisTier(layout, 32, server.url)
        pages = rand_pages(layout, 32)
        tier.write(0, torch.arange(32), pages)  # 8 MiB into 4 MiB: the server evicts at random
        with pytest.raises(PageEvictedError, match=r"slots \[.*\] are gone .*evicted under maxmemory"):
            tier.read(0, torch.arange(32))
        kept = torch.tensor([i for i in range(32) if tier._valid[0, i]])
        assert 0 < kept.numel() < 32 and same_bits(tier.read(0, kept), pages[kept])
        tier.close()
    with LocalRedis() as server:
        tier = RedisTier(layout_of(), 4, server.url, ttl_s=0.05)
        tier.write(0, torch.arange(2), rand_pages(layout_of(), 2))
        time.sleep(0.3)
        with pytest.raises(PageEvictedError, match=r"slots \[0, 1\] are gone .*expired"):
            tier.read(0, torch.arange(2))
        tier.close()
