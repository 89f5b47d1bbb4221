"""The NVMe window: which items (optimizer state blocks, stage 3 param shards) hold host memory.

With nvme an item is on NVMe unless it is being prefetched, resident, or being evicted;
at most ``size`` of those hold host memory at once, and the host pool is sized for that
many of the largest item, so a prefetch never finds the pool full ([Note: host window]).
``HostWindow`` is that bookkeeping, shared by ``offload.zero.states`` and
``offload.zero.shards``: the store keeps its own placement list (its own enum with the
members NVME, IN_FLIGHT and RESIDENT) and hands it to the window, which moves items
between those three. ``size`` comes from the memory plan (``offload.plan``).
"""
from __future__ import annotations

import collections
import enum
import logging
import time
from typing import Any, Callable, Iterable

from csrc import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["HostWindow"]

# [Note: host window]
# A prefetch that would exceed the window first waits for the oldest evict; failing that,
# the store may name an idle resident item to drop (``drop_idle``: stage 3 drops a shard
# prefetched but not used, which is clean, so its evict writes nothing); failing that, the
# prefetch is not started (the item's acquire starts it later, or says the window is full).


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
