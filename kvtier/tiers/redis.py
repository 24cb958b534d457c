"""RedisTier: pages in any Redis-protocol server (Redis, Valkey) by URL, through redis-py + hiredis.

Packing: one key per page, ``kvtier:{<namespace>:<layer>}:<slot>``, whose value is the page's bytes
followed by their checksum (:func:`kvtier.tiers.disk.page_checksums`, 4 bytes, little-endian). The namespace is random per tier object (so two
caches, or two runs, on one server never collide). A batch is one ``MGET`` (reads) or one pipeline
of ``SET``s (writes): one round trip per call, never one per page. One server per URL (Redis,
Valkey); Redis Cluster is not supported yet, though the ``{...}`` hash tag already keeps a layer's
pages in one cluster slot, where a batch's MGET would have to go.

A page comes back only if it has the right length, its own checksum matches and it matches the checksum
this tier recorded when it wrote it (a page overwritten behind kvtier's back fails that). A key the
server dropped (eviction under ``maxmemory``, a ``ttl_s`` expiry, a restart) raises
``PageEvictedError``; an unreachable or silent server raises ``TierIOError``.
"""

from __future__ import annotations

import secrets
from urllib.parse import urlsplit

import numpy as np
import torch

from kvtier.errors import ConfigError, MissingDependencyError, PageCorruptedError, PageEvictedError, TierIOError
from kvtier.layout import KVLayout
from kvtier.tiers.base import Tier, TierSpec
from kvtier.tiers.disk import landing, page_bytes_view, page_checksums, slot_array

_DEFAULT_SPEC = TierSpec(bandwidth_gbps=1.0, latency_s=50e-6)  # loopback Redis, pipelined (bench/redis_tier.py)
_SUM = np.dtype("<u4")  # the page checksum stored after its bytes


def _redis():
    """redis-py, with hiredis parsing replies (the pure-Python parser would cap batched reads)."""
    try:
        import redis
        import redis.utils
    except ImportError:
        raise MissingDependencyError("redis", "redis", "RedisTier") from None
    if not redis.utils.HIREDIS_AVAILABLE:
        raise MissingDependencyError("hiredis", "redis", "RedisTier (its reply parser)")
    return redis


def check_url(url: str, field: str) -> None:
    """ConfigError(field) unless ``url`` is a Redis URL (``redis://host:port/db``, ``rediss://...``,
    ``unix:///path``)."""
    try:
        parts = urlsplit(str(url))
        ok = parts.scheme in ("redis", "rediss") and bool(parts.hostname) and parts.port is not None \
            or parts.scheme == "unix" and bool(parts.path)
    except ValueError:  # a port that is not a number
        ok = False
    if not ok:
        raise ConfigError(field, f"{url!r} is not a Redis URL; e.g. redis://127.0.0.1:6379/0 (or 'local' in a "
                                 "recipe: a server started on loopback for the run)")


def probe_url(url: str, field: str, timeout_s: float) -> None:
    """ConfigError(field) unless ``url`` is a Redis URL whose server answers ``PING`` within ``timeout_s``
    (a closed port, a silent peer or a server speaking another protocol are refused up front)."""
    check_url(url, field)
    redis = _redis()
    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        client.ping()
    except redis.exceptions.ConnectionError as e:  # refused, reset, or no route
        raise ConfigError(field, f"nothing answers at {url} ({e}); start the server, or use url=local "
                                 "(a redis-server on loopback for the run)") from None
    except redis.exceptions.RedisError as e:  # a timeout, or a reply that is not Redis' protocol
        raise ConfigError(field, f"{url} did not answer PING as a Redis server ({type(e).__name__}: {e}); "
                                 "point it at a Redis or Valkey server") from None
    finally:
        client.close()


