"""The remote page store behind RemoteTier (the seed's tier 3, NVMe-oF/RDMA, stood in by TCP).

Run ``python -m kvtier.tiers.remote_server --port 0 --capacity-bytes N``: it listens on
127.0.0.1 only and prints the bound port as its first stdout line. Pages live in memory, keyed by
(namespace, layer, slot); a namespace is one client tier. Wire format, little-endian:

    request   op u8 | namespace u64 | layer u32 | n u32 | nbytes u64 | slots int64[n] | payload[nbytes]
    response  status u8 | nbytes u64 | payload[nbytes]

PUT stores ``n`` equal-sized pages from the payload (all or none: a batch past the byte capacity
is refused whole), GET returns the ``n`` pages concatenated, DEL drops pages, STAT returns
``capacity_bytes u64 | used_bytes u64``. Error responses carry a UTF-8 message.
``--corrupt-every N`` flips one byte of every N-th page stored (fault tests only).
"""

from __future__ import annotations

import argparse
import socket
import socketserver
import struct
import sys
import threading

REQUEST = struct.Struct("<BQIIQ")
RESPONSE = struct.Struct("<BQ")
STAT = struct.Struct("<QQ")
OP_PUT, OP_GET, OP_DEL, OP_STAT = 1, 2, 3, 4
OK, ERR_FULL, ERR_MISSING, ERR_BAD = 0, 1, 2, 3
HOST = "127.0.0.1"
_DRAIN = 1 << 20


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; ConnectionError when the peer closes first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n


def recv_exact(sock: socket.socket, nbytes: int) -> bytearray:
    buf = bytearray(nbytes)
    recv_into(sock, memoryview(buf))
    return buf


class PageStore:
    """Pages in memory under a byte capacity; every method is atomic under one lock."""

    def __init__(self, capacity_bytes: int, corrupt_every: int = 0):
        self.capacity_bytes = capacity_bytes
        self.used = 0
        self.corrupt_every = corrupt_every
        self._stored = 0
        self._pages: dict[tuple[int, int, int], bytes] = {}
        self._lock = threading.Lock()

    def put(self, ns: int, layer: int, slots: list[int], payload: memoryview) -> tuple[int, bytes]:
        size = len(payload) // len(slots)
        keys = [(ns, layer, s) for s in slots]
        with self._lock:
            replaced = sum(len(self._pages[k]) for k in set(keys) if k in self._pages)
            after = self.used - replaced + size * len(set(keys))
            if after > self.capacity_bytes:
                return ERR_FULL, (f"store full: {self.used} of {self.capacity_bytes} bytes used, this batch of "
                                  f"{len(slots)} pages needs {after - self.used} more; start the server with a "
                                  "larger --capacity-bytes or lower the remote tier's capacity").encode()
            for i, k in enumerate(keys):
                page = bytes(payload[i * size:(i + 1) * size])
                self._stored += 1
                if self.corrupt_every and self._stored % self.corrupt_every == 0:
                    page = page[:size // 2] + bytes([page[size // 2] ^ 0xFF]) + page[size // 2 + 1:]
                self._pages[k] = page
            self.used = after
        return OK, b""

    def get(self, ns: int, layer: int, slots: list[int]) -> tuple[int, bytes]:
        with self._lock:
            missing = [s for s in slots if (ns, layer, s) not in self._pages]
            if missing:
                return ERR_MISSING, f"layer {layer}: slots {missing} are not stored here".encode()
            return OK, b"".join(self._pages[(ns, layer, s)] for s in slots)

    def delete(self, ns: int, layer: int, slots: list[int]) -> tuple[int, bytes]:
        with self._lock:
            for s in set(slots):
                page = self._pages.pop((ns, layer, s), None)
                self.used -= len(page) if page is not None else 0
        return OK, b""

    def stat(self) -> tuple[int, bytes]:
        with self._lock:
            return OK, STAT.pack(self.capacity_bytes, self.used)


class _Handler(socketserver.BaseRequestHandler):
    """One client connection: requests answered in order until the client hangs up."""

    def setup(self):
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def handle(self):
        sock, store = self.request, self.server.store
        try:
            while True:
                op, ns, layer, n, nbytes = REQUEST.unpack(recv_exact(sock, REQUEST.size))
                slots = list(struct.unpack(f"<{n}q", recv_exact(sock, 8 * n)))
                refusal = (ERR_BAD, b"payload is not n equal pages") if n and nbytes % n else \
                    (ERR_FULL, b"batch larger than the store's --capacity-bytes") if nbytes > store.capacity_bytes \
                    else None
                if refusal:
                    while nbytes:  # keep the stream in step, then refuse
                        nbytes -= len(recv_exact(sock, min(nbytes, _DRAIN)))
                    status, body = refusal
                else:
                    payload = memoryview(recv_exact(sock, nbytes))
                    status, body = self._dispatch(store, op, ns, layer, slots, payload)
                sock.sendall(RESPONSE.pack(status, len(body)))
                sock.sendall(body)
        except OSError:  # the client hung up or the connection broke
            return

    @staticmethod
    def _dispatch(store: PageStore, op, ns, layer, slots, payload) -> tuple[int, bytes]:
        if op == OP_STAT:
            return store.stat()
        if not slots:
            return OK, b""
        if op == OP_PUT:
            return store.put(ns, layer, slots, payload) if len(payload) else (ERR_BAD, b"PUT without pages")
        if op == OP_GET:
            return store.get(ns, layer, slots)
        if op == OP_DEL:
            return store.delete(ns, layer, slots)
        return ERR_BAD, f"unknown op {op}".encode()


class PageServer(socketserver.ThreadingTCPServer):
    """A threaded TCP server bound to 127.0.0.1 serving one :class:`PageStore`."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, port: int, store: PageStore):
        self.store = store
        super().__init__((HOST, port), _Handler)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=0, help="TCP port on 127.0.0.1 (0: any free port)")
    ap.add_argument("--capacity-bytes", type=int, required=True, help="bytes of pages the store may hold")
    ap.add_argument("--corrupt-every", type=int, default=0, help="flip a byte of every N-th page stored (tests)")
    args = ap.parse_args(argv)
    if args.capacity_bytes <= 0:
        ap.error("--capacity-bytes must be > 0")
    with PageServer(args.port, PageStore(args.capacity_bytes, args.corrupt_every)) as server:
        print(server.server_address[1], flush=True)
        server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
