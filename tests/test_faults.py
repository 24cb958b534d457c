"""Real faults under the disk and remote tiers: bit flips, truncation, interrupted and killed
writers, full disks; a real Redis killed, restarted empty, frozen, evicting, or rewritten behind
our back. Corrupted bytes must never come back as data. Under a running decode (a streaming perplexity
task on a real model), each fault stops the run at the first call it breaks, named by tier and kind, with
every token scored before it kept."""

import errno
import os
import re
import resource
import select
import shutil
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

from kvtier.errors import ConfigError, PageCorruptedError, PageEvictedError, TierFailed, TierIOError
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


# -- under a running decode: each fault named by tier and kind, the finished tokens kept ----------------------------
STREAM = dict(text="opticks", length=128, prefix=16, block_tokens=1)  # 111 decode steps
FIRST = 40  # a fault strikes before the first decode step from this one on that makes a call it breaks


@pytest.fixture(scope="module")
def small_model():
    """A 2-layer Llama (random weights, fp32, CPU) with SmolLM2's vocabulary, and SmolLM2's tokenizer: a real HF
    model whose decode step takes milliseconds, so each faulty run is a few seconds."""
    from transformers import AutoTokenizer

    from kvtier.models import ensure_smollm2, random_llama

    tok = AutoTokenizer.from_pretrained(ensure_smollm2())
    model = random_llama(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                         vocab_size=len(tok), max_position_embeddings=2048, dtype="float32", device="cpu")
    return model, tok


def decode_run(small_model, far, fault=None, at: int = 0):
    """Streaming perplexity over device (5 pages) / host (1) / ``far(layout)``, Quest placing the pages (they go
    down to the far tier and come back): ``(result, calls)``, ``calls[k]`` the far tier's calls ``(kind, layer,
    slots)`` during decode step ``k + 1`` (kind: read, write or free); ``fault(tier)`` runs before step ``at``."""
    from kvtier import DeviceTier, Engine, HostTier, LookaheadScheduler, kv_layout_for
    from kvtier.eval import Perplexity
    from kvtier.kernels.reference import TorchBackend
    from kvtier.policies import Quest
    from kvtier.scheduler.chunked_prefill import ChunkedPrefill

    model, tok = small_model
    layout = kv_layout_for(model.config, page_size=16, dtype=torch.float32)
    calls = [[]]  # the calls of the prefill, then of each decode step

    class Run(Engine):
        def step(self, tokens=None):
            calls.append([])
            if fault is not None and len(calls) - 1 == at:
                fault(self.table.tiers[2])
            return super().step(tokens)

    def make_engine():
        tier = far(layout)
        for kind in ("read", "write", "free"):
            def logged(layer, slots, *args, _real=getattr(tier, kind), _kind=kind, **kwargs):
                calls[-1].append((_kind, layer, torch.as_tensor(slots).reshape(-1).tolist()))
                return _real(layer, slots, *args, **kwargs)
            setattr(tier, kind, logged)
        return Run(model, layout, [DeviceTier(layout, 5), HostTier(layout, 1), tier], Quest(sinks=4, window=16),
                   "resident", LookaheadScheduler(), TorchBackend(), ChunkedPrefill(32))

    return Perplexity(**STREAM).run(make_engine, tok), calls[1:]


def first_step(calls, breaks: str) -> int:
    """The first decode step from :data:`FIRST` on that makes a call a fault breaks: ``stored``, a read of a page
    stored in an earlier step (and neither freed nor written since); ``io``, a read or a write; ``any``, any call."""
    stored = {}  # (layer, slot) -> the step that wrote it
    for k, step in enumerate(calls):
        for kind, layer, slots in step:
            pairs = list(zip(np.broadcast_to(layer, len(slots)).tolist(), slots))
            hit = kind == "read" and any(stored.get(x, k) < k for x in pairs) if breaks == "stored" else \
                kind != "free" if breaks == "io" else True
            if hit and k + 1 >= FIRST:
                return k + 1
            for x in pairs:
                if kind == "write":
                    stored[x] = k
                elif kind == "free":
                    stored.pop(x, None)
    raise AssertionError(f"no decode step from {FIRST} on makes a call that {breaks!r} breaks")


def assert_named_and_kept(err, clean, stop, fault_type, says):
    """The run stopped at step ``stop``, the first call the fault breaks, named the tier and the fault, and kept
    every token scored before it, exactly as the clean run scored them."""
    result = err.value.result
    assert type(err.value.fault) is fault_type and re.search(says, str(err.value.fault)), str(err.value.fault)
    assert result["partial"] and result["fault"].startswith(f"{fault_type.__name__}: ")
    assert result["scored_tokens"] == stop and result["nll_blocks"] == clean["nll_blocks"][:stop]


