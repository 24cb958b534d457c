"""RemoteTier: pages in a remote page store over TCP (the seed's tier 3 stand-in for NVMe-oF/RDMA).

Each ``read``/``write`` is one batched request to a :mod:`kvtier.tiers.remote_server` process.
The client keeps the crc32 of every page it wrote and verifies each page it gets back, so a page
the store or the wire corrupted raises ``PageCorruptedError`` instead of returning bad bytes.
A refused connection, a timeout or a dead server raises ``TierIOError`` naming the address.
"""

from __future__ import annotations

import secrets
import select
import socket
import subprocess
import sys
import tempfile
import threading

import numpy as np
import torch

from kvtier.errors import ConfigError, PageCorruptedError, TierIOError
from kvtier.layout import KVLayout
from kvtier.tiers import remote_server as proto
from kvtier.tiers.base import Tier, TierSpec
from kvtier.tiers.disk import landing, page_bytes_view, page_crcs, slot_array

_DEFAULT_SPEC = TierSpec(bandwidth_gbps=50.0, latency_s=10e-6)  # the seed's tier 3: 50-100 GB/s, 1.5-10 us


def parse_address(address: str, field: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(field, f"address {address!r} is not HOST:PORT, e.g. 127.0.0.1:7070")
    return host, int(port)


class RemoteTier(Tier):
    """Tier 3 in a remote page store: ``capacity`` pages per layer under this tier's own namespace.

    ``read`` returns CPU tensors ``[n, 2, P, N_kv, D]``. Construction connects and checks the
    store has room for ``capacity`` pages of every layer (other clients may still fill it later:
    then ``write`` raises ``TierIOError`` and stores none of that batch).
    """

    kind = "remote"

    def __init__(self, layout: KVLayout, capacity: int, address: str = "127.0.0.1:7070",
                 spec: TierSpec | None = None, name: str | None = None, timeout_s: float = 5.0):
        super().__init__(layout, capacity, spec or _DEFAULT_SPEC, name)
        self.address = address
        self._addr = parse_address(address, f"tiers.{self.name}.address")
        if not timeout_s > 0:
            raise ConfigError(f"tiers.{self.name}.timeout_s", f"must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._ns = secrets.randbits(64)
        self._crc = np.zeros((layout.num_layers, capacity), dtype=np.uint32)  # [L, cap]
        self._valid = np.zeros((layout.num_layers, capacity), dtype=bool)  # [L, cap]
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        cap_bytes, used = proto.STAT.unpack(self._request(proto.OP_STAT, 0, np.empty(0, np.int64)))
        need = layout.num_layers * capacity * layout.page_bytes
        if cap_bytes - used < need:
            self.close()
            raise TierIOError(
                f"remote tier '{self.name}': the store at {address} has {cap_bytes - used} of {cap_bytes} bytes free, "
                f"the tier needs {need} ({layout.num_layers} layers x {capacity} pages x {layout.page_bytes} B); "
                f"start the server with a larger --capacity-bytes or lower tiers.{self.name}.capacity")

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def read(self, layer, slots, out=None):
        s = slot_array(self, slots)
        bad = s[~self._valid[layer, s]]
        if bad.size:
            raise PageCorruptedError(
                f"remote tier '{self.name}' layer {layer}: slots {bad.tolist()} hold no complete page "
                "(never written, freed, or their write failed); rewrite them before reading")
        dst, buf = landing(self.layout, s.size, out)
        self._request(proto.OP_GET, layer, s, into=buf)
        mismatch = page_crcs(buf) != self._crc[layer, s]
        if mismatch.any():
            buf[mismatch] = 0
            raise PageCorruptedError(
                f"remote tier '{self.name}' layer {layer}: slots {s[mismatch].tolist()} from {self.address} "
                "failed their crc32 check; the store or the network corrupted them, rewrite them")
        return dst if out is None or out is dst else out.copy_(dst)

    def write(self, layer, slots, pages):
        self._check_pages(slots, pages)
        s = slot_array(self, slots)
        buf = page_bytes_view(pages)  # [n, page_bytes]
        crcs = page_crcs(buf)
        self._valid[layer, s] = False
        self._request(proto.OP_PUT, layer, s, payload=buf)
        self._crc[layer, s] = crcs
        self._valid[layer, s] = True

    def free(self, layer, slots):
        """Return the slots and drop their pages from the store (releasing its bytes).

        The slots are freed locally even when the store cannot be reached (``TierIOError``).
        """
        super().free(layer, slots)
        s = slot_array(self, slots)
        self._valid[layer, s] = False
        self._request(proto.OP_DEL, layer, s)

    def close(self) -> None:
        """Drop this tier's pages from the store when it is reachable, then disconnect."""
        try:
            for layer in range(self.layout.num_layers):
                held = np.flatnonzero(self._valid[layer])
                if held.size:
                    self._request(proto.OP_DEL, layer, held)
        except TierIOError:
            pass  # an unreachable store: a dead one holds nothing of ours, a hung one keeps our pages
        self._valid[:] = False
        self._disconnect()

    # -- wire --------------------------------------------------------------------------------
    def _request(self, op: int, layer: int, slots: np.ndarray, payload: np.ndarray | None = None,
                 into: np.ndarray | None = None) -> bytes:
        """One request/response; the GET payload lands in ``into`` (uint8 ``[n, page_bytes]``)."""
        body = memoryview(payload).cast("B") if payload is not None else memoryview(b"")
        head = proto.REQUEST.pack(op, self._ns, layer, slots.size, len(body)) + slots.astype("<i8").tobytes()
        with self._lock:
            try:
                sock = self._connect()
                sock.sendall(head)
                if body:
                    sock.sendall(body)
                status, nbytes = proto.RESPONSE.unpack(proto.recv_exact(sock, proto.RESPONSE.size))
                if status == proto.OK and into is not None:
                    if nbytes != into.nbytes:
                        self._disconnect()
                        raise TierIOError(f"remote tier '{self.name}': {self.address} answered {nbytes} bytes "
                                          f"for {into.nbytes}; is it a kvtier remote_server?")
                    proto.recv_into(sock, memoryview(into).cast("B"))
                    return b""
                reply = bytes(proto.recv_exact(sock, nbytes))
            except socket.timeout as e:
                self._disconnect()
                raise TierIOError(f"remote tier '{self.name}': no answer from {self.address} within "
                                  f"{self.timeout_s} s; raise tiers.{self.name}.timeout_s or check the server") from e
            except OSError as e:  # refused, reset, closed: ConnectionError is an OSError
                self._disconnect()
                raise TierIOError(f"remote tier '{self.name}': the store at {self.address} is unreachable "
                                  f"({e}); start it (python -m kvtier.tiers.remote_server) or fix "
                                  f"tiers.{self.name}.address") from e
        if status == proto.OK:
            return reply
        msg = reply.decode(errors="replace")
        if status == proto.ERR_MISSING:
            raise PageCorruptedError(f"remote tier '{self.name}' at {self.address}: {msg} (server restarted?); "
                                     "rewrite them")
        raise TierIOError(f"remote tier '{self.name}' at {self.address}: {msg}")

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.create_connection(self._addr, timeout=self.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
        return self._sock

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def start_local_server(capacity_bytes: int, corrupt_every: int = 0,
                       timeout_s: float = 30.0) -> tuple[subprocess.Popen, str]:
    """Start a :mod:`kvtier.tiers.remote_server` process on a free port: ``(process, "127.0.0.1:PORT")``.

    The caller terminates the process (``proc.terminate(); proc.wait()``) when done.
    """
    err = tempfile.TemporaryFile()
    # run the module file in isolated mode: stdlib only, so the server starts without importing torch
    cmd = [sys.executable, "-I", proto.__file__, "--port", "0",
           "--capacity-bytes", str(capacity_bytes), "--corrupt-every", str(corrupt_every)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err)
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline().strip() if ready else b""
    if not line.isdigit():
        proc.kill()
        proc.wait()
        err.seek(0)
        raise TierIOError(f"remote page server did not start within {timeout_s} s: {' '.join(cmd)}\n"
                          f"{err.read().decode(errors='replace')[-2000:]}")
    return proc, f"{proto.HOST}:{int(line)}"
