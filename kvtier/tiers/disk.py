"""DiskTier: pages in one scratch file per layer (the NVMe tier), checksummed per page.

``<path>/layer_{l:03d}.kv`` holds slot ``s`` of layer ``l`` at byte ``s * page_bytes``;
``<path>/layer_{l:03d}.sum`` holds one little-endian ``(checksum, valid)`` uint32 pair per slot
(:func:`page_checksums`).
A write marks its slots invalid (in memory and in the sidecar), writes the data, then records
the checksums, so a write cut short by an error or a crash leaves its slots invalid, never torn
data behind a valid checksum. Reads verify every page; a bad page raises ``PageCorruptedError``
and its bytes are never returned. Both files are reserved in full with ``posix_fallocate`` at
construction, so a disk too small for the capacity fails there, not mid-run.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import xxhash

from kvtier.errors import ConfigError, PageCorruptedError, TierIOError
from kvtier.layout import KVLayout
from kvtier.tiers.base import Tier

_META = np.dtype("<u4")  # sidecar entry: (checksum, valid) per slot


def _runs(slots: np.ndarray) -> list[tuple[int, int]]:
    """Split ``slots`` ``[n]`` into ``(start, stop)`` index ranges of consecutive slot ids."""
    cuts = np.flatnonzero(np.diff(slots) != 1) + 1
    edges = [0, *cuts.tolist(), slots.size]
    return list(zip(edges[:-1], edges[1:]))


def page_checksums(buf: np.ndarray) -> np.ndarray:
    """Checksum of each row of a uint8 ``[n, page_bytes]`` buffer: uint32 ``[n]``, the low 32 bits of
    the row's xxh3-64 hash (17-33 GB/s on one core here, 4-8x zlib's crc32; faster than an NVMe drive or a
    loopback Redis, so checking every page costs a few percent of a read)."""
    return np.fromiter((xxhash.xxh3_64_intdigest(row) & 0xFFFFFFFF for row in buf), dtype=np.uint32,
                       count=buf.shape[0])


def slot_array(tier: Tier, slots: torch.Tensor) -> np.ndarray:
    """``slots`` as int64 numpy ``[n]``, checked against the tier's capacity."""
    s = np.asarray(slots.cpu(), dtype=np.int64).reshape(-1)
    if s.size and (s.min() < 0 or s.max() >= tier.capacity):
        raise ValueError(f"tier '{tier.name}': slots {s.tolist()} outside [0, {tier.capacity})")
    return s


def page_bytes_view(pages: torch.Tensor) -> np.ndarray:
    """Contiguous CPU uint8 ``[n, page_bytes]`` view (or copy) of pages ``[n, 2, P, N_kv, D]``."""
    flat = pages.detach().to("cpu").contiguous().view(torch.uint8)
    return flat.numpy().reshape(pages.shape[0], -1)


def landing(layout: KVLayout, n: int, out: torch.Tensor | None) -> tuple[torch.Tensor, np.ndarray]:
    """Where a read of ``n`` pages lands, and its uint8 ``[n, page_bytes]`` view.

    ``out`` itself when it is a contiguous CPU ``[n, 2, P, N_kv, D]`` of the layout's dtype (bytes
    go straight into it), else a new CPU tensor the caller copies into ``out``.
    """
    want = (n, *layout.page_shape)
    fits = out is not None and out.device.type == "cpu" and out.is_contiguous() \
        and out.dtype == layout.kv_dtype and tuple(out.shape) == want
    dst = out if fits else torch.empty(want, dtype=layout.kv_dtype)
    return dst, dst.view(torch.uint8).numpy().reshape(n, -1)


def check_folder(path: str | Path, field: str, need_bytes: int = 0) -> None:
    """ConfigError(field) unless ``path`` is, or can be made inside, a writable directory (tried: a folder made in
    its nearest existing ancestor and removed) with ``need_bytes`` free there."""
    path = Path(path).expanduser().absolute()
    above = next(p for p in (path, *path.parents) if p.exists())
    try:
        if not above.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a directory")
        os.rmdir(tempfile.mkdtemp(prefix=".kvtier-probe-", dir=above))
    except OSError as e:
        raise ConfigError(field, f"{above} is not a writable directory ({e.strerror}), so {path} cannot be used; "
                                 "point it at a writable directory") from None
    st = os.statvfs(above)
    if st.f_bavail * st.f_frsize < need_bytes:
        raise ConfigError(field, f"{above} has {st.f_bavail * st.f_frsize} bytes free; the disk tier reserves "
                                 f"{need_bytes} bytes there; point it at a larger disk, or lower "
                                 f"{field.rsplit('.', 1)[0]}.fraction (or .size)")