@pytest.fixture(scope="module")
def disk_clean(small_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("clean")
    result, calls = decode_run(small_model, lambda layout: DiskTier(layout, 16, root / "kv"))
    assert result["scored_tokens"] == 112 and FIRST < first_step(calls, "stored") < 100
    return result, calls


def _flip_every_page(tier):
    for layer in range(tier.layout.num_layers):
        with open(tier._data_path(layer), "r+b") as f:  # another writer, behind the tier's back
            for slot in tier.valid_slots(layer).tolist():
                f.seek(slot * tier.layout.page_bytes + 5)
                byte = f.read(1)[0]
                f.seek(slot * tier.layout.page_bytes + 5)
                f.write(bytes([byte ^ 0x10]))


DISK_FAULTS = {  # fault -> (inject, the calls it breaks, the error, what it says)
    "corrupted": (_flip_every_page, "stored", PageCorruptedError, r"disk tier 'disk' layer \d: slots \[\d+.*failed "
                                                                  "their checksum"),
    "truncated": (lambda t: [os.truncate(t._data_path(l), 0) for l in range(t.layout.num_layers)], "stored",
                  PageCorruptedError, r"disk tier 'disk' layer \d: slots .* cut off .*file truncated"),
    "deleted": (lambda t: shutil.rmtree(t.path), "io", TierIOError,
                r"disk tier 'disk' layer \d: .*layer_00\d\.(kv|sum) was deleted under the run"),
}


@pytest.mark.parametrize("fault", DISK_FAULTS)
def test_a_page_file_broken_under_a_running_decode_is_named_and_the_finished_part_kept(fault, small_model,
                                                                                      disk_clean, tmp_path):
    inject, breaks, fault_type, says = DISK_FAULTS[fault]
    clean, calls = disk_clean
    at = first_step(calls, breaks)
    with pytest.raises(TierFailed) as err:
        decode_run(small_model, lambda layout: DiskTier(layout, 16, tmp_path / "kv"), inject, at)
    assert_named_and_kept(err, clean, at, fault_type, says)


def test_a_disk_filling_up_under_a_running_decode_takes_none_of_its_room(small_model, disk_clean, tiny_fs):
    """The tier reserved its files when it was made: another process filling the disk mid-run changes nothing
    (the same tokens, the same scores, pages still written there); the next tier that wants room there is
    refused, by name."""
    from kvtier.tiers.disk import check_folder

    def fill(tier):
        with open(tiny_fs / "filler", "wb") as f:
            with pytest.raises(OSError, match="No space"):
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()

    result, calls = decode_run(small_model, lambda layout: DiskTier(layout, 16, tiny_fs / "kv"), fill, FIRST)
    assert result == {**disk_clean[0], "tpot_p50_s": result["tpot_p50_s"]}
    assert any(kind == "write" for step in calls[FIRST:] for kind, _, _ in step)
    layout = layout_of(layers=2)  # 4096 pages of 512 B per layer: 4 MiB, where the filler left less than 1
    with pytest.raises(TierIOError, match=rf"disk tier 'disk': {tiny_fs / 'next'} has \d+ bytes free; it needs"):
        DiskTier(layout, 4096, tiny_fs / "next")
    with pytest.raises(ConfigError, match=r"has \d+ bytes free; the disk tier reserves") as err:
        check_folder(tiny_fs / "next", "tiers.stack.disk.path", 4096 * 2 * (layout.page_bytes + 8))
    assert err.value.field == "tiers.stack.disk.path"


@pytest.fixture(scope="module")
def redis_clean(small_model):
    with LocalRedis() as server:
        result, calls = decode_run(small_model, lambda layout: RedisTier(layout, 16, server.url, name="remote"))
    assert FIRST < first_step(calls, "stored") < 100
    return result, calls


def _overwrite_every_page(tier):
    other = redis.Redis.from_url(tier.url)
    for key in other.scan_iter(f"kvtier:{{{tier.namespace}:*"):  # another client rewrites our keys
        value = other.get(key)
        other.set(key, bytes([value[0] ^ 1]) + value[1:])
    other.close()


REDIS_FAULTS = {  # fault -> (inject(tier, server), the calls it breaks, the error, what it says)
    "flushed": (lambda t, s: redis.Redis.from_url(s.url).flushall(), "stored", PageEvictedError,
                r"remote tier 'remote' layer \d: slots .* are gone from the Redis server .*deleted by another "
                r"client \(FLUSHALL"),
    "overwritten": (lambda t, s: _overwrite_every_page(t), "stored", PageCorruptedError,
                    r"remote tier 'remote' layer \d: slots .* failed their checksum \(overwritten behind kvtier"),
    "killed": (lambda t, s: s.kill(), "any", TierIOError,
               r"remote tier 'remote': the Redis server at redis://127\.0\.0\.1:\d+/0 is unreachable"),
    "killed and restarted": (lambda t, s: s.restart(), "stored", PageEvictedError,
                             r"remote tier 'remote' layer \d: slots .* are gone .*restarted empty"),
}


@pytest.mark.parametrize("fault", REDIS_FAULTS)
def test_a_redis_tier_broken_under_a_running_decode_is_named_and_the_finished_part_kept(fault, small_model,
                                                                                       redis_clean):
    inject, breaks, fault_type, says = REDIS_FAULTS[fault]
    clean, calls = redis_clean
    at = first_step(calls, breaks)
    with LocalRedis() as server:
        with pytest.raises(TierFailed) as err:
            decode_run(small_model, lambda layout: RedisTier(layout, 16, server.url, name="remote"),
                       lambda tier: inject(tier, server), at)
    assert_named_and_kept(err, clean, at, fault_type, says)
