"""What the daemon does for each request kind (the protocol is in ``daemon.protocol``).

[Note: what runs on the loop] Bookkeeping verbs (ALLOCATE, MARK_DIRTY, REGION, STATS,
PING, REPORT_STEP, JOB_STEP, PLACEMENTS, ENGINE, SPACE, and the submit half of PREFETCH
and EVICT) are answered inline from the event loop: the store defines them as
in-memory operations under its lock, which no transfer holds for long, and a thread
hop would double the small-request round trip. Everything that waits on I/O runs on
the *I/O executor* inside a scheduler job: the store's prefetch/evict/flush, their
waits, and FREE while the session has I/O under way (the store settles a region's
pending transfer before freeing it). STATUS, which walks every region of every
session, runs on its own one-thread executor, and requests that arrive while one is
being computed share the next one: a flood of STATUS costs two walks, and never takes a
thread from transfers or from opening and closing sessions (the *admin* executor).

[Note: per-session limits] Each limit of ``SessionConfig`` is checked before the request
reserves anything, and a request over it gets ``QuotaExceededError`` (or ``ConfigError``
for a bad value) naming the key: regions, region name length, queued transfers,
unwaited handles. Other sessions never notice.

[Note: client-visible state] The daemon waits for every transfer as soon as the
scheduler has started it, so that it can start the next; a local ``TierStore``
changes a region's state only when its caller waits. To keep the interface the same,
a region named by a prefetch or evict the client has not waited for yet shows as
``IN_FLIGHT`` to that client (REGION, host views, MARK_DIRTY, STATS' in-flight bytes),
as it would on a local store, until the client's WAIT returns.

[Note: a poll is a question] A WAIT with ``timeout_seconds`` 0 asks whether the transfer
is done, without waiting: the engine's host window asks so after every step
(``HostWindow.poll`` and ``.arrived`` in ``offload.zero.window``). "Not yet" is answered
as a local store answers it, with a ``TimeoutError`` (``StillInFlight`` here, ``TimeoutError``
on the wire), but it is an answer, not an error: it is neither counted in
``offload_errors_total`` nor logged as a refusal, so a healthy job adds nothing to either.
A wait that ran out of a nonzero limit is a client that waited in vain: counted and logged.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any, Awaitable, Callable

from csrc.errors import ConfigError, ProtocolError, QuotaExceededError
from daemon.backend import StoreBackend, region_to_wire, stats_to_wire
from daemon.config import SessionConfig
from daemon.metrics import DaemonMetrics
from daemon.protocol import PROTOCOL_VERSION, Kind
from daemon.scheduler import FairScheduler, JobClass
from daemon.sessions import PRIVILEGED_UID, Session, SessionTable

logger = logging.getLogger(__name__)

__all__ = ["Handlers", "StillInFlight", "SYNC_KINDS", "PEER_KINDS", "needs_session", "no_session_error"]

SYNC_KINDS = frozenset(
    {Kind.ALLOCATE, Kind.MARK_DIRTY, Kind.REGION, Kind.PREFETCH, Kind.EVICT, Kind.STATS, Kind.REPORT_STEP,
     Kind.JOB_STEP, Kind.PING, Kind.PLACEMENTS, Kind.ENGINE, Kind.SPACE}
)
"""Kinds answered inline on the loop; the rest run as tasks (see the note)."""

_IN_FLIGHT = "IN_FLIGHT"


class StillInFlight(TimeoutError):
    """The answer "not yet" to a poll (a WAIT with timeout 0): no error ([Note: a poll is a question])."""


def _field(obj: Any, name: str, default: Any = 0) -> Any:
    return obj.get(name, default) if isinstance(obj, dict) else getattr(obj, name, default)


class Handlers:
    """Request handlers over one daemon's sessions, scheduler, backend and metrics."""

    def __init__(self, sessions: SessionTable, scheduler: FairScheduler, backend: StoreBackend,
                 metrics: DaemonMetrics, limits: SessionConfig, io_executor: concurrent.futures.Executor,
                 status_executor: concurrent.futures.Executor) -> None:
        self.sessions = sessions
        self.scheduler = scheduler
        self.backend = backend
        self.metrics = metrics
        self.limits = limits
        self._io = io_executor
        self._status_executor = status_executor
        self._status: asyncio.Future[dict[str, Any]] | None = None
        self._status_next: asyncio.Future[dict[str, Any]] | None = None
        self.started_at = time.monotonic()
        self.bytes_moved = {"read": 0, "write": 0}
        self.busy_seconds = {"read": 0.0, "write": 0.0}
        self.inflight_bytes = 0
        self.metrics_address = ""

    def _run_io(self, fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
        return asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    def _check_names(self, names: list[str]) -> None:
        limit = self.limits.max_region_name_bytes
        for name in names:
            if len(name) * 4 > limit and len(name.encode()) > limit:
                raise ConfigError(f"region name of {len(name.encode())} bytes is longer than "
                                  f"[sessions] max_region_name_bytes = {limit}")

    # -- bookkeeping, inline ---------------------------------------------------------
    def allocate(self, s: Session, body: dict[str, Any]) -> dict[str, Any]:
        self._check_names([body["name"]])
        if s.regions >= self.limits.max_regions_per_session:
            raise QuotaExceededError(f"the session holds [sessions] max_regions_per_session = "
                                     f"{self.limits.max_regions_per_session} regions")
        wire = region_to_wire(s.store.allocate(body["name"], body["nbytes"]))
        s.regions += 1
        return {"region": wire}

    def region(self, s: Session, body: dict[str, Any]) -> dict[str, Any]:
        name = body["name"]
        wire = region_to_wire(s.store.info(name))
        if name in s.unwaited:
            wire["tier"] = _IN_FLIGHT
        if body["view"]:
            if wire["tier"] == _IN_FLIGHT:
                raise ConfigError(f"region {name!r} has no host copy to view (tier in_flight): "
                                  "wait for its prefetch or evict first")
            s.store.host_view(name)  # the store's own checks and errors (no host copy: prefetch it)
        return {"region": wire}

    def mark_dirty(self, s: Session, body: dict[str, Any]) -> dict[str, Any]:
        name = body["name"]
        if name in s.unwaited:
            s.store.info(name)  # an unknown name is the store's error
            raise ConfigError(f"region {name!r} has no host copy to mark dirty (tier in_flight)")
        s.store.mark_dirty(name)
        return {}

    def stats(self, s: Session, body: dict[str, Any]) -> dict[str, Any]:
        wire = stats_to_wire(s.store.stats())
        if s.unwaited and "in_flight_bytes" in wire:
            hidden = 0  # transfers done in the daemon that the client has not waited for
            for name in s.unwaited:
                info = s.store.info(name)
                if region_to_wire(info)["tier"] != _IN_FLIGHT:
                    hidden += info.nbytes
            wire["in_flight_bytes"] += hidden
        return {"stats": wire}

    def placements(self, s: Session, body: dict[str, Any]) -> dict[str, Any]:
        return {"placements": [list(p) for p in s.store.placements(body["name"])]}

    def engine(self, s: Session | None, body: dict[str, Any]) -> dict[str, Any]:
        return {"name": self.backend.engine_name, "stats": self.backend.engine_stats()}

    def space(self, s: Session | None, body: dict[str, Any]) -> dict[str, Any]:
        return self.backend.space_info()

    def report_step(self, s: Session, body: dict[str, Any]) -> dict[str, Any]:
        seconds = float(body["seconds"])
        if not 0 <= seconds < 86400:
            raise ValueError(f"step seconds must be in [0, 86400), got {seconds}")
        self.metrics.optimizer_step_seconds.observe(seconds)
        return {}

    def job_step(self, s: Session, body: dict[str, Any]) -> dict[str, Any]:
        """One optimizer step's figures for the per-job series (daemon.jobs); the fields are checked already."""
        labelled = self.metrics.jobs.report(s.owner_uid, s.job_id, s.rank, body)
        if not body.get("closing"):
            self.metrics.optimizer_step_seconds.observe(body["step_seconds"])
        return {"labelled": labelled}

    def ping(self, s: Session | None, body: dict[str, Any]) -> dict[str, Any]:
        return {}

    @staticmethod
    def _session_row(x: Session) -> dict[str, Any]:
        """One session's status; in a worker thread, as it walks every region."""
        if x.pending is not None:  # its trainer is to hand its memory back ([Note: hand-back] in daemon.handback)
            return {"job_id": x.job_id, "rank": x.rank, "uid": x.owner_uid, "state": "waiting for its memory",
                    "quota_bytes": x.quota_bytes, "stats": {}, "regions_by_tier": {},
                    "daemon_restarts": x.restarts, "reattached_after_restart": False}
        try:
            stats = stats_to_wire(x.store.stats())
            tiers: dict[str, int] = {}
            for name in x.store.names():
                tier = region_to_wire(x.store.info(name))["tier"]
                tiers[tier] = tiers.get(tier, 0) + 1
        except Exception as exc:  # a store closing under us: report it, do not fail the status
            stats, tiers = {"error": str(exc)}, {}
        return {"job_id": x.job_id, "rank": x.rank, "uid": x.owner_uid, "state": x.state.value,
                "quota_bytes": x.quota_bytes, "stats": stats, "regions_by_tier": tiers,
                "daemon_restarts": x.restarts, "reattached_after_restart": x.reattached_after_restart}

    def _status_snapshot(self, sessions: list[Session]) -> dict[str, Any]:
        rows = [self._session_row(x) for x in sessions]
        try:
            space = self.backend.space_info()
            swap = {"used_bytes": space["used_bytes"], "capacity_bytes": space["capacity_bytes"]}
        except Exception as exc:  # closing: report it
            swap = {"error": str(exc)}
        held = sum(r["stats"].get("host_pool_used_bytes", 0) for r in rows)
        return {"rows": rows, "swap": swap, "held_bytes": held}

    def _start_status(self) -> "asyncio.Future[dict[str, Any]]":
        self._status = asyncio.get_running_loop().run_in_executor(
            self._status_executor, self._status_snapshot, list(self.sessions))
        return self._status

    async def _status_after(self, running: "asyncio.Future[dict[str, Any]]") -> dict[str, Any]:
        await asyncio.wait([running])
        self._status_next = None
        return await self._start_status()

    async def status(self, uid: int, body: dict[str, Any]) -> dict[str, Any]:
        """STATUS for a peer of ``uid``: every session for root, else only that uid's ones.

        Every answer is computed after its request arrived; requests that arrive while one
        is being computed share the next one (so a flood costs two walks, not one each)."""
        running = self._status
        if running is None or running.done():
            future = self._start_status()
        else:
            if self._status_next is None:
                self._status_next = asyncio.ensure_future(self._status_after(running))
            future = self._status_next
        snap = await asyncio.shield(future)
        rows = snap["rows"] if uid == PRIVILEGED_UID else [r for r in snap["rows"] if r["uid"] == uid]
        jobs = self.metrics.jobs
        rows = [{**r, "training": jobs.rank_status(r["uid"], r["job_id"], r["rank"])} for r in rows]
        bandwidth = {d: (self.bytes_moved[d] / self.busy_seconds[d] if self.busy_seconds[d] else 0.0)
                     for d in self.bytes_moved}
        return {"version": PROTOCOL_VERSION, "engine": self.backend.engine_name,
                "metrics_address": self.metrics_address, "uptime_seconds": time.monotonic() - self.started_at,
                "pool": {"capacity_bytes": self.sessions.capacity_bytes, "used_bytes": self.sessions.used_bytes,
                         "held_bytes": snap["held_bytes"], "segment_bytes": self.sessions.segment_bytes,
                         "max_quota_bytes": self.sessions.quota_limit_bytes},
                "swap": snap["swap"], "bytes_moved": dict(self.bytes_moved), "bytes_per_second": bandwidth,
                "queued": self.scheduler.depth(), "inflight": self.scheduler.inflight,
                "inflight_bytes": self.inflight_bytes, "sessions": rows}

    # -- I/O through the scheduler ---------------------------------------------------
    def _room_to_queue(self, s: Session, handles: int) -> None:
        """[Note: per-session limits] for a transfer about to be queued."""
        limits = self.limits
        if self.scheduler.queued(s.key) >= limits.max_queued_transfers_per_session:
            raise QuotaExceededError(f"the session has [sessions] max_queued_transfers_per_session = "
                                     f"{limits.max_queued_transfers_per_session} transfers queued; "
                                     "wait for some first")
        if s.unwaited_handles + handles > limits.max_unwaited_handles_per_session:
            raise QuotaExceededError(f"the session has [sessions] max_unwaited_handles_per_session = "
                                     f"{limits.max_unwaited_handles_per_session} handles not waited for; "
                                     "wait for some first")

    def _transfer(self, s: Session, body: dict[str, Any], kind: str) -> dict[str, Any]:
        names = list(dict.fromkeys(body["names"]))
        self._check_names(names)
        self._room_to_queue(s, 1)
        infos = [s.store.info(n) for n in names]  # unknown names fail now, as on a local store
        direction = "read" if kind == "prefetch" else "write"
        moving = "NVME" if kind == "prefetch" else "HOST"  # what has bytes to move: absent, or dirty
        cost = sum(i.nbytes for i in infos if region_to_wire(i)["tier"] == moving)
        start, wait = (s.store.prefetch, s.store.wait_for_prefetch) if kind == "prefetch" else \
            (s.store.evict, s.store.wait_for_evict)

        def transfer() -> None:  # in a worker thread: the store may settle a pending region first
            wait(start(names))

        async def run() -> None:
            t0 = time.monotonic()
            self.inflight_bytes += cost
            try:
                await self._run_io(transfer)
            finally:
                self.inflight_bytes -= cost
            self._moved(direction, cost, time.monotonic() - t0)

        cls = JobClass.PREFETCH if kind == "prefetch" else JobClass.WRITEBACK
        future = self.scheduler.submit(s.key, cls, cost, run, names)
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even if never waited
        return {"handle": s.new_handle(kind, names, future)}

    def prefetch(self, s: Session, body: dict[str, Any]) -> dict[str, Any]:
        return self._transfer(s, body, "prefetch")

    def evict(self, s: Session, body: dict[str, Any]) -> dict[str, Any]:
        return self._transfer(s, body, "evict")

    def _moved(self, direction: str, nbytes: int, seconds: float) -> None:
        """A job moved ``nbytes`` (logical: the regions that were absent, or dirty)."""
        self.bytes_moved[direction] += nbytes
        self.busy_seconds[direction] += seconds
        self.metrics.swap_bytes.labels(tier="nvme", direction=direction).inc(nbytes)
        self.metrics.transfer_seconds.labels(direction=direction).observe(seconds)

    async def wait(self, s: Session, body: dict[str, Any], kind: str) -> dict[str, Any]:
        number, timeout = body["handle"], body["timeout_seconds"]
        h = s.handles.get(number)
        if h is None or h.kind != kind:
            what = f"a {h.kind} handle" if h else "no pending handle"
            raise ConfigError(f"expected a handle from {kind}, got {what} ({number})")
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(h.future), timeout)
        except asyncio.TimeoutError:
            late = StillInFlight if timeout == 0 else TimeoutError  # [Note: a poll is a question]
            raise late(f"{kind} not done after {timeout} s; regions still in flight: "
                       f"{', '.join(h.names[:8])}{' ...' if len(h.names) > 8 else ''}") from None
        finally:
            if h.future.done():
                s.waited(number)
            if kind == "prefetch":
                self.metrics.prefetch_wait_seconds.observe(time.monotonic() - t0)
        return {}

    async def wait_prefetch(self, s: Session, body: dict[str, Any]) -> dict[str, Any]:
        return await self.wait(s, body, "prefetch")

    async def wait_evict(self, s: Session, body: dict[str, Any]) -> dict[str, Any]:
        return await self.wait(s, body, "evict")

    async def flush(self, s: Session, body: dict[str, Any]) -> dict[str, Any]:
        self._room_to_queue(s, 0)
        cost = int(_field(s.store.stats(), "dirty_bytes", 1))

        async def run() -> None:
            t0 = time.monotonic()
            self.inflight_bytes += cost
            try:
                await self._run_io(s.store.flush)
            finally:
                self.inflight_bytes -= cost
            self._moved("write", cost, time.monotonic() - t0)

        await self.scheduler.submit(s.key, JobClass.WRITEBACK, cost, run)
        return {}

    async def free(self, s: Session, body: dict[str, Any]) -> dict[str, Any]:
        name = body["name"]
        if not self.scheduler.busy(s.key):
            s.store.free(name)  # nothing in flight for this session: free cannot block
        else:
            self._room_to_queue(s, 0)

            async def run() -> None:
                await self._run_io(s.store.free, name)
            await self.scheduler.submit(s.key, JobClass.WRITEBACK, 1, run, [name])
        s.regions -= 1
        s.unwaited.pop(name, None)
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
            Kind.STATUS: self.status, Kind.BYE: self.bye, Kind.PLACEMENTS: self.placements,
            Kind.ENGINE: self.engine, Kind.SPACE: self.space, Kind.JOB_STEP: self.job_step,
        }


_SESSIONLESS = frozenset({Kind.PING, Kind.STATUS, Kind.HELLO, Kind.ENGINE, Kind.SPACE})
PEER_KINDS = frozenset({Kind.STATUS})
"""Kinds whose handler takes the peer's uid where the others take the session."""


def needs_session(kind: Kind) -> bool:
    return kind not in _SESSIONLESS


def no_session_error(kind: Kind) -> ProtocolError:
    return ProtocolError(f"{kind.name} before HELLO: open a session first")

