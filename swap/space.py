"""Swap space: preallocated swap files under one or more paths, carved into aligned extents.

One file per path (never one file per tensor), created at start with a unique name,
opened with O_DIRECT where the file system allows it, and preallocated with
fallocate so that an evict never meets a full disk halfway; unlinked at close.
A missing or unwritable path, or a file system with too little room, fails at start
with an error naming the path.

A region of any length is stored padded to 4096 bytes. With several paths it is
striped: stripe j (``stripe_bytes`` each) goes to file ``j % len(paths)``, in one
extent per file, so a large region reads from every device at once. ``allocate``
returns the placements: (file index, file offset, region offset, length) runs.

Several TierStores may share one SwapSpace; it is thread safe.
"""
from __future__ import annotations

import dataclasses
import errno
import logging
import os
import re
import threading
import uuid
from typing import NamedTuple

from csrc import ConfigError, SwapIOError, TierFullError
from swap.engine import ALIGNMENT_BYTES, IoEngine
from swap.extents import ExtentAllocator, align_up

logger = logging.getLogger(__name__)

__all__ = ["Placement", "SwapFile", "SwapSpace", "SwapSpaceConfig", "swap_file_owner_alive"]

_SWAP_FILE = re.compile(r"ofl-swap-(\d+)-[0-9a-f]+\.bin$")


