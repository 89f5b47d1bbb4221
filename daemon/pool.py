"""The node pool: every host-memory segment the daemon hands out, made once at start.

``NodePool(config)`` checks the pool against the memory available (``MemAvailable``, and
the cgroup's ``memory.max`` where one is set; free huge pages when the pool is on
hugetlb), then makes ``capacity_bytes / segment_bytes`` sealed memfd segments and
faults every page in, logging its progress. A session's pool is a whole number of
those segments, lent with ``take`` and given back with ``give``.

[Note: recycling segments] A client keeps whatever it mapped, even after its session
is gone: the kernel cannot take a shared mapping back from another process. So a
segment given back is zeroed and kept for the *same* uid (who could read its own
processes' memory anyway). A session of another uid gets a segment that nobody has
had (made at start), or, when none is left, a segment that was someone else's is
replaced: its pages are released (``MADV_REMOVE``: an old client still mapping it
faults in fresh zero pages of its own, charged to itself), its fd closed, and a new
segment is made and faulted in under the same index. No session ever sees bytes
another session wrote, and no uid ever shares pages with another.

Thread safe; ``take`` and ``give`` may block (faulting, zeroing): call them from a
worker thread.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from csrc.errors import ConfigError
from daemon.config import PoolConfig

logger = logging.getLogger(__name__)

__all__ = ["Adoption", "NodePool", "available_memory_bytes"]


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def available_memory_bytes() -> tuple[int, str]:
    """(bytes, where the figure comes from): MemAvailable, or less where the cgroup's limit says so."""
    avail, source = 0, "MemAvailable"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        return 1 << 62, "unknown (no /proc/meminfo)"
    try:
        with open("/proc/self/cgroup") as f:
            rel = next((line.split("::", 1)[1].strip() for line in f if line.startswith("0::")), None)
    except OSError:
        rel = None
    if rel is not None:
        base = os.path.join("/sys/fs/cgroup", rel.lstrip("/"))
        limit, current = _read_int(os.path.join(base, "memory.max")), _read_int(os.path.join(base, "memory.current"))
        if limit is not None and current is not None and limit - current < avail:
            avail, source = max(0, limit - current), f"the cgroup's memory.max ({base})"
    return avail, source


@dataclass
class Adoption:
    """What a predecessor's pool left: its segments' memfds by index (from systemd's fd store), the ones
    its sessions held (adopted with them), and the free ones each uid gave back (index lists by uid)."""

    fds: dict[int, int] = field(default_factory=dict)
    lent: set[int] = field(default_factory=set)
    given: dict[int, list[int]] = field(default_factory=dict)
    vacant: dict[int, int] = field(default_factory=dict)
    """Segments its sessions' trainers still map, by index -> memfd inode: not made, until a trainer hands
    them back (``install``) or its session is given up (``fill``)."""


