"""Host buffers: a pool of page-aligned shared-memory segments, carved into aligned blocks.

Each segment is a memfd (``os.memfd_create``) of ``segment_bytes``, mapped shared and
pre-touched at creation, so the first transfer into it pays no page faults and the
daemon can pass its fd to another process with SCM_RIGHTS. Blocks inside a segment
come from an ``ExtentAllocator`` and are padded to 4096 bytes (see [Note: alignment]
in ``swap.engine``), which is what makes them valid O_DIRECT targets.

A block never spans two segments, so the largest block is ``segment_bytes``; a region
larger than that is a ``TierFullError`` that says so, never an assert.
"""
from __future__ import annotations

import dataclasses
import logging
import mmap
import os
import threading
from typing import NamedTuple

from csrc import ConfigError, TierFullError
from swap import aio
from swap.engine import ALIGNMENT_BYTES
from swap.extents import ExtentAllocator, align_up

logger = logging.getLogger(__name__)

__all__ = ["HostBlock", "HostPool", "HostPoolConfig", "HostSegment"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostPoolConfig:
    """Size and shape of a host pool."""

    capacity_bytes: int
    """Total bytes of all segments; a multiple of segment_bytes."""
    segment_bytes: int | None = None
    """Bytes per memfd segment, a multiple of 4096; None: one segment of capacity_bytes."""
    pretouch: bool = True
    """Fault every page in at creation (MAP_POPULATE), so transfers never wait on page faults."""
    name: str = "ofl-pool"
    """Name given to the memfds (seen in /proc/<pid>/fd and /proc/<pid>/maps)."""

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0 or self.capacity_bytes % ALIGNMENT_BYTES:
            raise ConfigError(f"capacity_bytes must be a positive multiple of {ALIGNMENT_BYTES}, "
                              f"got {self.capacity_bytes}")
        seg = self.capacity_bytes if self.segment_bytes is None else self.segment_bytes
        if seg <= 0 or seg % ALIGNMENT_BYTES:
            raise ConfigError(f"segment_bytes must be a positive multiple of {ALIGNMENT_BYTES}, got {seg}")
        if self.capacity_bytes % seg:
            raise ConfigError(f"capacity_bytes ({self.capacity_bytes}) must be a multiple of "
                              f"segment_bytes ({seg})")
        object.__setattr__(self, "segment_bytes", seg)


class HostBlock(NamedTuple):
    """Where a block lives: segment, byte offset in it, and its padded length."""

    segment_index: int
    offset: int
    nbytes: int


class HostSegment:
    """One memfd segment, mapped shared. ``fd`` stays open until the pool closes."""

    def __init__(self, index: int, nbytes: int, name: str, pretouch: bool) -> None:
        self.index = index
        self.nbytes = nbytes
        self.fd = os.memfd_create(f"{name}-{index}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, nbytes)
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if pretouch else 0)
            self.mmap = mmap.mmap(self.fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(self.fd)
            raise
        self._keep, self.address = aio.buffer_address(self.mmap)
        self.allocator = ExtentAllocator(nbytes, ALIGNMENT_BYTES)

    def view(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self.mmap)[offset:offset + nbytes]

    def close(self) -> None:
        self._keep = None
        try:
            self.mmap.close()
        except BufferError:  # a view is still exported; the mapping goes when the last view does
            logger.debug("segment %d still has views; its mapping is released with them", self.index)
        os.close(self.fd)


class HostPool:
    """Page-aligned shared-memory blocks for host copies and staging. Thread safe."""

    def __init__(self, config: HostPoolConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self.segments: list[HostSegment] = []
        count = config.capacity_bytes // config.segment_bytes
        try:
            for i in range(count):
                self.segments.append(HostSegment(i, config.segment_bytes, config.name, config.pretouch))
        except OSError as exc:
            self.close()
            raise TierFullError(f"host pool: cannot create segment {len(self.segments)} of "
                                f"{config.segment_bytes} bytes: {exc.strerror}") from exc
        logger.info("host pool: %d segment(s) of %d bytes", count, config.segment_bytes)

    @property
    def capacity_bytes(self) -> int:
        return self.config.capacity_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes handed out (padded to 4096)."""
        with self._lock:
            return sum(s.allocator.used_bytes for s in self.segments)

    def allocate(self, nbytes: int, what: str = "a block") -> HostBlock:
        """A block of at least ``nbytes`` (padded to 4096); ``TierFullError`` naming ``what`` if none fits."""
        if nbytes <= 0:
            raise ConfigError(f"{what}: nbytes must be > 0, got {nbytes}")
        size = align_up(nbytes, ALIGNMENT_BYTES)
        if size > self.config.segment_bytes:
            raise TierFullError(f"{what} needs {size} bytes of host memory, more than one segment holds "
                                f"(segment_bytes={self.config.segment_bytes})")
        with self._lock:
            for seg in self.segments:
                offset = seg.allocator.allocate(size)
                if offset is not None:
                    return HostBlock(seg.index, offset, size)
            used = sum(s.allocator.used_bytes for s in self.segments)
        raise TierFullError(f"{what} needs {size} bytes of host memory; the host pool has "
                            f"{self.capacity_bytes - used} of {self.capacity_bytes} bytes free, "
                            f"none of it in one run that long")

    def free(self, block: HostBlock) -> None:
        with self._lock:
            self.segments[block.segment_index].allocator.free(block.offset)

    def view(self, block: HostBlock, nbytes: int | None = None) -> memoryview:
        """Writable view of the first ``nbytes`` (default all) of ``block``."""
        n = block.nbytes if nbytes is None else nbytes
        return self.segments[block.segment_index].view(block.offset, n)

    def address(self, block: HostBlock) -> int:
        """Address of the block's first byte, valid while the pool is open."""
        return self.segments[block.segment_index].address + block.offset

    def close(self) -> None:
        """Unmap and close every segment. Idempotent."""
        with self._lock:
            segments, self.segments = self.segments, []
        for seg in segments:
            seg.close()

    def __enter__(self) -> "HostPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
