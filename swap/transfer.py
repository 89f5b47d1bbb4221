"""Transfers of whole regions between the host pool and swap space, chunk by chunk.

A region's placements are split into chunks of at most ``chunk_bytes``; each chunk is
one engine request and carries one CRC-32C, taken over the chunk's logical bytes
(padding excluded). The engine's own I/O threads take each chunk's CRC as its blocks
complete (``crc_bytes`` at submit), so neither the thread that waits nor the wait itself
pays for it; here it is only kept (write) or compared (read). Errors are turned into
exceptions that name the region and the swap file.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
import time
from typing import Callable, NamedTuple

from csrc import ChecksumError, OffloadError, SwapIOError, TierFullError
from swap import aio
from swap.engine import IoEngine, IoRequest
from swap.space import Placement, SwapSpace

logger = logging.getLogger(__name__)

__all__ = ["BusyTime", "Chunk", "RegionTransfer", "split_chunks"]


class Chunk(NamedTuple):
    """One engine request of a region transfer."""

    file_index: int
    file_offset: int
    region_offset: int
    nbytes: int


def split_chunks(placements: list[Placement], chunk_bytes: int) -> list[Chunk]:
    """Placements cut into chunks of at most ``chunk_bytes``, in region order."""
    chunks = []
    for p in placements:
        for k in range(0, p.nbytes, chunk_bytes):
            chunks.append(Chunk(p.file_index, p.file_offset + k, p.region_offset + k, min(chunk_bytes, p.nbytes - k)))
    chunks.sort(key=lambda c: c.region_offset)
    return chunks


class BusyTime:
    """Wall time during which at least one transfer of one direction was in flight (fed in finishing order)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.bytes = 0
        self._until_ns = 0

    def add(self, start_ns: int, end_ns: int, nbytes: int) -> None:
        self.seconds += max(0, end_ns - max(start_ns, self._until_ns)) / 1e9
        self._until_ns = max(self._until_ns, end_ns)
        self.bytes += nbytes


class RegionTransfer:
    """Reads or writes one region's chunks; ``wait`` returns the outcome (None or an exception).

    For a write, ``checksums`` holds each chunk's CRC once done; for a read, ``expected``
    (if given) is compared with each chunk as it lands.
    """

    def __init__(self, *, name: str, nbytes: int, write: bool, host_address: int, chunks: list[Chunk],
                 engine: IoEngine, space: SwapSpace, checksum: bool, expected: list[int] | None) -> None:
        self.name = name
        self.nbytes = nbytes  # logical
        self.write = write
        self.chunks = chunks
        self._space = space
        self._checksum = checksum
        self.expected = expected if checksum else None
        self.checksums: list[int] = []
        self.outcome: OffloadError | None = None
        self.finished = False
        self.bytes_moved = 0
        self.start_ns = time.monotonic_ns()
        self.end_ns = self.start_ns
        op = aio.OP_WRITE if write else aio.OP_READ
        self._requests: list[IoRequest] = []
        for c in chunks:
            fd = space.files[c.file_index].fd
            crc_bytes = max(0, min(c.nbytes, nbytes - c.region_offset)) if checksum else -1  # logical bytes
            self._requests.append(engine.submit(op, fd, host_address + c.region_offset, c.nbytes, c.file_offset,
                                                crc_bytes=crc_bytes))
        self._checked = 0  # chunks whose outcome has been looked at
        self._wait_lock = threading.Lock()

    @property
    def padded_bytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    def wait(self, deadline: float | None) -> bool:
        """Wait for every chunk (until ``deadline`` on time.monotonic()); True when all are done.

        Safe from several threads at once: they take turns, and each chunk is looked at once."""
        timeout = -1 if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._wait_lock.acquire(timeout=timeout):
            return False
        try:
            return self._wait_locked(deadline)
        finally:
            self._wait_lock.release()

    def _wait_locked(self, deadline: float | None) -> bool:
        while self._checked < len(self.chunks):
            i = self._checked
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._requests[i].wait(remaining):
                return False
            if self.outcome is None:
                self.outcome = self._look_at(i)
            self._checked += 1
        if not self.finished:
            self.finished = True
            times = [r.times_ns() for r in self._requests]
            if times:
                self.start_ns = min(t[0] for t in times)
                self.end_ns = max(t[1] for t in times)
        return True

    def _look_at(self, i: int) -> OffloadError | None:
        c = self.chunks[i]
        req = self._requests[i]
        err = req.error()
        path = self._space.files[c.file_index].path if self._space.files else "(closed swap space)"
        verb = "evict" if self.write else "prefetch"
        if err:
            where = f"{c.nbytes} bytes at offset {c.file_offset} of swap file {path}"
            if err in (errno.ENOSPC, errno.EDQUOT):
                return TierFullError(f"{verb} of region {self.name!r}: no space left on the file system "
                                     f"under {os.path.dirname(path)} writing {where}; the host copy is kept")
            if err == errno.ENODATA:
                return SwapIOError(err, f"{verb} of region {self.name!r}: swap file {path} ends before "
                                        f"offset {c.file_offset + c.nbytes} (truncated underneath?)")
            return SwapIOError(err, f"{verb} of region {self.name!r}: {'write' if self.write else 'read'} of "
                                    f"{where} failed: {os.strerror(err)}")
        self.bytes_moved += c.nbytes
        if not self._checksum:
            return None
        lo = c.region_offset
        hi = min(c.region_offset + c.nbytes, self.nbytes)
        crc = req.crc()
        if crc is None:  # an engine's request always carries it after a success; say so if not
            return SwapIOError(errno.EIO, f"{verb} of region {self.name!r}: the I/O engine returned no checksum")
        if self.write:
            self.checksums.append(crc)
        elif self.expected is not None and crc != self.expected[i]:
            return ChecksumError(errno.EIO, f"prefetch of region {self.name!r}: checksum mismatch in swap file "
                                            f"{path} at offset {c.file_offset} ({hi - lo} bytes): stored "
                                            f"{self.expected[i]:08x}, read {crc:08x}; the file was corrupted or "
                                            f"changed underneath")
        return None

    def abandon(self, on_error: Callable[[BaseException], None] | None = None) -> None:
        """Wait for every chunk regardless of errors (used before freeing the memory they touch)."""
        try:
            self.wait(None)
        except BaseException as exc:  # noqa: BLE001 - reported, not swallowed silently
            if on_error is not None:
                on_error(exc)