class NodePool:
    """Segments made once at start and lent to sessions; see the module docstring."""

    def __init__(self, config: PoolConfig, name: str = "ofl-pool", on_made: Callable[[Any], None] | None = None,
                 on_dropped: Callable[[Any], None] | None = None, adopt: "Adoption | None" = None) -> None:
        """``on_made(segment)`` runs for every segment made (at start, and when one is replaced),
        ``on_dropped(segment)`` before one is closed: the backend registers them with its engine.
        ``adopt``: the segments a predecessor left (see ``Adoption``); the others are made anew."""
        from swap.buffers import HostSegment, resolve_huge_pages

        self._on_made = on_made or (lambda seg: None)
        self._on_dropped = on_dropped or (lambda seg: None)
        self._segment_cls = HostSegment
        self.segment_bytes = config.segment_bytes
        self.count = config.capacity_bytes // config.segment_bytes
        if self.count == 0 or config.capacity_bytes % config.segment_bytes:
            raise ConfigError(f"[pool] capacity_bytes = {config.capacity_bytes} must be a whole number (>= 1) of "
                              f"segment_bytes = {config.segment_bytes}")
        self.capacity_bytes = self.count * self.segment_bytes
        self.huge, why = resolve_huge_pages(config.huge_pages, self.capacity_bytes, self.segment_bytes)
        if self.huge != "hugetlb":
            avail, source = available_memory_bytes()
            held = len(adopt.fds) + len(adopt.vacant) if adopt else 0  # adopted, or still in trainers: resident
            to_make = self.capacity_bytes - held * self.segment_bytes
            if to_make > avail:
                raise ConfigError(f"[pool] capacity_bytes = {self.capacity_bytes} is more than the memory "
                                  f"available at start: {avail} bytes ({source})")
        self._name = name
        self._lock = threading.Lock()
        self._fresh: list = []  # never lent
        self._by_uid: dict[int, list] = {}  # given back by a uid, zeroed
        self._closed = False
        self.segments: dict[int, Any] = {}
        """Every segment by index, lent or free (the fd store keeps each one)."""
        self.lent: dict[int, Any] = {}
        """Adopted segments lent to the predecessor's sessions, until ``take_adopted`` or ``give``."""
        adopt = adopt or Adoption()
        self.vacant: dict[int, int] = dict(adopt.vacant)
        """Segments not made: their trainers hold them (see ``Adoption.vacant``), by index -> inode."""
        logger.info("pool: making %d segment(s) of %d bytes (%.1f GiB), huge pages %s (%s)", self.count,
                    self.segment_bytes, self.capacity_bytes / 2**30, self.huge, why)
        t0 = last = time.monotonic()
        given = {i: uid for uid, indices in adopt.given.items() for i in indices}
        try:
            for index in range(self.count):
                if index in adopt.fds:
                    seg = self._segment_cls.adopt(index, adopt.fds[index], self.segment_bytes)
                    self.segments[index] = seg
                    self._on_made(seg)
                    if index in adopt.lent:
                        self.lent[index] = seg
                    elif index in given:  # given back, perhaps not yet zeroed when the predecessor died
                        seg.zero()
                        self._by_uid.setdefault(given[index], []).append(seg)
                    else:
                        self._fresh.append(seg)
                    continue
                if index in self.vacant:
                    continue
                self._fresh.append(self._make(index))
                now = time.monotonic()
                if now - last >= 2.0:
                    last = now
                    logger.info("pool: %.1f of %.1f GiB faulted in", (index + 1) * self.segment_bytes / 2**30,
                                self.capacity_bytes / 2**30)
        except BaseException:
            self.close()
            raise
        seconds = time.monotonic() - t0
        logger.info("pool: %.1f GiB ready in %.1f s (%.2f GB/s)", self.capacity_bytes / 2**30, seconds,
                    self.capacity_bytes / max(seconds, 1e-9) / 1e9)

    def _make(self, index: int):
        try:
            seg = self._segment_cls(index, self.segment_bytes, self._name, True, self.huge)
        except OSError as exc:
            raise ConfigError(f"[pool] cannot make segment {index} of {self.segment_bytes} bytes "
                              f"(huge pages {self.huge}): {exc.strerror or exc}") from exc
        self.segments[index] = seg
        self._on_made(seg)
        return seg

    def _drop(self, seg: Any) -> None:
        if self.segments.get(seg.index) is seg:
            del self.segments[seg.index]
        self._on_dropped(seg)
        seg.release_pages()
        seg.close()

    @property
    def free_segments(self) -> int:
        with self._lock:
            return len(self._fresh) + sum(len(v) for v in self._by_uid.values())

    def take(self, count: int, uid: int) -> list:
        """``count`` zeroed segments for a session of ``uid`` (see [Note: recycling segments])."""
        with self._lock:
            free = len(self._fresh) + sum(len(v) for v in self._by_uid.values())
            if count > free:  # the sessions' quota accounting keeps this from happening
                raise ConfigError(f"the node pool has {free} free segment(s), not {count}")
            own = self._by_uid.get(uid, [])
            got = [own.pop() for _ in range(min(count, len(own)))]
            while len(got) < count and self._fresh:
                got.append(self._fresh.pop())
            foreign = []
            for other in list(self._by_uid):
                while len(got) + len(foreign) < count and self._by_uid[other]:
                    foreign.append(self._by_uid[other].pop())
                if not self._by_uid[other]:
                    del self._by_uid[other]
        made = []
        try:
            while foreign:
                seg = foreign.pop()
                self._drop(seg)
                made.append(self._make(seg.index))
        except BaseException:
            for seg in foreign:  # not yet replaced: closed
                self._drop(seg)
            with self._lock:
                self._fresh.extend(made)
                self._by_uid.setdefault(uid, []).extend(got)
            logger.error("pool: a replaced segment could not be made again; the pool is smaller until restart")
            raise
        if made:
            logger.info("pool: %d segment(s) last lent to other uids replaced for uid %d", len(made), uid)
        return got + made

    def given(self) -> dict[int, list[int]]:
        """The free segments each uid gave back, by index (for the journal's base)."""
        with self._lock:
            return {uid: [seg.index for seg in segs] for uid, segs in self._by_uid.items() if segs}

    def take_adopted(self, indices: list[int]) -> list:
        """The adopted segments of one of the predecessor's sessions (``KeyError`` for one not adopted)."""
        with self._lock:
            missing = [i for i in indices if i not in self.lent]
            if missing:
                raise KeyError(f"segment(s) {missing} were not handed over")
            return [self.lent.pop(i) for i in indices]

    def install(self, index: int, fd: int) -> Any:
        """A vacant segment handed back by the trainer that maps it (its memfd ``fd``, the inode checked by the
        caller): this pool's again, lent to that trainer's session (``take_adopted``)."""
        with self._lock:
            if index not in self.vacant:
                raise KeyError(f"segment {index} is not vacant")
            del self.vacant[index]
        seg = self._segment_cls.adopt(index, fd, self.segment_bytes)
        self.segments[index] = seg
        self._on_made(seg)
        with self._lock:
            self.lent[index] = seg
        return seg

    def fill(self, indices: list[int]) -> None:
        """Vacant segments no trainer will hand back: made anew, free for anyone."""
        for index in indices:
            with self._lock:
                if self.vacant.pop(index, None) is None:
                    continue
            seg = self._make(index)
            with self._lock:
                self._fresh.append(seg)

    def return_adopted(self, indices: list[int], uid: int) -> None:
        """The adopted segments of a session that was not taken over: zeroed and kept for its uid."""
        with self._lock:
            segments = [self.lent.pop(i) for i in indices if i in self.lent]
        self.give(segments, uid)

    def give(self, segments: list, uid: int) -> None:
        """Segments a session of ``uid`` is done with: zeroed and kept for ``uid``."""
        for seg in segments:
            seg.zero()
            seg.reset()
        with self._lock:
            if self._closed:
                for seg in segments:
                    self._drop(seg)
                return
            self._by_uid.setdefault(uid, []).extend(segments)

    def close(self) -> None:
        """Unmap and close every free segment (lent ones are closed when given back after this)."""
        with self._lock:
            self._closed = True
            segments = self._fresh + [s for segs in self._by_uid.values() for s in segs] + list(self.lent.values())
            self._fresh, self._by_uid, self.lent = [], {}, {}
        for seg in segments:
            self._drop(seg)
