"""TEST DOUBLE of the swap package's TierStore contract, for the daemon's tests only.

This is not the swap layer and is never shipped: it keeps the interface the daemon
serves (HostPool segments with .fd/.nbytes/.index, TierStore verbs, ConfigError and
TierFullError as the real store raises them, memoryview host views, TierStats-shaped
stats) with the simplest implementation that moves real bytes: memfd segments from
``daemon.shm``, a first-fit page allocator, one plain file as swap space, a thread
pool doing pread/pwrite. The daemon tests run on the real store where the swap
package is installed and on this double where it is not. ``read_delay_seconds`` slows every prefetch so a test can kill a client
while one is in flight; ``FakeBackend.open_store`` is what the daemon calls.
"""
from __future__ import annotations

import concurrent.futures
import enum
import errno
import itertools
import mmap
import os
import threading
import time
from typing import NamedTuple

from csrc.errors import ConfigError
from daemon.backend import SessionStore
from daemon.shm import PAGE_BYTES, create_segment

try:
    from csrc.errors import TierFullError
except ImportError:  # before the swap layer's errors exist
    TierFullError = MemoryError


class FakeTier(enum.Enum):
    HOST = "host"
    NVME = "nvme"
    HOST_AND_NVME = "host_and_nvme"
    IN_FLIGHT = "in_flight"


class FakeRegionInfo(NamedTuple):
    name: str
    nbytes: int
    segment_index: int | None
    offset: int | None
    tier: FakeTier


