"""Shared-memory segments: memfd creation, passing with SCM_RIGHTS, mapping in the client.

Layout
------
A session's host memory is a list of memfd segments owned by the daemon (the session's
``HostPool``). A segment has no header and no trailer: it is ``nbytes`` bytes of plain
memory, ``nbytes`` a multiple of 4096, pre-touched by the daemon when it is created so
that no client pays first-touch faults (1.2 GB/s here, against 10-15 GB/s into
resident pages). Its size is sealed (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``)
before its fd leaves the daemon: a client cannot truncate the memory under the
daemon's own mapping (which would kill the daemon with SIGBUS), only read and write it. A region the store places at ``(segment_index, offset)`` occupies
bytes ``[offset, offset + nbytes)`` of that segment; offsets are 4096-aligned.

Who writes what:

* the daemon's I/O engine writes a region while a prefetch of it is in flight and
  reads it while an evict (write-back) of it is in flight;
* the client reads and writes a region between ALLOCATE (or a completed
  WAIT_PREFETCH) and the next EVICT of it, and says MARK_DIRTY after writing.

Nothing else is shared: no locks or counters live in the segments. Each session's
segments are passed only to the connection that opened (or reattached) that session,
so no client can map another session's memory; the daemon never accepts an address
or an offset from a client, only region names scoped to the caller's session.

Passing
-------
The HELLO reply frame carries the segment fds as one SCM_RIGHTS message (at most
``MAX_FDS_PER_MESSAGE``), in the order of the reply's ``segments`` list. The client
maps each with ``MAP_SHARED | MAP_POPULATE`` and keeps its fd copy until it closes, to hand
it back to a daemon restarted without it ([Note: hand-back] in ``daemon.handback``).
"""
from __future__ import annotations

import array
import ctypes
import fcntl
import logging
import mmap
import os
import socket
from typing import NamedTuple, Sequence

from csrc.errors import ProtocolError

logger = logging.getLogger(__name__)

__all__ = [
    "PAGE_BYTES",
    "MAX_FDS_PER_MESSAGE",
    "MemfdSegment",
    "create_segment",
    "send_with_fds",
    "recv_with_fds",
    "SegmentMap",
]

PAGE_BYTES = mmap.PAGESIZE
MAX_FDS_PER_MESSAGE = 253  # the kernel's SCM_MAX_FD


class MemfdSegment(NamedTuple):
    """One memfd segment: the fd (owned by whoever created it), its size and position."""

    fd: int
    nbytes: int
    index: int


def create_segment(nbytes: int, index: int, name: str = "offload-seg") -> MemfdSegment:
    """A new memfd of ``nbytes`` (a page multiple), size sealed, with every page touched once."""
    if nbytes <= 0 or nbytes % PAGE_BYTES:
        raise ValueError(f"segment nbytes must be a positive multiple of {PAGE_BYTES}, got {nbytes}")
    fd = os.memfd_create(f"{name}-{index}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        with mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE) as m:
            # MAP_POPULATE faults the pages in; writing one byte per page makes sure
            # shmem really allocated them (a read fault could map the zero page).
            for off in range(0, nbytes, PAGE_BYTES):
                m[off] = 0
    except BaseException:
        os.close(fd)
        raise
    return MemfdSegment(fd, nbytes, index)


def send_with_fds(sock: socket.socket, data: bytes, fds: Sequence[int]) -> int:
    """Send ``data`` with ``fds`` attached to its first byte; returns bytes sent."""
    if len(fds) > MAX_FDS_PER_MESSAGE:
        raise ProtocolError(f"{len(fds)} fds exceed the {MAX_FDS_PER_MESSAGE} one message can carry")
    return socket.send_fds(sock, [data], list(fds))


def recv_with_fds(sock: socket.socket, bufsize: int) -> tuple[bytes, list[int]]:
    """``recv`` that also collects any fds attached to the bytes it returns."""
    fds = array.array("i")
    data, ancdata, flags, _ = sock.recvmsg(bufsize, socket.CMSG_SPACE(MAX_FDS_PER_MESSAGE * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
    if flags & socket.MSG_CTRUNC:
        for fd in fds:
            os.close(fd)
        raise ProtocolError("file descriptors were truncated in transit (MSG_CTRUNC)")
    return data, list(fds)


class SegmentMap:
    """The client's mappings of its session's segments, indexed by segment index."""

    def __init__(self, fds: Sequence[int], sizes: Sequence[int]) -> None:
        if len(fds) != len(sizes):
            for fd in fds:
                os.close(fd)
            raise ProtocolError(f"HELLO reply lists {len(sizes)} segments but carried {len(fds)} fds")
        self._maps: list[mmap.mmap] = []
        self._anchors: list[ctypes.c_char] = []  # buffer exports behind ranges()' addresses
        self.inodes = [os.fstat(fd).st_ino for fd in fds]
        """Each segment's memfd inode: a reattach after a daemon restart checks it got the same memory."""
        self.fds = list(fds)
        """The segments' memfds, kept open: a daemon restarted without them gets them back ([Note: hand-back]
        in daemon.handback)."""
        try:
            for fd, nbytes in zip(fds, sizes):
                self._maps.append(mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE))
        except BaseException:
            self._close_fds()
            raise

    def _close_fds(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)

    def __len__(self) -> int:
        return len(self._maps)

    def view(self, segment_index: int, offset: int, nbytes: int) -> memoryview:
        """A writable view of ``nbytes`` at ``offset`` of segment ``segment_index``."""
        if not 0 <= segment_index < len(self._maps):
            raise ProtocolError(f"segment {segment_index} is not one of this session's {len(self._maps)}")
        m = self._maps[segment_index]
        if offset < 0 or nbytes < 0 or offset + nbytes > len(m):
            raise ProtocolError(f"range [{offset}, {offset + nbytes}) lies outside segment {segment_index}")
        return memoryview(m)[offset : offset + nbytes]

    def ranges(self) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of each mapping, in segment order (for CUDA host registration)."""
        if len(self._anchors) != len(self._maps):
            self._anchors = [ctypes.c_char.from_buffer(m) for m in self._maps]  # held until close
        return [(ctypes.addressof(a), len(m)) for a, m in zip(self._anchors, self._maps)]

    def close(self) -> None:
        self._close_fds()
        self._anchors = []  # the address exports must go before the mappings can close
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a view is still alive; the mapping goes when it does
                logger.debug("segment mapping still exported; left to the garbage collector")
        self._maps.clear()
