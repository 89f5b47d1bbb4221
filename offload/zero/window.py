"""The NVMe window: which items (optimizer state blocks, stage 3 param shards) hold host memory.

With nvme an item is on NVMe unless it is being prefetched, resident, or being evicted;
at most ``size`` of those hold host memory at once, and the host pool is sized for that
many of the largest item, so a prefetch never finds the pool full ([Note: host window]).
``HostWindow`` is that bookkeeping, shared by ``offload.zero.states`` and
``offload.zero.shards``: the store keeps its own placement list (its own enum with the
members NVME, IN_FLIGHT and RESIDENT) and hands it to the window, which moves items
between those three. ``window_size`` chooses ``size`` for the optimizer state from the
host memory budget, with ``buffer_count`` as the floor.
"""
from __future__ import annotations

import collections
import enum
import logging
import os
import time
from typing import Any, Callable, Iterable, Sequence

from csrc import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["HostWindow", "budget_bytes", "window_size"]

# [Note: host window]
# A prefetch that would exceed the window first waits for the oldest evict; failing that,
# the store may name an idle resident item to drop (``drop_idle``: stage 3 drops a shard
# prefetched but not used, which is clean, so its evict writes nothing); failing that, the
# prefetch is not started (the item's acquire starts it later, or says the window is full).

FREE_SHARE = 2
"""Without a configured budget the window takes at most 1/FREE_SHARE of the memory the
machine has available (MemAvailable), split evenly over the ranks on the node."""


class HostWindow:
    """At most ``size`` items in host memory: prefetches, resident items and evicts in flight."""

    def __init__(self, tier: Any, places: list, kind: type[enum.Enum], *, size: int, name: Callable[[int], str],
                 label: Callable[[int], str], noun: str,
                 drop_idle: Callable[[], int | None] | None = None) -> None:
        """``places``: the store's placement list, updated here; ``kind``: its enum; ``name``: an
        item's tier region; ``label`` / ``noun``: how errors name an item and the items."""
        self.tier = tier
        self.places = places
        self.size = size
        self._nvme, self._in_flight, self._resident = kind.NVME, kind.IN_FLIGHT, kind.RESIDENT
        self._name = name
        self._label = label
        self._noun = noun
        self._drop_idle = drop_idle
        self.handles: dict[int, Any] = {}  # item -> pending prefetch or evict handle
        self.evicting: collections.deque[int] = collections.deque()
        self.io_wait_seconds = 0.0
        self.prefetches_started = 0

    def held(self) -> int:
        return sum(1 for p in self.places if p == self._in_flight or p == self._resident)

    def make_room(self) -> bool:
        """Wait for evicts (or drop an idle item) until one more fits; False if none can."""
        while self.held() >= self.size:
            if self.evicting:
                self.finish_evict(self.evicting.popleft())
                continue
            idle = self._drop_idle() if self._drop_idle is not None else None
            if idle is None:
                return False
            self.evict(idle)
        return True

    def finish_evict(self, i: int) -> None:
        t0 = time.perf_counter()
        self.tier.wait_for_evict(self.handles.pop(i))
        self.io_wait_seconds += time.perf_counter() - t0
        self.places[i] = self._nvme

    def evict(self, i: int) -> None:
        """Start writing a resident item back (only what was marked dirty is written) and freeing it."""
        self.handles[i] = self.tier.evict([self._name(i)])
        self.places[i] = self._in_flight
        self.evicting.append(i)

    def prefetch(self, items: Iterable[int]) -> None:
        """Start bringing items to host memory, in order, while the window has room."""
        for i in items:
            if self.places[i] == self._in_flight and i in self.evicting:
                self.evicting.remove(i)
                self.finish_evict(i)
            if self.places[i] != self._nvme:
                continue
            if not self.make_room():
                return
            self.handles[i] = self.tier.prefetch([self._name(i)])
            self.places[i] = self._in_flight
            self.prefetches_started += 1

    def bring_in(self, i: int, *, read: bool = True) -> None:
        """Make item ``i`` resident, waiting for (or starting) its prefetch. ``read`` False: an item
        only on NVMe gets host memory without being read (``tier.claim``), where the tier can."""
        if self.places[i] == self._resident:
            return
        if not read and hasattr(self.tier, "claim"):
            if self.places[i] == self._in_flight and i in self.evicting:  # its write-back first
                self.evicting.remove(i)
                self.finish_evict(i)
        if not read and self.places[i] == self._nvme and hasattr(self.tier, "claim"):
            if not self.make_room():
                raise ConfigError(f"no room to bring {self._label(i)} in: {self.size} {self._noun} are held")
            self.tier.wait_for_prefetch(self.tier.claim([self._name(i)]))
            self.places[i] = self._resident
            return
        self.prefetch([i])
        if self.places[i] == self._nvme:
            raise ConfigError(f"no room to bring {self._label(i)} in: {self.size} {self._noun} are held")
        t0 = time.perf_counter()
        self.tier.wait_for_prefetch(self.handles.pop(i))
        self.io_wait_seconds += time.perf_counter() - t0
        self.places[i] = self._resident

    def arrived(self, i: int) -> bool:
        """Whether item ``i`` is resident now, retiring its finished prefetch without waiting for one."""
        if self.places[i] == self._resident:
            return True
        if self.places[i] != self._in_flight or i in self.evicting or i not in self.handles:
            return False
        try:
            self.tier.wait_for_prefetch(self.handles[i], timeout_seconds=0)
        except TimeoutError:
            return False
        del self.handles[i]
        self.places[i] = self._resident
        return True

    def drain(self) -> None:
        """Wait for every evict in flight."""
        while self.evicting:
            self.finish_evict(self.evicting.popleft())

    def poll(self) -> None:
        """Retire evicts that have finished, without waiting for any."""
        while self.evicting:
            i = self.evicting[0]
            try:
                self.tier.wait_for_evict(self.handles[i], timeout_seconds=0)
            except TimeoutError:
                return
            self.evicting.popleft()
            del self.handles[i]
            self.places[i] = self._nvme

    def settle(self, what: str) -> None:
        """On close: wait for every transfer in flight, logging (not raising) what failed."""
        for i in list(self.handles):
            handle = self.handles.pop(i)
            try:
                (self.tier.wait_for_evict if i in self.evicting else self.tier.wait_for_prefetch)(handle)
            except Exception as exc:  # closing anyway: say what was lost
                logger.warning("on close, %s %d: %s", what, i, exc)
        self.evicting.clear()


