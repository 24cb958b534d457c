"""MooncakeTier: pages in a Mooncake store (the KV store of Mooncake, LMCache and SGLang HiCache).

A :class:`~kvtier.tiers.keyvalue.KeyValueTier` (one key per page, value = bytes + checksum, random
namespace per tier) over ``MooncakeDistributedStore``: a batch is one ``get_batch`` (reads) or one
``upsert_batch`` (writes). The client joins the store at ``master`` (``local``: the tier starts a
``mooncake_master`` on loopback and stops it at :meth:`close`) in P2P-handshake mode over TCP, and
mounts ``segment_size`` bytes of this process's memory into the store (None: what the tier holds
when full, so one process alone is a whole store; 0: none, other clients hold the pages).

The client's transfer engine listens on every address whatever its settings (docs/mooncake.md), so
the tier starts only in a private network namespace (loopback its only interface: run the process
under ``unshare -rn sh -c 'ip link set lo up && exec ...'``). Pages the master evicted raise
``PageEvictedError``.
"""

from __future__ import annotations

import importlib.util

from kvtier.errors import ConfigError, MissingDependencyError, TierIOError
from kvtier.layout import KVLayout
from kvtier.loopback import HOST, in_private_network
from kvtier.tiers.keyvalue import KeyValueTier
from kvtier.tiers.mooncake_master import LocalMooncakeMaster

LOCAL_MASTER = "local"


def _store_class():
    """``MooncakeDistributedStore``; the package missing is MissingDependencyError, a system library missing
    (the wheel links libibverbs and libnl without shipping them) TierIOError naming the packages."""
    if importlib.util.find_spec("mooncake") is None:
        raise MissingDependencyError("mooncake-transfer-engine-non-cuda", "mooncake", "MooncakeTier")
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as err:
        raise TierIOError(f"the Mooncake client does not load ({err}); it needs libibverbs.so.1, libnl-3.so.200 "
                          "and libnl-route-3.so.200: apt-get install libibverbs1 libnl-3-200 libnl-route-3-200")
    return MooncakeDistributedStore


class MooncakeTier(KeyValueTier):
    """Pages of ``capacity`` slots per layer in the Mooncake store whose master is at ``master``
    (``host:port``, or ``local``). ``buffer_size``: the client's transfer buffer, at least one batch."""

    lost = "evicted by the master when the store ran short, or the master restarted"
    refused_fix = "mount a larger segment (segment_size) or add clients to the store"

    def __init__(self, layout: KVLayout, capacity: int, master: str = LOCAL_MASTER,
                 name: str | None = None, segment_size: int | None = None, buffer_size: int = 256 << 20):
        super().__init__(layout, capacity, name)
        field = f"tiers.{self.name}"
        store_class = _store_class()
        if not in_private_network():
            raise ConfigError(f"{field}._target_", "the Mooncake client listens on every address (docs/mooncake.md), so "
                                     "MooncakeTier runs only in a private network namespace: start this process "
                                     "under unshare -rn sh -c 'ip link set lo up && exec ...'")
        segment = self.stored_bytes + (64 << 20) if segment_size is None else segment_size  # + allocator headroom
        for key, value in (("segment_size", segment), ("buffer_size", buffer_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{field}.{key}", f"must be a number of bytes >= 0, got {value!r}")
        self._master = LocalMooncakeMaster() if master == LOCAL_MASTER else None
        self.master = self._master.address if self._master else master
        self._store = store_class()
        rc = self._store.setup(HOST, "P2PHANDSHAKE", segment, buffer_size, "tcp", "", self.master)
        if rc:
            self._disconnect()
            raise TierIOError(f"remote tier '{self.name}': the Mooncake client could not join the store at "
                              f"{self.master} (setup returned {rc}); start its master or fix {field}.master")

    @property
    def where(self) -> str:
        return f"the Mooncake store at {self.master}"

    def _get(self, keys):
        return [value or None for value in self._store.get_batch(keys)]  # b"": not in the store

    def _put(self, keys, values):
        rc = self._store.upsert_batch(keys, list(values))
        return [f"upsert_batch returned {rc}"] * len(keys) if rc else []

    def _delete(self, keys):
        self._store.batch_remove(keys, True)  # force: past read leases

    def _disconnect(self):
        self._store.close()
        if self._master is not None:
            self._master.stop()
