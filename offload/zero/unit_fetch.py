"""Stage 3 on a GPU: units' shards copied from host memory into their device buffers through
``offload.gpu.transfers.Fetcher``, ahead of use.

[Note: unit fetches] With ``offload_param`` cpu or nvme and one rank, a unit's shard is the whole
unit, in a host region of the param tier. A plain ``full.copy_(shard)`` from there is synchronous
and goes through the driver's staging buffer. Instead the param tier's segments are registered
with CUDA once ([Note: one registration per segment]) and the coordinator
(``offload.zero.params``) asks ``UnitFetches`` for units:
- ``start(units)`` resizes each unit's buffer, pins its shard (``ShardStore.acquire``) and queues
  every copy with one ``Fetcher.start_fetch`` on the H2D stream: units at or above the batch
  threshold are one DMA each, the small ones (norms, biases, small layers) are gathered into one
  kernel launch ([Note: batch threshold]). The host does not wait.
- ``ready(u)`` makes the compute stream wait for the copy that brought ``u`` (an event), just
  before the module that needs ``u`` runs; the host still does not wait.
- A shard stays pinned until its copy has finished reading it (the host window may otherwise hand
  its memory to another shard): ``settle`` releases the shards of finished copies without
  blocking, and blocks on the oldest copies only when the pins would crowd the NVMe window
  (``max_pinned``); ``settle(block=True)`` at the end of backward and before the shards change.
The coordinator prefetches along the recorded fetch order ([Note: fetch order]): after each fetch,
the units ahead within ``prefetch_bucket_numel`` elements (and ``max_live_numel`` of gathered
units) are started, so their bytes cross the link while the current unit computes. With nvme
only shards already in host memory are started ahead: waiting for an NVMe read there would stall
the thread that launches the model's kernels.

Without a GPU the same code runs with a CPU ``Fetcher`` (copies at once, no events): the tests
drive the scheduling that way. Several ranks keep the all-gather path of ``ParamCoordinator``.
"""
from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple, Sequence

import torch

from offload.zero.shards import ShardStore

logger = logging.getLogger(__name__)

__all__ = ["UnitFetches", "param_fetcher"]


def param_fetcher(device: torch.device) -> Any:
    """The ``Fetcher`` stage 3's param shards go through on ``device``: one on a GPU, None elsewhere
    (the plain copies stay). Tests replace this to drive the path on the CPU."""
    if device.type != "cuda":
        return None
    from offload.gpu.select import startup_policy
    from offload.gpu.transfers import Fetcher

    return Fetcher(device, policy=startup_policy(device))


class _Copy(NamedTuple):
    """One ``start``: the units it brought and the transfer in flight."""

    units: tuple[int, ...]
    pending: Any


class UnitFetches:
    """Host -> device copies of units' shards, started ahead and fenced by events ([Note: unit fetches])."""

    def __init__(self, fetcher: Any, shards: ShardStore, full: Sequence[torch.Tensor], *,
                 max_pinned: int | None) -> None:
        self.fetcher = fetcher
        self.shards = shards
        self._full = full
        self.max_pinned = max_pinned
        self._copies: list[_Copy] = []  # oldest first; their shards are pinned until the copy is done
        self._waiting: dict[int, Any] = {}  # unit -> the Pending the compute stream has not waited on yet
        self.acquire_wait_seconds = 0.0
        """Time ``start`` waited for shards (NVMe reads) before it could queue their copies."""
        self.units_started = 0
        self.launches = 0
        """``start_fetch`` calls (each one launch of the batched kernel at most, plus one DMA per large unit)."""

    @property
    def pinned(self) -> int:
        """Shards held for copies not yet known to be finished."""
        return sum(len(c.units) for c in self._copies)

    def room(self) -> int | None:
        """How many more shards may be pinned now (None: no limit)."""
        return None if self.max_pinned is None else max(0, self.max_pinned - self.pinned)

    def start(self, units: Sequence[int]) -> None:
        """Queue the copies of ``units`` (not gathered, not in flight) into their device buffers."""
        if not units:
            return
        self.settle()
        while self.max_pinned is not None and self._copies and self.pinned + len(units) > self.max_pinned:
            self._retire(0, block=True)
        pairs = []
        for u in units:
            full = self._full[u]
            full.untyped_storage().resize_(full.numel() * full.element_size())
            t0 = time.perf_counter()
            shard = self.shards.acquire(u)
            self.acquire_wait_seconds += time.perf_counter() - t0
            pairs.append((full, shard))
        with torch.no_grad():
            pending = self.fetcher.start_fetch(pairs)
        self._copies.append(_Copy(tuple(units), pending))
        for u in units:
            self._waiting[u] = pending
        self.units_started += len(units)
        self.launches += 1
        self.settle()  # copies that ran at once (no GPU) give their shards back now

    def in_flight(self, u: int) -> bool:
        """Whether ``u`` was started and the compute stream has not been told to wait for it yet."""
        return u in self._waiting

    def ready(self, u: int) -> None:
        """Order the compute stream after ``u``'s copy (a no-op when it already is)."""
        pending = self._waiting.pop(u, None)
        if pending is not None:
            self.fetcher.wait_fetch(pending)

    def forget(self, u: int) -> None:
        """``u``'s buffer is being freed unused: nothing will wait for its copy (its shard is still
        released by ``settle``; the allocator keeps the memory until the copy stream is past it)."""
        self._waiting.pop(u, None)

    def settle(self, *, block: bool = False) -> None:
        """Release the shards of copies that have finished (all of them, waiting, with ``block``)."""
        i = 0
        while i < len(self._copies):
            event = self._copies[i].pending.event
            if block or event is None or event.query():
                self._retire(i, block=block)
            else:
                i += 1

    def _retire(self, i: int, *, block: bool) -> None:
        copy = self._copies.pop(i)
        if block:
            self.fetcher.wait_sources(copy.pending)
        for u in copy.units:
            self.shards.release(u, dirty=False)
