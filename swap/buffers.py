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

[Note: private pools] A pool no other process maps (``shared=False``) is made of private
anonymous mappings instead of memfds, and anonymous memory takes transparent huge pages in the
common "madvise" mode, where shared memory's are off by default ("never" in
``shmem_enabled``): a private pool's huge-page modes read ``/sys/kernel/mm/transparent_hugepage/enabled``
("hugetlb" maps reserved pages with MAP_HUGETLB). The embedded store's pool is private where that
gets it huge pages (``embedded_pool_config``). A 0.6B GPT with params, optimizer and gradients on
NVMe, int8 states, on the 2-vCPU Zen 5 EPYC guest, six alternating pairs: steps 0.82-0.95x the
time on shared 4 KiB pages, the first step 0.70-0.78x, the same losses (three of the pairs by a
throwaway driver; tools/bench/results/host-pages_2core-epyc_202611.md). On 4 KiB pages a private
pool was made faster (2-3x in a throwaway test) but stepped slower (4.3-5.2 s against 3.9-4.1 s), so
without huge pages the embedded pool stays shared. A private segment has no fd to send, and is advised MADV_DONTFORK: a
forked child (a DataLoader worker) inherits no copy-on-write share of it, so the parent's writes
and the NVMe reads into it never copy a page.

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

__all__ = ["HostBlock", "HostPool", "HostPoolConfig", "HostSegment", "HUGE_PAGE_MODES", "embedded_pool_config",
           "resolve_huge_pages"]

HUGE_PAGE_MODES = ("off", "auto", "hugetlb", "thp")
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
"""The seals every segment carries (see [Note: sealed segments])."""
_MADV_POPULATE_WRITE = 23  # Linux 5.14; older kernels get EINVAL and the pages are touched by hand
_SHMEM_THP = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
_ANON_THP = "/sys/kernel/mm/transparent_hugepage/enabled"
_MADV_DONTFORK = getattr(mmap, "MADV_DONTFORK", 10)


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


def _thp_setting(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return "absent"


def resolve_huge_pages(mode: str, capacity_bytes: int, segment_bytes: int, shared: bool = True) -> tuple[str, str]:
    """("hugetlb" | "thp" | "off", why) for ``mode`` on this machine (see [Note: huge pages]); ``shared``:
    False for a private pool, whose THP is anonymous memory's ([Note: private pools])."""
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
    path, kind = (_SHMEM_THP, "shared-memory") if shared else (_ANON_THP, "anonymous-memory")
    setting = _thp_setting(path)
    if setting in ("always", "within_size", "advise", "force", "madvise"):
        return "thp", f"{kind} THP is {setting!r}" + (f" ({why})" if why else "")
    if mode == "thp":
        raise ConfigError(f"huge_pages = \"thp\": {kind} THP is {setting!r} in {path}")
    hint = f" in {path}; 'advise' there would give the pool huge pages" if setting in ("never", "deny") else ""
    return "off", (f"{why}; " if why else "") + f"{kind} THP is {setting!r}{hint}"


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
    shared: bool = True
    """Segments another process may map (sealed memfds). False: this process's alone, private
    anonymous memory ([Note: private pools])."""

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


def embedded_pool_config(capacity_bytes: int, segment_bytes: int | None, slot_bytes: int | None,
                         huge_pages: str = "auto") -> HostPoolConfig:
    """The pool of a store no other process maps: private, where that gets it huge pages; else shared
    memory on 4 KiB pages as before ([Note: private pools])."""
    seg = capacity_bytes if segment_bytes is None else segment_bytes
    huge = "off" if huge_pages == "off" else resolve_huge_pages(huge_pages, capacity_bytes, seg, shared=False)[0]
    if huge == "off":
        return HostPoolConfig(capacity_bytes=capacity_bytes, segment_bytes=segment_bytes, slot_bytes=slot_bytes)
    return HostPoolConfig(capacity_bytes=capacity_bytes, segment_bytes=segment_bytes, slot_bytes=slot_bytes,
                          shared=False, huge_pages=huge_pages)


class HostBlock(NamedTuple):
    """Where a block lives: segment, byte offset in it, and its padded length."""

    segment_index: int
    offset: int
    nbytes: int


class HostSegment:
    """One sealed memfd segment, mapped shared. ``fd`` stays open until the segment closes. With
    ``shared`` False, a private anonymous mapping instead, ``fd`` None ([Note: private pools]).

    ``huge`` is "hugetlb", "thp" or "off" (already resolved; see [Note: huge pages])."""

    def __init__(self, index: int, nbytes: int, name: str, pretouch: bool, huge: str = "off",
                 shared: bool = True) -> None:
        self.index = index
        self.nbytes = nbytes
        self.huge = huge
        self.fd: int | None = None
        if not shared:
            self._map_private(pretouch)
            return
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

    @classmethod
    def adopt(cls, index: int, fd: int, nbytes: int) -> "HostSegment":
        """The segment a predecessor made, from its memfd ``fd`` (this segment owns it from now on):
        mapped again, its pages already resident, its allocator empty (the adopter takes its blocks)."""
        self = cls.__new__(cls)
        self.index, self.nbytes, self.huge, self.fd = index, nbytes, "adopted", fd
        self.mmap = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                              prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._keep, self.address = aio.buffer_address(self.mmap)
        self.allocator = ExtentAllocator(nbytes, ALIGNMENT_BYTES)
        return self

    def _map_private(self, pretouch: bool) -> None:
        hugetlb = getattr(mmap, "MAP_HUGETLB", 0x40000) if self.huge == "hugetlb" else 0
        self.mmap = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | hugetlb,
                              prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.mmap.madvise(_MADV_DONTFORK)
        if self.huge == "thp":
            self.mmap.madvise(mmap.MADV_HUGEPAGE)
        if pretouch:
            self._populate()
        self._keep, self.address = aio.buffer_address(self.mmap)
        self.allocator = ExtentAllocator(self.nbytes, ALIGNMENT_BYTES)

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
            self.mmap.madvise(mmap.MADV_REMOVE if self.fd is not None else mmap.MADV_DONTNEED)
        except (OSError, ValueError) as exc:
            logger.debug("segment %d: its pages not released (%s); they go with the last mapping", self.index, exc)

    def close(self) -> None:
        self._keep = None
        try:
            self.mmap.close()
        except BufferError:  # a view is still exported; the mapping goes when the last view does
            logger.debug("segment %d still has views; its mapping is released with them", self.index)
        if self.fd is not None:
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
        huge, why = resolve_huge_pages(config.huge_pages, config.capacity_bytes, config.segment_bytes, config.shared)
        try:
            for i in range(count):
                self.segments.append(HostSegment(i, config.segment_bytes, config.name, config.pretouch, huge,
                                                 config.shared))
        except OSError as exc:
            self.close()
            raise TierFullError(f"host pool: cannot create segment {len(self.segments)} of "
                                f"{config.segment_bytes} bytes: {exc.strerror}") from exc
        logger.info("host pool: %d %s segment(s) of %d bytes, huge pages %s (%s)", count,
                    "shared" if config.shared else "private", config.segment_bytes, huge, why)

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

    def take(self, block: HostBlock) -> None:
        """Mark ``block`` allocated, as an adopter restoring a predecessor's regions does."""
        with self._lock:
            self.segments[block.segment_index].allocator.take(block.offset, block.nbytes)

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