class RedisTier(Tier):
    """Pages of ``capacity`` slots per layer in the Redis server at ``url`` (``redis://host:port/db``).

    ``read`` returns CPU tensors ``[n, 2, P, N_kv, D]``. ``ttl_s`` lets the server expire pages
    (reads of an expired page raise ``PageEvictedError``); ``timeout_s`` bounds every round trip.
    """

    kind = "remote"

    def __init__(self, layout: KVLayout, capacity: int, url: str = "redis://127.0.0.1:6379/0",
                 spec: TierSpec | None = None, name: str | None = None, timeout_s: float = 5.0,
                 ttl_s: float | None = None):
        super().__init__(layout, capacity, spec or _DEFAULT_SPEC, name)
        field = f"tiers.stack.{self.name}"
        check_url(url, f"{field}.url")
        redis = _redis()
        if not timeout_s > 0:
            raise ConfigError(f"{field}.timeout_s", f"must be > 0, got {timeout_s}")
        if ttl_s is not None and not ttl_s > 0:
            raise ConfigError(f"{field}.ttl_s", f"must be > 0 seconds or null (never expire), got {ttl_s}")
        self.url, self.timeout_s, self.ttl_s = url, timeout_s, ttl_s
        self.namespace = secrets.token_hex(8)  # this tier's own keys: never another cache's or run's
        from redis.backoff import NoBackoff
        from redis.retry import Retry
        # a dropped connection (server restarted) is redialled once; a timeout is never retried
        reconnect_once = Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,))
        self._db = self._call(lambda: redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=reconnect_once,
            single_connection_client=True))  # connects now
        self._sum = np.zeros((layout.num_layers, capacity), dtype=np.uint32)  # [L, cap] checksums written
        self._valid = np.zeros((layout.num_layers, capacity), dtype=bool)  # [L, cap]
        info = self._call(lambda: self._db.info("memory"))
        need = layout.num_layers * capacity * (layout.page_bytes + _SUM.itemsize)
        room = info["maxmemory"] - info["used_memory"]
        if info["maxmemory"] and info.get("maxmemory_policy") == "noeviction" and room < need:
            self.close()
            raise TierIOError(
                f"remote tier '{self.name}': the Redis server at {url} has {room} of {info['maxmemory']} bytes "
                f"(maxmemory) free, the tier needs {need} ({layout.num_layers} layers x {capacity} pages); "
                f"raise the server's maxmemory or lower {field}.fraction (or .size)")

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def key(self, layer: int, slot: int) -> bytes:
        """The Redis key of page ``(layer, slot)``."""
        return b"kvtier:{%s:%d}:%d" % (self.namespace.encode(), layer, slot)

    def read(self, layer, slots, out=None):
        s = slot_array(self, slots)
        bad = s[~self._valid[layer, s]]
        if bad.size:
            raise PageCorruptedError(
                f"remote tier '{self.name}' layer {layer}: slots {bad.tolist()} hold no complete page "
                "(never written, freed, or their write failed); rewrite them before reading")
        dst, buf = landing(self.layout, s.size, out)  # buf: uint8 [n, page_bytes]
        values = self._call(lambda: self._db.mget([self.key(layer, int(i)) for i in s])) if s.size else []
        pb, width = self.layout.page_bytes, self.layout.page_bytes + _SUM.itemsize
        gone, short = np.zeros(s.size, dtype=bool), np.zeros(s.size, dtype=bool)
        stored = np.zeros(s.size, dtype=np.uint32)
        rows = memoryview(buf).cast("B")  # buf's bytes, flat: each value lands straight in its row
        for i, v in enumerate(values):
            if v is None or len(v) != width:
                gone[i], short[i] = v is None, v is not None
                continue
            rows[i * pb:(i + 1) * pb] = memoryview(v)[:pb]
            stored[i] = int.from_bytes(v[pb:], "little")
        sums = page_checksums(buf)
        corrupt = short | (~gone & ((sums != stored) | (sums != self._sum[layer, s])))
        if gone.any() or corrupt.any():
            buf[gone | corrupt] = 0
            self._valid[layer, s[gone]] = False
            if gone.any():
                raise PageEvictedError(
                    f"remote tier '{self.name}' layer {layer}: slots {s[gone].tolist()} are gone from {self.url} "
                    "(evicted under maxmemory, expired, or the server restarted empty); rewrite them, or give "
                    "the server more memory or a longer ttl")
            raise PageCorruptedError(
                f"remote tier '{self.name}' layer {layer}: slots {s[corrupt].tolist()} from {self.url} failed "
                "their checksum (overwritten behind kvtier's back, or corrupted); rewrite them")
        return dst if out is None or out is dst else out.copy_(dst)

    def write(self, layer, slots, pages):
        self._check_pages(slots, pages)
        s = slot_array(self, slots)
        buf = page_bytes_view(pages)  # [n, page_bytes]
        sums = page_checksums(buf)
        pb = self.layout.page_bytes
        values = np.empty((s.size, pb + _SUM.itemsize), dtype=np.uint8)  # [n, page_bytes + 4]: page, checksum
        values[:, :pb] = buf
        values[:, pb:] = sums.astype(_SUM).view(np.uint8).reshape(-1, _SUM.itemsize)
        self._valid[layer, s] = False
        ttl_ms = None if self.ttl_s is None else max(1, round(self.ttl_s * 1000))

        def send():
            pipe = self._db.pipeline(transaction=False)
            for i, slot in enumerate(s):
                pipe.set(self.key(layer, int(slot)), values[i].data, px=ttl_ms)  # memoryview: sent without a copy
            return pipe.execute(raise_on_error=False)

        replies = self._call(send)
        failed = [r for r in replies if isinstance(r, Exception)]
        if failed:
            raise TierIOError(f"remote tier '{self.name}' layer {layer}: the Redis server at {self.url} refused "
                              f"{len(failed)} of {s.size} pages ({failed[0]}); raise its maxmemory or lower "
                              f"tiers.stack.{self.name}.fraction (or .size)")
        self._sum[layer, s] = sums
        self._valid[layer, s] = True

    def free(self, layer, slots):
        """Return the slots and delete their keys (releasing the server's memory).

        The slots are freed locally even when the server cannot be reached (``TierIOError``).
        """
        super().free(layer, slots)
        s = slot_array(self, slots)
        self._valid[layer, s] = False
        if s.size:
            self._call(lambda: self._db.delete(*[self.key(layer, int(i)) for i in s]))

    def close(self) -> None:
        """Delete this tier's keys when the server is reachable, then disconnect."""
        try:
            for layer in range(self.layout.num_layers):
                held = np.flatnonzero(self._valid[layer])
                if held.size:
                    self._call(lambda: self._db.delete(*[self.key(layer, int(i)) for i in held]))
        except TierIOError:
            pass  # an unreachable server: a dead one holds nothing of ours, a hung one keeps our keys
        self._valid[:] = False
        self._db.close()

    def _call(self, fn):
        """Run one round trip; a dead, refusing or silent server becomes ``TierIOError``."""
        redis = _redis()
        try:
            return fn()
        except redis.exceptions.TimeoutError as e:
            raise TierIOError(f"remote tier '{self.name}': no answer from {self.url} within {self.timeout_s} s; "
                              f"raise tiers.stack.{self.name}.timeout_s or check the server") from e
        except redis.exceptions.ConnectionError as e:
            raise TierIOError(f"remote tier '{self.name}': the Redis server at {self.url} is unreachable ({e}); "
                              f"start it or fix tiers.stack.{self.name}.url") from e