def reserved_bytes(layout: KVLayout, capacity: int) -> int:
    """Bytes a DiskTier of ``capacity`` pages per layer reserves: its data files and their checksum sidecars."""
    return layout.num_layers * capacity * (layout.page_bytes + 2 * _META.itemsize)


class DiskTier(Tier):
    """The NVMe tier: ``capacity`` pages per layer in ``<path>/layer_XXX.kv`` on a local disk.

    ``read`` returns CPU tensors ``[n, 2, P, N_kv, D]``. ``fsync=True`` makes each write durable
    (data, then checksums) before it returns. The files are scratch space, deleted by
    :meth:`close` unless ``keep=True``; :meth:`open_existing` reopens kept (or crashed) files.
    ``_write_hook(layer, slots)``, when set, runs halfway through writing a run of pages: the
    fault tests use it to interrupt a write part-way.
    """

    kind = "disk"

    @classmethod
    def check_settings(cls, field, layout, capacity, path, **settings) -> None:
        check_folder(path, f"{field}.path", reserved_bytes(layout, capacity))

    def __init__(self, layout: KVLayout, capacity: int, path: str | Path, name: str | None = None,
                 fsync: bool = False, keep: bool = False):
        super().__init__(layout, capacity, name)
        self._setup(Path(path), fsync, keep, create=True)

    @classmethod
    def open_existing(cls, path: str | Path, layout: KVLayout, name: str | None = None,
                      fsync: bool = False, keep: bool = True) -> "DiskTier":
        """Reopen the files of a DiskTier built with ``keep=True`` (e.g. after its process crashed).

        Capacity comes from the sidecars. Pages whose write never completed read as
        ``PageCorruptedError``; :meth:`valid_slots` lists the rest. Every slot starts free.
        """
        path = Path(path)
        sum_files = [path / f"layer_{l:03d}.sum" for l in range(layout.num_layers)]
        try:
            sizes = sorted({f.stat().st_size for f in sum_files})
        except OSError as e:
            raise TierIOError(f"disk tier at {path}: cannot reopen, {e}; open_existing needs the "
                              "files of a DiskTier built with keep=True and the same layout") from e
        entry = 2 * _META.itemsize
        if len(sizes) != 1 or sizes[0] == 0 or sizes[0] % entry:
            raise TierIOError(f"disk tier at {path}: checksum sidecars have sizes {sizes}, expected one "
                              f"common non-zero multiple of {entry} bytes; the files are not one DiskTier's")
        self = cls.__new__(cls)
        Tier.__init__(self, layout, sizes[0] // entry, name)
        self._setup(path, fsync, keep, create=False)
        for l in range(layout.num_layers):
            self._meta[l] = np.fromfile(self._sum_path(l), dtype=_META).reshape(self.capacity, 2)
        return self

    # -- setup -------------------------------------------------------------------------------
    def _setup(self, path: Path, fsync: bool, keep: bool, create: bool) -> None:
        self.fsync = fsync
        self.keep = keep
        self._write_hook: Callable[[int, np.ndarray], None] | None = None
        self._field = f"tiers.stack.{self.name}.path"
        self.path, self._made_dir = self._claim_dir(path, create)
        self._meta = np.zeros((self.layout.num_layers, self.capacity, 2), dtype=_META)  # [L, cap, (checksum, valid)]
        self._cut = np.zeros((self.layout.num_layers, self.capacity), dtype=bool)  # [L, cap] lost to a truncation
        self._open_files(create)

    def _claim_dir(self, path: Path, create: bool) -> tuple[Path, bool]:
        """Validate (and make) the directory, then lock it against a second live DiskTier."""
        path = path.expanduser().absolute()
        made = False
        check_folder(path, self._field)
        if not path.exists() and create:
            try:
                path.mkdir(parents=True)
                made = True
            except OSError as e:
                raise ConfigError(self._field, f"cannot create directory {path}: {e.strerror}; "
                                               "point it at a writable directory") from e
        self._dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(self._dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self._dir_fd)
            raise ConfigError(self._field, f"{path} is in use by another live DiskTier; "
                                           "give each disk tier its own directory") from e
        return path, made

    def _data_path(self, layer: int) -> Path:
        return self.path / f"layer_{layer:03d}.kv"

    def _sum_path(self, layer: int) -> Path:
        return self.path / f"layer_{layer:03d}.sum"

    def _open_files(self, create: bool) -> None:
        """Open (and, when creating, reserve) one data file and one sidecar per layer."""
        L, cap, pb = self.layout.num_layers, self.capacity, self.layout.page_bytes
        sizes = (cap * pb, cap * 2 * _META.itemsize)
        self._fds: list[int] = []
        self._sum_fds: list[int] = []
        if create:
            need = reserved_bytes(self.layout, cap)
            st = os.statvfs(self.path)
            if st.f_bavail * st.f_frsize < need:
                self._shutdown(delete=True)
                raise TierIOError(self._too_small(need, f"has {st.f_bavail * st.f_frsize} bytes free"))
        flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
        try:
            for l in range(L):
                for fds, p, size in ((self._fds, self._data_path(l), sizes[0]),
                                     (self._sum_fds, self._sum_path(l), sizes[1])):
                    fds.append(os.open(p, flags, 0o600))
                    if create:
                        os.posix_fallocate(fds[-1], 0, size)
        except OSError as e:
            self._shutdown(delete=create)
            if create and e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                raise TierIOError(self._too_small(reserved_bytes(self.layout, cap),
                                                  f"refused the reservation ({e.strerror})")) from e
            raise TierIOError(f"disk tier '{self.name}': cannot open its files in {self.path}: {e}") from e

    def _too_small(self, need: int, why: str) -> str:
        return (f"disk tier '{self.name}': {self.path} {why}; it needs {need} bytes "
                f"({self.layout.num_layers} layers x {self.capacity} pages x {self.layout.page_bytes} B "
                f"+ checksums); lower {self._field.rsplit('.', 1)[0]}.capacity or point {self._field} "
                "at a larger disk")

    # -- data --------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def valid_slots(self, layer: int) -> np.ndarray:
        """Slots of ``layer`` holding a completely written page: int64 ``[k]``."""
        return np.flatnonzero(self._meta[layer, :, 1])

    def read(self, layer, slots, out=None):
        fd, pb = self._fd(layer), self.layout.page_bytes
        s = slot_array(self, slots)
        bad = s[self._meta[layer, s, 1] == 0]
        if self._cut[layer, bad].any():
            raise PageCorruptedError(
                f"disk tier '{self.name}' layer {layer}: slots {bad[self._cut[layer, bad]].tolist()} are cut off by "
                f"another process that truncated {self._data_path(layer)} (file truncated); rewrite them")
        if bad.size:
            raise PageCorruptedError(
                f"disk tier '{self.name}' layer {layer}: slots {bad.tolist()} hold no complete page "
                "(never written, freed, or their write was interrupted); rewrite them before reading")
        dst, buf = landing(self.layout, s.size, out)
        for a, b in _runs(s):
            got = self._preadv(fd, buf[a:b], int(s[a]) * pb, self._data_path(layer))
            if got < (b - a) * pb:
                buf[a:b] = 0
                raise PageCorruptedError(
                    f"disk tier '{self.name}' layer {layer}: slots {s[a + got // pb:b].tolist()} are cut off "
                    f"by a short read of {self._data_path(layer)} (file truncated); rewrite them")
        mismatch = page_checksums(buf) != self._meta[layer, s, 0]
        if mismatch.any():
            buf[mismatch] = 0
            raise PageCorruptedError(
                f"disk tier '{self.name}' layer {layer}: slots {s[mismatch].tolist()} failed their checksum "
                f"check in {self._data_path(layer)}; the disk corrupted them, rewrite them")
        return dst if out is None or out is dst else out.copy_(dst)

    def write(self, layer, slots, pages):
        fd, pb = self._fd(layer), self.layout.page_bytes
        self._check_pages(slots, pages)
        s = slot_array(self, slots)
        buf = page_bytes_view(pages)  # [n, page_bytes]
        sums = page_checksums(buf)
        path = self._data_path(layer)
        runs = _runs(s)
        try:
            self._meta[layer, s, 1] = 0
            self._write_meta(layer, s, runs)
            for a, b in runs:
                view, off = memoryview(buf[a:b]).cast("B"), int(s[a]) * pb
                half = len(view) // 2 if self._write_hook is not None else len(view)
                self._pwrite_all(fd, view[:half], off)
                if self._write_hook is not None:
                    self._write_hook(layer, s[a:b])
                self._pwrite_all(fd, view[half:], off + half)
            if self.fsync:
                os.fdatasync(fd)
            self._meta[layer, s, 0] = sums
            self._meta[layer, s, 1] = 1
            self._cut[layer, s] = False
            path = self._sum_path(layer)
            self._write_meta(layer, s, runs)
            if self.fsync:
                os.fdatasync(self._sum_fds[layer])
        except OSError as e:
            self._meta[layer, s, 1] = 0
            hint = "free space on that disk or lower the tier's capacity" if e.errno == errno.ENOSPC else \
                "check the disk"
            raise TierIOError(f"disk tier '{self.name}' layer {layer}: writing slots {s.tolist()} to {path} "
                              f"failed ({e}); those slots now read as corrupted; {hint}") from e

    def free(self, layer, slots):
        super().free(layer, slots)
        slots = slot_array(self, slots)
        layers = np.broadcast_to(np.asarray(layer, dtype=np.int64), slots.shape)
        for layer in np.unique(layers).tolist():
            s = np.sort(slots[layers == layer])
            self._meta[layer, s, 1] = 0
            self._cut[layer, s] = False
            try:
                self._write_meta(layer, s, _runs(s))
            except OSError as e:
                raise TierIOError(f"disk tier '{self.name}': invalidating freed slots in {self._sum_path(layer)} "
                                  f"failed ({e})") from e

    def close(self) -> None:
        """Close the files and delete them (and the directory, if this tier made it) unless ``keep``."""
        if self._dir_fd is not None:
            self._shutdown(delete=not self.keep)

    # -- I/O helpers -------------------------------------------------------------------------
    def _fd(self, layer: int) -> int:
        """The data file of ``layer``, checked to be open, still in its folder (an open file outlives its deletion,
        but a tier whose files another process deleted has lost its place on the disk) and whole: after a truncation
        behind the tier, the pages cut off read as such, and the file is reserved again where the disk has room (else
        the writes that find none say so)."""
        if not self._fds:
            raise TierIOError(f"disk tier '{self.name}' at {self.path} is closed")
        for fd, path in ((self._fds[layer], self._data_path(layer)), (self._sum_fds[layer], self._sum_path(layer))):
            if os.fstat(fd).st_nlink == 0:
                raise TierIOError(f"disk tier '{self.name}' layer {layer}: {path} was deleted under the run (by "
                                  "another process, a temp-folder cleaner?); its pages are lost with it: give the "
                                  f"tier a folder nothing else cleans (tiers.stack.{self.name}.path)")
        fd, pb = self._fds[layer], self.layout.page_bytes
        if (size := os.fstat(fd).st_size) < self.capacity * pb:
            cut = np.flatnonzero(self._meta[layer, :, 1])
            cut = cut[(cut + 1) * pb > size]  # [k] valid pages past the new end
            self._meta[layer, cut, 1] = 0
            self._cut[layer, cut] = True
            with contextlib.suppress(OSError):
                if cut.size:
                    self._write_meta(layer, cut, _runs(cut))
                os.posix_fallocate(fd, 0, self.capacity * pb)
        return fd

    def _write_meta(self, layer: int, s: np.ndarray, runs: list[tuple[int, int]]) -> None:
        """Copy the sidecar entries of ``s[a:b]`` for each run to disk."""
        entry = 2 * _META.itemsize
        for a, b in runs:
            self._pwrite_all(self._sum_fds[layer], self._meta[layer, s[a]:s[a] + (b - a)].tobytes(), int(s[a]) * entry)

    @staticmethod
    def _pwrite_all(fd: int, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        while view:
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n

    def _preadv(self, fd: int, rows: np.ndarray, offset: int, path: Path) -> int:
        """Read into ``rows`` (uint8 ``[k, page_bytes]``) from ``offset``; bytes read (short at EOF)."""
        view, got = memoryview(rows).cast("B"), 0
        try:
            while got < len(view):
                n = os.preadv(fd, [view[got:]], offset + got)
                if n == 0:
                    break
                got += n
        except OSError as e:
            raise TierIOError(f"disk tier '{self.name}': reading {path} failed ({e}); check the disk") from e
        return got

    def _shutdown(self, delete: bool) -> None:
        """Close every fd (dropping the directory lock); with ``delete``, remove what this tier made."""
        for fd in self._fds + self._sum_fds:
            os.close(fd)
        if delete:
            for l in range(self.layout.num_layers):
                self._data_path(l).unlink(missing_ok=True)
                self._sum_path(l).unlink(missing_ok=True)
            if self._made_dir:
                try:
                    self.path.rmdir()
                except OSError:
                    pass  # someone else put files there: leave the directory
        self._fds, self._sum_fds = [], []
        os.close(self._dir_fd)
        self._dir_fd = None