def swap_file_owner_alive(name: str) -> bool | None:
    """Whether the process that made the swap file ``name`` (``ofl-swap-<pid>-<hex>.bin``) still runs; None
    for a name that is not a swap file's. (Its pid may since name another process: then True, and the file
    is kept.)"""
    match = _SWAP_FILE.match(name)
    if match is None:
        return None
    try:
        os.kill(int(match.group(1)), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


DEFAULT_STRIPE_BYTES = 1 << 20
"""Each swap file's size is a multiple of this (and of its share of the capacity)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SwapSpaceConfig:
    """Where swap files go and how big they are."""

    paths: tuple[str, ...]
    """Directories, one swap file each (ideally one per device)."""
    capacity_bytes: int
    """Total bytes over all files, split evenly (each rounded up to stripe_bytes)."""
    stripe_bytes: int = DEFAULT_STRIPE_BYTES
    """Striping unit across paths; a multiple of 4096."""
    preallocate: bool = True
    """fallocate the files at start; False leaves them sparse (a full disk then shows up at evict)."""

    def __post_init__(self) -> None:
        paths = (self.paths,) if isinstance(self.paths, (str, os.PathLike)) else self.paths
        object.__setattr__(self, "paths", tuple(os.fspath(p) for p in paths))
        if not self.paths:
            raise ConfigError("paths must name at least one directory")
        if len(set(self.paths)) != len(self.paths):
            raise ConfigError(f"paths has duplicates: {self.paths}")
        if self.capacity_bytes <= 0:
            raise ConfigError(f"capacity_bytes must be > 0, got {self.capacity_bytes}")
        if self.stripe_bytes <= 0 or self.stripe_bytes % ALIGNMENT_BYTES:
            raise ConfigError(f"stripe_bytes must be a positive multiple of {ALIGNMENT_BYTES}, "
                              f"got {self.stripe_bytes}")


class Placement(NamedTuple):
    """A run of a region stored contiguously in one swap file."""

    file_index: int
    file_offset: int
    region_offset: int
    nbytes: int


class SwapFile:
    """One open swap file and its extent allocator."""

    def __init__(self, index: int, directory: str, nbytes: int, preallocate: bool) -> None:
        self.index = index
        self.directory = directory
        self.nbytes = nbytes
        if not os.path.isdir(directory):
            raise SwapIOError(errno.ENOENT, f"swap path {directory} does not exist or is not a directory")
        self.path = os.path.join(directory, f"ofl-swap-{os.getpid()}-{uuid.uuid4().hex[:12]}.bin")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            self.fd = os.open(self.path, flags | os.O_DIRECT, 0o600)
            self.direct = True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise SwapIOError(exc.errno, f"swap path {directory} is not writable: cannot create "
                                             f"{self.path}: {exc.strerror}") from exc
            self.fd = os.open(self.path, flags, 0o600)
            self.direct = False
            logger.warning("swap file %s: the file system refuses O_DIRECT; using buffered I/O", self.path)
        try:
            if preallocate:
                os.posix_fallocate(self.fd, 0, nbytes)
            else:
                os.ftruncate(self.fd, nbytes)
        except OSError as exc:
            self._discard()
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise TierFullError(f"swap path {directory}: cannot preallocate {nbytes} bytes for "
                                    f"{self.path}: {exc.strerror}") from exc
            raise SwapIOError(exc.errno, f"swap path {directory}: cannot size {self.path}: {exc.strerror}") from exc
        self.allocator = ExtentAllocator(nbytes, ALIGNMENT_BYTES)

    @classmethod
    def adopt(cls, index: int, path: str, nbytes: int, inode: int) -> "SwapFile":
        """The swap file a predecessor made at ``path`` (see [Note: adopted state] in ``daemon.journal``):
        opened again, and refused with ``SwapIOError`` unless it is the same file (``inode``) of the same
        size. Its extents start all free; the adopter ``take``s the ones its regions hold."""
        self = cls.__new__(cls)
        self.index, self.directory, self.nbytes, self.path = index, os.path.dirname(path), nbytes, path
        flags = os.O_RDWR | os.O_CLOEXEC
        try:
            try:
                self.fd, self.direct = os.open(path, flags | os.O_DIRECT), True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.fd, self.direct = os.open(path, flags), False
        except OSError as exc:
            raise SwapIOError(exc.errno, f"swap file {path} of the previous daemon cannot be opened: "
                                         f"{exc.strerror}") from exc
        st = os.fstat(self.fd)
        if st.st_ino != inode or st.st_size != nbytes:
            os.close(self.fd)
            raise SwapIOError(errno.ESTALE, f"swap file {path} is not the previous daemon's (inode {st.st_ino}, "
                                            f"{st.st_size} bytes; the journal says inode {inode}, {nbytes} bytes)")
        self.allocator = ExtentAllocator(nbytes, ALIGNMENT_BYTES)
        return self

    def record(self) -> dict:
        """What a successor needs to adopt this file: its path, size and inode."""
        return {"path": self.path, "nbytes": self.nbytes, "inode": os.fstat(self.fd).st_ino}

    def _discard(self) -> None:
        os.close(self.fd)
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def check(self) -> None:
        """Raise ``SwapIOError`` if the file was deleted or replaced underneath."""
        st = os.fstat(self.fd)
        if st.st_nlink == 0:
            raise SwapIOError(errno.ENOENT, f"swap file {self.path} was deleted while in use")
        try:
            named = os.stat(self.path)
        except FileNotFoundError:
            raise SwapIOError(errno.ENOENT, f"swap file {self.path} was deleted while in use") from None
        if (named.st_dev, named.st_ino) != (st.st_dev, st.st_ino):
            raise SwapIOError(errno.ESTALE, f"swap file {self.path} was replaced while in use")

    def close(self, keep: bool = False) -> None:
        """Close the file; unlink it too unless ``keep`` (a successor adopts it)."""
        if keep:
            os.close(self.fd)
        else:
            self._discard()


class SwapSpace:
    """Preallocated swap files and the extents in them."""

    def __init__(self, config: SwapSpaceConfig, engine: IoEngine | None = None,
                 adopt: list[dict] | None = None) -> None:
        """New swap files, one per path; or, with ``adopt`` (``SwapFile.record()`` of each, in path
        order), the files a predecessor made, opened again with all their extents free."""
        self.config = config
        self.engine = engine
        self._lock = threading.Lock()
        per_file = align_up(-(-config.capacity_bytes // len(config.paths)), config.stripe_bytes)
        self.files: list[SwapFile] = []
        try:
            if adopt is not None:
                if len(adopt) != len(config.paths):
                    raise SwapIOError(errno.EINVAL, f"the previous daemon had {len(adopt)} swap file(s); "
                                                    f"[swap] paths names {len(config.paths)}")
                for i, rec in enumerate(adopt):
                    self.files.append(SwapFile.adopt(i, rec["path"], rec["nbytes"], rec["inode"]))
            for i, directory in enumerate(config.paths[len(self.files):], len(self.files)):
                self.files.append(SwapFile(i, directory, per_file, config.preallocate))
        except BaseException:
            self.close()
            raise
        logger.info("swap space: %d file(s) of %d bytes (%s)", len(self.files), per_file,
                    ", ".join(f.path for f in self.files))

    @property
    def capacity_bytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(f.allocator.used_bytes for f in self.files)

    def allocate(self, nbytes: int, what: str = "a region") -> list[Placement]:
        """Placements for ``nbytes`` padded to 4096, striped over the files; ``TierFullError`` if no room."""
        padded = align_up(nbytes, ALIGNMENT_BYTES)
        k = len(self.files)
        stripe = self.config.stripe_bytes
        nstripes = -(-padded // stripe)
        if k == 1 or nstripes == 1:
            lengths = {0: padded}
        else:  # per file, the stripes it holds; the last stripe may be short
            lengths = {}
            for j in range(nstripes):
                lengths[j % k] = lengths.get(j % k, 0) + min(stripe, padded - j * stripe)
        bases: dict[int, int] = {}
        with self._lock:
            for fi, length in lengths.items():
                offset = self.files[fi].allocator.allocate(length)
                if offset is None:
                    for done_fi, done_off in bases.items():
                        self.files[done_fi].allocator.free(done_off)
                    f = self.files[fi]
                    raise TierFullError(f"{what} needs {length} bytes in swap file {f.path}, which has "
                                        f"{f.allocator.free_bytes} of {f.nbytes} bytes free "
                                        f"(largest run {f.allocator.largest_free_bytes()})")
                bases[fi] = offset
        if len(lengths) == 1:
            return [Placement(0, bases[0], 0, padded)]
        placements = []
        for j in range(nstripes):
            fi = j % k
            placements.append(Placement(fi, bases[fi] + (j // k) * stripe, j * stripe, min(stripe, padded - j * stripe)))
        return placements

    def release(self, placements: list[Placement]) -> None:
        """Free the extents behind ``placements`` (as returned by one ``allocate``)."""
        firsts: dict[int, int] = {}
        for p in placements:
            firsts[p.file_index] = min(p.file_offset, firsts.get(p.file_index, p.file_offset))
        with self._lock:
            for fi, offset in firsts.items():
                self.files[fi].allocator.free(offset)

    def reserve(self, placements: list[Placement]) -> None:
        """Mark the extents behind ``placements`` (one ``allocate``'s) as held: an adopter's regions."""
        runs: dict[int, list[int]] = {}
        for p in placements:
            first, total = runs.get(p.file_index, (p.file_offset, 0))
            runs[p.file_index] = [min(first, p.file_offset), total + p.nbytes]
        with self._lock:
            for fi, (offset, nbytes) in runs.items():
                self.files[fi].allocator.take(offset, nbytes)

    def check(self, file_indices: set[int] | None = None) -> None:
        """Raise ``SwapIOError`` naming a swap file that was deleted or replaced underneath."""
        for f in self.files:
            if file_indices is None or f.index in file_indices:
                f.check()

    def sync(self) -> None:
        """fdatasync every swap file (O_DIRECT skips the page cache, not the device's cache)."""
        for f in self.files:
            try:
                os.fdatasync(f.fd)
            except OSError as exc:
                raise SwapIOError(exc.errno, f"fdatasync of swap file {f.path} failed: {exc.strerror}") from exc

    def close(self, keep_files: bool = False) -> None:
        """Close the swap files and unlink them (not with ``keep_files``: a successor adopts them). Idempotent."""
        files, self.files = self.files, []
        for f in files:
            f.close(keep_files)

    def __enter__(self) -> "SwapSpace":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
