"""RedisTier: pages in any Redis-protocol server (Redis, Valkey) by URL, through redis-py + hiredis.

A :class:`~kvtier.tiers.keyvalue.KeyValueTier` (one key per page, value = bytes + checksum, random
namespace per tier). A batch is one ``MGET`` (reads) or one pipeline of ``SET``s (writes): one round
trip per call, never one per page. One server per URL (Redis, Valkey); Redis Cluster is not supported
yet, though the ``{...}`` hash tag already keeps a layer's pages in one cluster slot, where a batch's
MGET would have to go. A key the server dropped (eviction under ``maxmemory``, a ``ttl_s`` expiry, a
restart) raises ``PageEvictedError``; an unreachable or silent server raises ``TierIOError``.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from kvtier.errors import ConfigError, MissingDependencyError, TierIOError
from kvtier.layout import KVLayout
from kvtier.tiers.keyvalue import KeyValueTier

LOCAL_STORE = "local"  # a recipe's url that starts a redis-server on loopback for the run (kvtier.build)


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


def check_times(field: str, timeout_s, ttl_s) -> None:
    """ConfigError unless ``timeout_s`` is a time > 0 and ``ttl_s`` one, or None."""
    for key, value, none in (("timeout_s", timeout_s, False), ("ttl_s", ttl_s, True)):
        if value is None and none:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:  # nan too
            null = " or null (never expire)" if none else ""
            raise ConfigError(f"{field}.{key}", f"must be a number of seconds > 0{null}, got {value!r}")


def auth_errors(redis) -> tuple:
    """redis-py's errors for a password the server refuses, wants, or has no use for."""
    e = redis.exceptions
    return e.AuthenticationError, e.AuthenticationWrongNumberOfArgsError, e.AuthorizationError


def probe_url(url: str, field: str, timeout_s: float) -> None:
    """ConfigError(field) unless ``url`` is a Redis URL whose server answers ``PING`` within ``timeout_s``
    (a closed port, a silent peer or a server speaking another protocol are refused up front)."""
    check_url(url, field)
    redis = _redis()
    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        client.ping()
    except auth_errors(redis) as e:
        raise ConfigError(field, f"authentication failed at {url} ({e}); put the server's user and password in "
                                 "the url (redis://user:password@host:port/db), or none for a server without one") \
            from None
    except redis.exceptions.ConnectionError as e:  # refused, reset, or no route
        raise ConfigError(field, f"nothing answers at {url} ({e}); start the server, or use url=local "
                                 "(a redis-server on loopback for the run)") from None
    except redis.exceptions.RedisError as e:  # a timeout, or a reply that is not Redis' protocol
        raise ConfigError(field, f"{url} did not answer PING as a Redis server ({type(e).__name__}: {e}); "
                                 "point it at a Redis or Valkey server") from None
    finally:
        client.close()


class RedisTier(KeyValueTier):
    """Pages of ``capacity`` slots per layer in the Redis server at ``url`` (``redis://host:port/db``).

    ``read`` returns CPU tensors ``[n, 2, P, N_kv, D]``. ``ttl_s`` lets the server expire pages
    (reads of an expired page raise ``PageEvictedError``); ``timeout_s`` bounds every round trip.
    """

    lost = "evicted under maxmemory, expired, deleted by another client (FLUSHALL, DEL), or the server restarted empty"
    refused_fix = "raise its maxmemory (or give pages a longer ttl)"

    @classmethod
    def check_settings(cls, field, layout, capacity, url, timeout_s, ttl_s, **settings) -> None:
        """The timeouts, and a server of the user's (not ``local``: one started for the run) answers."""
        check_times(field, timeout_s, ttl_s)
        if url != LOCAL_STORE:
            probe_url(url, f"{field}.url", timeout_s)

    def __init__(self, layout: KVLayout, capacity: int, url: str = "redis://127.0.0.1:6379/0",
                 name: str | None = None, timeout_s: float = 5.0,
                 ttl_s: float | None = None):
        super().__init__(layout, capacity, name)
        field = f"tiers.stack.{self.name}"
        check_url(url, f"{field}.url")
        check_times(field, timeout_s, ttl_s)
        redis = _redis()
        self.url, self.timeout_s, self.ttl_s = url, timeout_s, ttl_s
        self._client = self._stale = None  # this connection's server-side id; a timed-out one's, until killed
        from redis.backoff import NoBackoff
        from redis.retry import Retry
        # a dropped connection (server restarted) is redialled once; a timeout is never retried
        reconnect_once = Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,))
        self._db = self._call(lambda: redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=reconnect_once,
            single_connection_client=True))  # connects now
        self._client = self._call(self._db.client_id)
        info = self._call(lambda: self._db.info("memory"))
        room = info["maxmemory"] - info["used_memory"]
        if info["maxmemory"] and info.get("maxmemory_policy") == "noeviction" and room < self.stored_bytes:
            self.close()
            raise TierIOError(
                f"remote tier '{self.name}': the Redis server at {url} has {room} of {info['maxmemory']} bytes "
                f"(maxmemory) free, the tier needs {self.stored_bytes} ({layout.num_layers} layers x {capacity} "
                f"pages); raise the server's maxmemory or lower {field}.fraction (or .size)")

    @property
    def where(self) -> str:
        return f"the Redis server at {self.url}"

    def _get(self, keys):
        return self._call(lambda: self._db.mget(keys))

    def _put(self, keys, values):
        ttl_ms = None if self.ttl_s is None else max(1, round(self.ttl_s * 1000))

        def send():
            pipe = self._db.pipeline(transaction=False)
            for key, value in zip(keys, values):
                pipe.set(key, value.data, px=ttl_ms)  # memoryview: sent without a copy
            return pipe.execute(raise_on_error=False)

        return [r for r in self._call(send) if isinstance(r, Exception)]

    def _delete(self, keys):
        self._call(lambda: self._db.delete(*keys))

    def _disconnect(self):
        self._db.close()

    def _call(self, fn):
        """Run one round trip; a dead, refusing or silent server becomes ``TierIOError``. After a timeout the
        server may still hold commands the timed-out connection sent (a pipeline of writes): before the next round
        trip that connection is killed on the server, so none of them lands after a later write of the same key."""
        redis = _redis()
        try:
            if self._stale is not None:
                self._db.client_kill_filter(_id=self._stale)  # its unread commands are dropped with it
                self._stale, self._client = None, self._db.client_id()
            return fn()
        except redis.exceptions.TimeoutError as e:
            self._stale = self._stale or self._client
            raise TierIOError(f"remote tier '{self.name}': no answer from {self.url} within {self.timeout_s} s; "
                              f"raise tiers.stack.{self.name}.timeout_s or check the server") from e
        except auth_errors(redis) as e:
            raise TierIOError(f"remote tier '{self.name}': authentication failed at {self.url} ({e}); fix the user "
                              f"and password in tiers.stack.{self.name}.url") from None
        except redis.exceptions.ConnectionError as e:
            raise TierIOError(f"remote tier '{self.name}': the Redis server at {self.url} is unreachable ({e}); "
                              f"start it or fix tiers.stack.{self.name}.url") from e