def available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo in bytes, or None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def budget_bytes(host_memory_bytes: int | None) -> tuple[int | None, str]:
    """The host memory a rank's offloaded state may take, and where that figure came from: the offload
    section's ``host_memory_bytes``, or 1/FREE_SHARE of the memory available now split over the node's
    ranks (LOCAL_WORLD_SIZE); None where neither is known."""
    if host_memory_bytes is not None:
        return host_memory_bytes, "offload.host_memory_bytes"
    free = available_bytes()
    if free is None:
        return None, "nothing"
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    source = f"1/{FREE_SHARE} of the available memory" + (f" over {ranks} ranks" if ranks > 1 else "")
    return free // FREE_SHARE // ranks, source


def window_size(block_bytes: Sequence[int], *, floor: int, fixed_bytes: int, host_memory_bytes: int | None,
                what: str, log: bool = True) -> int:
    """How many of ``block_bytes`` (page-rounded sizes of the items) the window holds.

    The budget is ``host_memory_bytes`` (the offload section's) less ``fixed_bytes`` (what
    stays resident anyway: the gradient accumulators), or else 1/FREE_SHARE of the memory
    available now, split over the node's ranks (LOCAL_WORLD_SIZE). As many of the largest
    blocks as fit in it, never fewer than ``floor`` (DeepSpeed's ``buffer_count``) nor more
    than there are blocks: a window that holds every block still writes each back after its
    step and prefetches it while backward runs, but never waits for one evict to make room
    for the next prefetch. Logged once per call (``log``: the estimate, which asks per row, does not)."""
    count = len(block_bytes)
    if count == 0:
        return floor
    budget, source = budget_bytes(host_memory_bytes)
    if budget is None:
        if log:
            logger.info("%s window: %d (buffer_count; the free memory could not be read)", what, floor)
        return floor
    budget -= fixed_bytes
    fit, used = 0, 0
    for b in sorted(block_bytes, reverse=True):
        if used + b > budget:
            break
        used += b
        fit += 1
    size = max(floor, fit)
    if log:
        logger.info("%s window: %d of %d blocks in host memory (buffer_count %d; budget %.2f GB from %s)",
                    what, min(size, count), count, floor, max(0, budget) / 1e9, source)
    return size
