"""What the daemon does for each request kind (the protocol is in ``daemon.protocol``).

[Note: what runs on the loop] Bookkeeping verbs (ALLOCATE, FREE, MARK_DIRTY, REGION,
STATS, PING, REPORT_STEP, STATUS, and the submit half of PREFETCH/EVICT) are answered
inline from the event loop: the store contract defines them as in-memory operations
that return at once, and a thread hop would double the small-request round trip.
Everything that waits on I/O (the wait half of a prefetch or evict, FLUSH, building
or closing a store) runs in a worker thread through the fair scheduler or
``asyncio.to_thread``, so the loop never blocks on a disk.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from csrc.errors import ProtocolError
from daemon.backend import StoreBackend, region_to_wire, stats_to_wire
from daemon.metrics import DaemonMetrics
from daemon.protocol import PROTOCOL_VERSION, Kind
from daemon.scheduler import FairScheduler, JobClass
from daemon.sessions import Session, SessionTable

logger = logging.getLogger(__name__)

__all__ = ["Handlers", "SYNC_KINDS"]

SYNC_KINDS = frozenset(
    {Kind.ALLOCATE, Kind.FREE, Kind.MARK_DIRTY, Kind.REGION, Kind.PREFETCH, Kind.EVICT, Kind.STATS,
     Kind.REPORT_STEP, Kind.PING, Kind.STATUS}
)
"""Kinds answered inline on the loop; the rest run as tasks (see the note)."""


class Handlers:
    """Request handlers over one daemon's sessions, scheduler, backend and metrics."""

    def __init__(self, sessions: SessionTable, scheduler: FairScheduler, backend: StoreBackend,
                 metrics: DaemonMetrics) -> None:
        self.sessions = sessions
        self.scheduler = scheduler
        self.backend = backend
        self.metrics = metrics
        self.started_at = time.monotonic()
        self.bytes_moved = {"read": 0, "write": 0}
        self.busy_seconds = {"read": 0.0, "write": 0.0}
        self.metrics_address = ""

    # -- bookkeeping, inline ---------------------------------------------------------
    def allocate(self, s: Session, body: dict[str, Any]) -> dict[str, Any]:
        name, nbytes = body["name"], body["nbytes"]
        if name in s.regions:
            raise ValueError(f"region {name!r} already exists in this session")
        wire = region_to_wire(s.store.allocate(name, nbytes))
        s.regions[name] = wire
        s.resident.add(name)
        s.dirty.add(name)
        return {"region": wire}

    def free(self, s: Session, body: dict[str, Any]) -> dict[str, Any]:
        name = body["name"]
        s.store.free(name)
        s.regions.pop(name, None)
        s.resident.discard(name)
        s.dirty.discard(name)
        return {}

    def mark_dirty(self, s: Session, body: dict[str, Any]) -> dict[str, Any]:
        s.store.mark_dirty(body["name"])
        s.dirty.add(body["name"])
        return {}

    def region(self, s: Session, body: dict[str, Any]) -> dict[str, Any]:
        name = body["name"]
        if name not in s.regions:
            raise KeyError(f"no region {name!r} in this session")
        lookup = getattr(s.store, "region_info", None)
        if lookup is not None:  # the placement may change when a region comes back from NVMe
            s.regions[name] = region_to_wire(lookup(name))
        return {"region": s.regions[name]}

    def stats(self, s: Session, body: dict[str, Any]) -> dict[str, Any]:
        return {"stats": stats_to_wire(s.store.stats())}

    def report_step(self, s: Session, body: dict[str, Any]) -> dict[str, Any]:
        seconds = float(body["seconds"])
        if not 0 <= seconds < 86400:
            raise ValueError(f"step seconds must be in [0, 86400), got {seconds}")
        self.metrics.optimizer_step_seconds.observe(seconds)
        return {}

    def ping(self, s: Session | None, body: dict[str, Any]) -> dict[str, Any]:
        return {}

    def status(self, s: Session | None, body: dict[str, Any]) -> dict[str, Any]:
        rows = []
        for x in self.sessions:
            try:
                stats = stats_to_wire(x.store.stats())
            except Exception as exc:  # a closing store: report, do not fail the status
                stats = {"error": str(exc)}
            rows.append({"job_id": x.job_id, "rank": x.rank, "state": x.state.value, "quota_bytes": x.quota_bytes,
                         "regions": len(x.regions), "resident": len(x.resident), "stats": stats})
        bandwidth = {d: (self.bytes_moved[d] / self.busy_seconds[d] if self.busy_seconds[d] else 0.0)
                     for d in self.bytes_moved}
        return {"version": PROTOCOL_VERSION, "engine": self.backend.engine_name,
                "metrics_address": self.metrics_address,
                "uptime_seconds": time.monotonic() - self.started_at,
                "pool": {"capacity_bytes": self.sessions.capacity_bytes, "used_bytes": self.sessions.used_bytes},
                "bytes_moved": dict(self.bytes_moved), "bytes_per_second": bandwidth,
                "queued": self.scheduler.depth(), "inflight": self.scheduler.inflight, "sessions": rows}

    # -- I/O through the scheduler ---------------------------------------------------
    def _names(self, s: Session, names: list[str]) -> None:
        for name in names:
            if name not in s.regions:
                raise KeyError(f"no region {name!r} in this session")

    def prefetch(self, s: Session, body: dict[str, Any]) -> dict[str, Any]:
        names = list(body["names"])
        self._names(s, names)
        nbytes = sum(s.regions[n]["nbytes"] for n in names if n not in s.resident)

        async def run() -> None:
            t0 = time.monotonic()
            handle = s.store.prefetch(names)
            await asyncio.to_thread(s.store.wait_for_prefetch, handle)
            self._moved("read", nbytes, time.monotonic() - t0)
            s.resident.update(names)

        future = self.scheduler.submit(s.key, JobClass.PREFETCH, nbytes, run)
        return {"handle": s.new_handle(future)}

    def evict(self, s: Session, body: dict[str, Any]) -> dict[str, Any]:
        names = list(body["names"])
        self._names(s, names)
        nbytes = sum(s.regions[n]["nbytes"] for n in names if n in s.dirty)

        async def run() -> None:
            t0 = time.monotonic()
            handle = s.store.evict(names)
            await asyncio.to_thread(s.store.wait_for_evict, handle)
            self._moved("write", nbytes, time.monotonic() - t0)
            s.resident.difference_update(names)
            s.dirty.difference_update(names)

        future = self.scheduler.submit(s.key, JobClass.WRITEBACK, nbytes, run)
        return {"handle": s.new_handle(future)}

    def _moved(self, direction: str, nbytes: int, seconds: float) -> None:
        self.bytes_moved[direction] += nbytes
        self.busy_seconds[direction] += seconds
        self.metrics.swap_bytes.labels(tier="nvme", direction=direction).inc(nbytes)
        self.metrics.transfer_seconds.labels(direction=direction).observe(seconds)

    async def wait(self, s: Session, body: dict[str, Any], prefetch: bool) -> dict[str, Any]:
        handle, timeout = body["handle"], body["timeout_seconds"]
        future = s.handles.get(handle)
        if future is None:
            raise KeyError(f"no pending {'prefetch' if prefetch else 'evict'} with handle {handle}")
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"handle {handle} not done after {timeout} s") from None
        finally:
            if future.done():
                s.handles.pop(handle, None)
            if prefetch:
                self.metrics.prefetch_wait_seconds.observe(time.monotonic() - t0)
        return {}

    async def wait_prefetch(self, s: Session, body: dict[str, Any]) -> dict[str, Any]:
        return await self.wait(s, body, prefetch=True)

    async def wait_evict(self, s: Session, body: dict[str, Any]) -> dict[str, Any]:
        return await self.wait(s, body, prefetch=False)

    async def flush(self, s: Session, body: dict[str, Any]) -> dict[str, Any]:
        nbytes = sum(s.regions[n]["nbytes"] for n in s.dirty if n in s.regions)

        async def run() -> None:
            t0 = time.monotonic()
            await asyncio.to_thread(s.store.flush)
            self._moved("write", nbytes, time.monotonic() - t0)
            s.dirty.clear()

        await self.scheduler.submit(s.key, JobClass.WRITEBACK, nbytes, run)
        return {}

    async def bye(self, s: Session, body: dict[str, Any]) -> dict[str, Any]:
        await self.sessions.reclaim(s)
        return {}

    def table(self) -> dict[Kind, Callable[..., dict[str, Any] | Awaitable[dict[str, Any]]]]:
        return {
            Kind.ALLOCATE: self.allocate, Kind.FREE: self.free, Kind.MARK_DIRTY: self.mark_dirty,
            Kind.REGION: self.region, Kind.PREFETCH: self.prefetch, Kind.WAIT_PREFETCH: self.wait_prefetch,
            Kind.EVICT: self.evict, Kind.WAIT_EVICT: self.wait_evict, Kind.FLUSH: self.flush,
            Kind.STATS: self.stats, Kind.REPORT_STEP: self.report_step, Kind.PING: self.ping,
            Kind.STATUS: self.status, Kind.BYE: self.bye,
        }


_SESSIONLESS = frozenset({Kind.PING, Kind.STATUS, Kind.HELLO})


def needs_session(kind: Kind) -> bool:
    return kind not in _SESSIONLESS


def no_session_error(kind: Kind) -> ProtocolError:
    return ProtocolError(f"{kind.name} before HELLO: open a session first")