def _pages(n: int) -> int:
    return max(1, -(-n // PAGE_BYTES)) * PAGE_BYTES


class FakeHostPool:
    def __init__(self, capacity_bytes: int, segment_bytes: int) -> None:
        n = -(-capacity_bytes // segment_bytes)
        self.segments = [create_segment(segment_bytes, i, "fake-pool") for i in range(n)]
        self._maps = [mmap.mmap(s.fd, s.nbytes) for s in self.segments]
        self._free = [[(0, s.nbytes)] for s in self.segments]  # per segment: (offset, nbytes) holes

    def take(self, nbytes: int) -> tuple[int, int]:
        need = _pages(nbytes)
        for index, holes in enumerate(self._free):
            for i, (off, size) in enumerate(holes):
                if size >= need:
                    holes[i] = (off + need, size - need)
                    return index, off
        raise TierFullError(f"host pool has no room for {nbytes} bytes")

    def give(self, index: int, offset: int, nbytes: int) -> None:
        self._free[index].append((offset, _pages(nbytes)))
        self._free[index].sort()
        merged: list[tuple[int, int]] = []
        for off, size in self._free[index]:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((off, size))
        self._free[index] = merged

    def view(self, index: int, offset: int, nbytes: int) -> memoryview:
        return memoryview(self._maps[index])[offset : offset + nbytes]

    def close(self) -> None:
        for m in self._maps:
            try:
                m.close()
            except BufferError:
                pass
        for s in self.segments:
            os.close(s.fd)
        self.segments = []


class FakeSwapSpace:
    """One file, a bump allocator with a free list; full means ENOSPC."""

    def __init__(self, directory: str, capacity_bytes: int) -> None:
        self.path = os.path.join(directory, "fake-swap.bin")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self.capacity_bytes = capacity_bytes
        self._next = 0
        self._free: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        self.used_bytes = 0

    def take(self, nbytes: int) -> int:
        need = _pages(nbytes)
        with self._lock:
            for i, (off, size) in enumerate(self._free):
                if size == need:
                    del self._free[i]
                    self.used_bytes += need
                    return off
            if self._next + need > self.capacity_bytes:
                raise TierFullError(f"swap space {self.path} is full")
            off, self._next = self._next, self._next + need
            self.used_bytes += need
            return off

    def give(self, offset: int, nbytes: int) -> None:
        with self._lock:
            self._free.append((offset, _pages(nbytes)))
            self.used_bytes -= _pages(nbytes)

    def close(self) -> None:
        os.close(self.fd)


class FakeTierStore:
    def __init__(self, pool: FakeHostPool, space: FakeSwapSpace, pool_threads: concurrent.futures.Executor,
                 read_delay_seconds: float = 0.0) -> None:
        self.pool, self.space, self._threads = pool, space, pool_threads
        self._delay = read_delay_seconds
        self._host: dict[str, tuple[int, int]] = {}
        self._disk: dict[str, int] = {}
        self._nbytes: dict[str, int] = {}
        self._dirty: set[str] = set()
        self._handles: dict[int, concurrent.futures.Future] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.read_bytes = self.write_bytes = 0

    def _known(self, name: str) -> None:
        if name not in self._nbytes:
            raise ConfigError(f"no region named {name!r}")

    def allocate(self, name: str, nbytes: int) -> FakeRegionInfo:
        if name in self._nbytes:
            raise ConfigError(f"a region named {name!r} already exists")
        if nbytes <= 0:
            raise ConfigError(f"region {name!r}: nbytes must be > 0, got {nbytes}")
        self._host[name] = self.pool.take(nbytes)
        self._nbytes[name] = nbytes
        self._dirty.add(name)
        return self.info(name)

    def info(self, name: str) -> FakeRegionInfo:
        self._known(name)
        seg, off = self._host.get(name, (None, None))
        if name in self._host:
            tier = FakeTier.HOST if name in self._dirty or name not in self._disk else FakeTier.HOST_AND_NVME
        else:
            tier = FakeTier.NVME
        return FakeRegionInfo(name, self._nbytes[name], seg, off, tier)

    def names(self) -> list[str]:
        return list(self._nbytes)

    def placements(self, name: str) -> list[tuple[int, int, int, int]]:
        self._known(name)
        return [(0, self._disk[name], 0, self._nbytes[name])] if name in self._disk else []

    def host_view(self, name: str) -> memoryview:
        self._known(name)
        if name not in self._host:
            raise ConfigError(f"region {name!r} has no host copy to view (tier nvme): prefetch it first")
        seg, off = self._host[name]
        return self.pool.view(seg, off, self._nbytes[name])

    def mark_dirty(self, name: str) -> None:
        self._known(name)
        if name not in self._host:
            raise ConfigError(f"region {name!r} has no host copy to mark dirty (tier nvme)")
        self._dirty.add(name)

    def _submit(self, fn, names: list[str]) -> int:
        for n in names:
            self._known(n)
        h = next(self._ids)
        self._handles[h] = self._threads.submit(fn, list(names))
        return h

    def _read(self, names: list[str]) -> None:
        if self._delay:
            time.sleep(self._delay)
        for n in names:
            with self._lock:
                if n in self._host:
                    continue
                self._host[n] = self.pool.take(self._nbytes[n])
            seg, off = self._host[n]
            view = self.pool.view(seg, off, self._nbytes[n])
            got = os.preadv(self.space.fd, [view], self._disk[n])
            if got != self._nbytes[n]:
                raise OSError(errno.EIO, f"short read of {n!r}: {got} of {self._nbytes[n]}")
            self.read_bytes += got

    def _write(self, names: list[str]) -> None:
        for n in names:
            with self._lock:
                if n not in self._host:
                    continue
                seg, off = self._host[n]
            if n in self._dirty:
                if n not in self._disk:
                    self._disk[n] = self.space.take(self._nbytes[n])  # ENOSPC: host copy kept
                os.pwritev(self.space.fd, [self.pool.view(seg, off, self._nbytes[n])], self._disk[n])
                self.write_bytes += self._nbytes[n]
                self._dirty.discard(n)
            with self._lock:
                del self._host[n]
            self.pool.give(seg, off, self._nbytes[n])

    def prefetch(self, names: list[str]) -> int:
        return self._submit(self._read, names)

    def evict(self, names: list[str]) -> int:
        return self._submit(self._write, names)

    def _wait(self, handle: int, timeout_seconds: float | None) -> None:
        fut = self._handles[handle]
        fut.result(timeout=timeout_seconds)
        del self._handles[handle]

    def wait_for_prefetch(self, handle: int, timeout_seconds: float | None = None) -> None:
        self._wait(handle, timeout_seconds)

    def wait_for_evict(self, handle: int, timeout_seconds: float | None = None) -> None:
        self._wait(handle, timeout_seconds)

    def flush(self) -> None:
        for n in list(self._dirty):
            if n not in self._disk:
                self._disk[n] = self.space.take(self._nbytes[n])
            seg, off = self._host[n]
            os.pwritev(self.space.fd, [self.pool.view(seg, off, self._nbytes[n])], self._disk[n])
            self.write_bytes += self._nbytes[n]
            self._dirty.discard(n)

    def free(self, name: str) -> None:
        self._known(name)
        if name in self._host:
            self.pool.give(*self._host.pop(name), self._nbytes[name])
        if name in self._disk:
            self.space.give(self._disk.pop(name), self._nbytes[name])
        self._dirty.discard(name)
        del self._nbytes[name]

    def stats(self) -> dict[str, int]:
        host = sum(self._nbytes[n] for n in self._host)
        nvme = sum(self._nbytes[n] for n in self._disk if n not in self._dirty)
        return {"regions": len(self._nbytes), "host_bytes": host, "nvme_bytes": nvme, "in_flight_bytes": 0,
                "dirty_bytes": sum(self._nbytes[n] for n in self._dirty),
                "bytes_read_total": self.read_bytes, "bytes_written_total": self.write_bytes}

    def close(self) -> None:
        for name in list(self._nbytes):
            self.free(name)
        self.pool.close()


class FakeBackend:
    """What the daemon calls: one shared swap file and thread pool, a pool per session."""

    engine_name = "fake-threads"

    def __init__(self, swap_dir: str, swap_capacity_bytes: int, segment_bytes: int,
                 read_delay_seconds: float = 0.0) -> None:
        self.space = FakeSwapSpace(swap_dir, swap_capacity_bytes)
        self.threads = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="fake-io")
        self.segment_bytes = segment_bytes
        self.read_delay_seconds = read_delay_seconds

    def open_store(self, quota_bytes: int, owner_uid: int = 0) -> SessionStore:
        pool = FakeHostPool(quota_bytes, min(self.segment_bytes, quota_bytes))
        store = FakeTierStore(pool, self.space, self.threads, self.read_delay_seconds)
        return SessionStore(store, pool.segments, store.close)

    def engine_stats(self) -> dict[str, int]:
        return {"bytes_read": 0, "bytes_written": 0}

    def space_info(self) -> dict:
        return {"files": [self.space.path], "used_bytes": self.space.used_bytes, "capacity_bytes": self.space.capacity_bytes}

    def close(self) -> None:
        self.threads.shutdown(wait=True)
        self.space.close()
