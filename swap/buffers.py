"""Host buffers: a pool of page-aligned shared-memory segments, carved into aligned blocks.

Each segment is a memfd (``os.memfd_create``) of ``segment_bytes``, mapped shared and
pre-touched at creation, so the first transfer into it pays no page faults and the
daemon can pass its fd to another process with SCM_RIGHTS. Blocks inside a segment
come from an ``ExtentAllocator`` and are padded to 4096 bytes (see [Note: alignment]
in ``swap.engine``), which is what makes them valid O_DIRECT targets.

A block never spans two segments, so the largest block is ``segment_bytes``; a region
larger than that is a ``TierFullError`` that says so, never an assert.

[Note: sealed segments] A segment's size is sealed (``F_SEAL_SHRINK | F_SEAL_GROW |
F_SEAL_SEAL``) as soon as it is sized, before its fd can reach anyone else. Without the
seals, a process holding the fd could ``ftruncate`` it to 0, and the next access of
the pool's own mapping (a checksum, a copy) would die of SIGBUS: one client would kill
the daemon and every session in it. Writes stay allowed (that is what the memory is for).

[Note: huge pages] ``huge_pages`` picks the page size of the segments: "hugetlb" (a
``MFD_HUGETLB`` memfd from the pages reserved in ``/proc/sys/vm/nr_hugepages``), "thp"
(ordinary shared memory with ``MADV_HUGEPAGE``, which shmem honours when
``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` is not "never"/"deny"), "off", or
"auto": hugetlb when enough pages are reserved and the segment is a whole number of
them, else thp where shmem allows it, else off. Huge pages make a transfer's buffer a few
physically contiguous 2 MiB runs rather than hundreds of 4 KiB pages.

A pool may also be built over segments that someone else made and keeps (``segments=``):
the daemon makes its segments once and lends them to one session's pool after another.
"""
from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import logging
import mmap
import os
import threading
from typing import NamedTuple, Sequence

from csrc import ConfigError, TierFullError
from swap import aio
from swap.engine import ALIGNMENT_BYTES
from swap.extents import ExtentAllocator, align_up

logger = logging.getLogger(__name__)

__all__ = ["HostBlock", "HostPool", "HostPoolConfig", "HostSegment", "HUGE_PAGE_MODES", "resolve_huge_pages"]

HUGE_PAGE_MODES = ("off", "auto", "hugetlb", "thp")
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
"""The seals every segment carries (see [Note: sealed segments])."""
_MADV_POPULATE_WRITE = 23  # Linux 5.14; older kernels get EINVAL and the pages are touched by hand
_SHMEM_THP = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def resolve_huge_pages(mode: str, capacity_bytes: int, segment_bytes: int) -> tuple[str, str]:
    """("hugetlb" | "thp" | "off", why) for ``mode`` on this machine (see [Note: huge pages])."""
    if mode == "off":
        return "off", "huge_pages is off"
    info = _meminfo()
    page = info.get("Hugepagesize", 2 << 20)
    free = info.get("HugePages_Free", 0) * page
    if mode in ("auto", "hugetlb"):
        if segment_bytes % page == 0 and free >= capacity_bytes:
            return "hugetlb", f"{free >> 20} MiB of {page >> 20} MiB huge pages reserved and free"
        why = (f"segment_bytes {segment_bytes} is not a multiple of the huge page size {page}"
               if segment_bytes % page else f"{free >> 20} MiB of huge pages free, the pool needs "
               f"{capacity_bytes >> 20} MiB (vm.nr_hugepages)")
        if mode == "hugetlb":
            raise ConfigError(f"huge_pages = \"hugetlb\": {why}")
    else:
        why = ""
    try:
        with open(_SHMEM_THP) as f:
            setting = f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        setting = "absent"
    if setting in ("always", "within_size", "advise", "force"):
        return "thp", f"shared-memory THP is {setting!r}" + (f" ({why})" if why else "")
    if mode == "thp":
        raise ConfigError(f"huge_pages = \"thp\": shared-memory THP is {setting!r} in {_SHMEM_THP}")
    return "off", (f"{why}; " if why else "") + f"shared-memory THP is {setting!r}"


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
    huge_pages: str = "off"
    """Page size of the segments: "off", "auto", "hugetlb" or "thp" (see [Note: huge pages])."""
    slot_bytes: int | None = None
    """Every block padded to a multiple of this (a multiple of 4096; None: of 4096). Blocks of one
    size never fragment a first-fit pool: a freed block is a hole any other fits."""

    def __post_init__(self) -> None:
        if self.huge_pages not in HUGE_PAGE_MODES:
            raise ConfigError(f"huge_pages must be one of {', '.join(HUGE_PAGE_MODES)}, got {self.huge_pages!r}")
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
        if self.slot_bytes is not None and (self.slot_bytes <= 0 or self.slot_bytes % ALIGNMENT_BYTES):
            raise ConfigError(f"slot_bytes must be a positive multiple of {ALIGNMENT_BYTES}, got {self.slot_bytes}")


class HostBlock(NamedTuple):
    """Where a block lives: segment, byte offset in it, and its padded length."""

    segment_index: int
    offset: int
    nbytes: int


class HostSegment:
    """One sealed memfd segment, mapped shared. ``fd`` stays open until the segment closes.

    ``huge`` is "hugetlb", "thp" or "off" (already resolved; see [Note: huge pages])."""

    def __init__(self, index: int, nbytes: int, name: str, pretouch: bool, huge: str = "off") -> None:
        self.index = index
        self.nbytes = nbytes
        self.huge = huge
        flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | (os.MFD_HUGETLB if huge == "hugetlb" else 0)
        self.fd = os.memfd_create(f"{name}-{index}", flags)
        try:
            os.ftruncate(self.fd, nbytes)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)  # [Note: sealed segments]
            populate = mmap.MAP_POPULATE if pretouch and huge != "thp" else 0
            self.mmap = mmap.mmap(self.fd, nbytes, flags=mmap.MAP_SHARED | populate,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
            if huge == "thp":
                self.mmap.madvise(mmap.MADV_HUGEPAGE)
                if pretouch:
                    self._populate()
        except OSError:
            os.close(self.fd)
            raise
        self._keep, self.address = aio.buffer_address(self.mmap)
        self.allocator = ExtentAllocator(nbytes, ALIGNMENT_BYTES)

    def _populate(self) -> None:
        try:
            self.mmap.madvise(_MADV_POPULATE_WRITE)
        except OSError:  # an older kernel: one write per page does the same
            for off in range(0, self.nbytes, mmap.PAGESIZE):
                self.mmap[off] = 0

    def view(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self.mmap)[offset:offset + nbytes]

    def reset(self) -> None:
        """Forget every block (for a new owner of a lent segment); the bytes are left as they are."""
        self.allocator = ExtentAllocator(self.nbytes, ALIGNMENT_BYTES)

    def zero(self) -> None:
        """Write zeros over the whole segment (releases the GIL; pages stay resident)."""
        ctypes.memset(self.address, 0, self.nbytes)

    def release_pages(self) -> None:
        """Give the pages back to the system now (MADV_REMOVE), even while others still map them:
        whoever touches them afterwards faults in fresh zero pages of its own."""
        try:
            self.mmap.madvise(mmap.MADV_REMOVE)
        except (OSError, ValueError) as exc:
            logger.debug("segment %d: MADV_REMOVE refused (%s); pages go with the last mapping", self.index, exc)

    def close(self) -> None:
        self._keep = None
        try:
            self.mmap.close()
        except BufferError:  # a view is still exported; the mapping goes when the last view does
            logger.debug("segment %d still has views; its mapping is released with them", self.index)
        os.close(self.fd)


class HostPool:
    """Page-aligned shared-memory blocks for host copies and staging. Thread safe."""

    def __init__(self, config: HostPoolConfig, segments: Sequence[HostSegment] | None = None) -> None:
        """A pool of new segments, or, with ``segments``, over those (lent: ``close`` leaves them
        open for their owner, who must keep them while this pool lives). Block positions are
        indices into ``self.segments``."""
        self.config = config
        self._lock = threading.Lock()
        self._owns = segments is None
        self.segments: list[HostSegment] = []
        count = config.capacity_bytes // config.segment_bytes
        if segments is not None:
            if sum(s.nbytes for s in segments) != config.capacity_bytes or \
                    any(s.nbytes != config.segment_bytes for s in segments):
                raise ConfigError(f"host pool: {len(segments)} lent segment(s) do not make {count} of "
                                  f"{config.segment_bytes} bytes")
            for seg in segments:
                seg.reset()
            self.segments = list(segments)
            return
        huge, why = resolve_huge_pages(config.huge_pages, config.capacity_bytes, config.segment_bytes)
        try:
            for i in range(count):
                self.segments.append(HostSegment(i, config.segment_bytes, config.name, config.pretouch, huge))
        except OSError as exc:
            self.close()
            raise TierFullError(f"host pool: cannot create segment {len(self.segments)} of "
                                f"{config.segment_bytes} bytes: {exc.strerror}") from exc
        logger.info("host pool: %d segment(s) of %d bytes, huge pages %s (%s)", count, config.segment_bytes,
                    huge, why)

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
        size = align_up(nbytes, self.config.slot_bytes or ALIGNMENT_BYTES)
        if size > self.config.segment_bytes:
            raise TierFullError(f"{what} needs {size} bytes of host memory, more than one segment holds "
                                f"(segment_bytes={self.config.segment_bytes})")
        with self._lock:
            for position, seg in enumerate(self.segments):
                offset = seg.allocator.allocate(size)
                if offset is not None:
                    return HostBlock(position, offset, size)
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
        """Unmap and close every segment this pool made (lent ones stay with their owner). Idempotent."""
        with self._lock:
            segments, self.segments = self.segments, []
        if self._owns:
            for seg in segments:
                seg.close()

    def __enter__(self) -> "HostPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
