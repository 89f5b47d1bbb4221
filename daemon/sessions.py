"""Sessions: one per (job id, rank), each with its own host pool and store.

A client's HELLO names its job id, rank and quota. A new session reserves its quota
from the node pool (``QuotaExceededError`` when the pool has not that much left, or
the quota is above ``max_quota_bytes``), and the backend builds its memfd segments
(pre-touched, so in a worker thread) and its ``TierStore``.

[Note: reattach grace] When the connection ends (a clean close, a crash, SIGKILL),
the session is *detached*, not closed: its memory, its regions and their NVMe extents
stay for ``reattach_grace_seconds``. A HELLO with the same job id and rank in that
time gets the same session back (same segments, same regions, bytes intact). After the
grace period the session is *reclaimed*: queued I/O is dropped, running I/O is awaited,
the store is closed (which frees its extents and its pool) and the quota returns to the
node pool. A second HELLO for a session that is still attached is refused
(``SessionError``): one rank, one connection. Liveness is the socket itself (the kernel
closes it when the process dies), never a heartbeat on the data path.
"""
from __future__ import annotations

import asyncio
import collections
import enum
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from csrc.errors import QuotaExceededError, SessionError
from daemon.backend import StoreBackend
from daemon.config import PoolConfig, SessionConfig
from daemon.scheduler import FairScheduler

logger = logging.getLogger(__name__)

__all__ = ["SessionState", "Session", "SessionTable"]


class SessionState(enum.Enum):
    ATTACHED = "attached"
    """A connection owns the session; its requests are served."""
    DETACHED = "detached"
    """No connection; memory and extents kept until the grace period ends."""
    CLOSED = "closed"
    """Reclaimed: memory and extents returned; the object is only a tombstone."""


@dataclass(eq=False)
class Handle:
    """A prefetch or evict of this session, kept until long after the client waited for it."""

    kind: str
    names: list[str]
    future: asyncio.Future[None]
    waited: bool = False


DONE_HANDLES_KEPT = 4096
"""Waited-for handles kept per session, so a second wait on one answers as a local store does."""


@dataclass(eq=False)
class Session:
    session_id: int
    job_id: str
    rank: int
    quota_bytes: int
    store: Any
    segments: Sequence[Any]
    closer: Callable[[], None]
    state: SessionState = SessionState.ATTACHED
    handles: dict[int, Handle] = field(default_factory=dict)
    unwaited: dict[str, int] = field(default_factory=dict)
    """Region name -> handles naming it that the client has not waited for (see handlers)."""
    next_handle: int = 1
    _done: collections.deque[int] = field(default_factory=collections.deque)
    reclaim_timer: asyncio.TimerHandle | None = None
    detached_at: float | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.job_id, self.rank)

    def new_handle(self, kind: str, names: list[str], future: asyncio.Future[None]) -> int:
        handle = self.next_handle
        self.next_handle += 1
        self.handles[handle] = Handle(kind, names, future)
        for name in names:
            self.unwaited[name] = self.unwaited.get(name, 0) + 1
        return handle

    def waited(self, handle: int) -> None:
        """The client waited for ``handle`` (it is done): its regions show their real tier again."""
        h = self.handles.get(handle)
        if h is None or h.waited:
            return
        h.waited = True
        self._done.append(handle)
        while len(self._done) > DONE_HANDLES_KEPT:
            self.handles.pop(self._done.popleft(), None)
        for name in h.names:
            left = self.unwaited.get(name, 0) - 1
            if left > 0:
                self.unwaited[name] = left
            else:
                self.unwaited.pop(name, None)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class SessionTable:
    """All sessions of the daemon, the node pool's accounting, and reclaiming."""

    def __init__(
        self,
        config: SessionConfig,
        pool: PoolConfig,
        backend: StoreBackend,
        scheduler: FairScheduler,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self._config = config
        self._pool = pool
        self._backend = backend
        self._scheduler = scheduler
        self._sessions: dict[tuple[str, int], Session] = {}
        self._ids = itertools.count(1)
        self._on_change = on_change or (lambda: None)
        self.used_bytes = 0
        self.reclaimed_total = 0
        self._room = asyncio.Condition()  # notified when a reclaim returns memory to the node pool

    @property
    def capacity_bytes(self) -> int:
        return self._pool.capacity_bytes

    def __iter__(self):
        return iter(list(self._sessions.values()))

    def counts(self) -> tuple[int, int]:
        attached = sum(1 for s in self._sessions.values() if s.state is SessionState.ATTACHED)
        return attached, len(self._sessions) - attached

    async def attach(self, job_id: str, rank: int, quota_bytes: int) -> tuple[Session, bool]:
        """The session for (job_id, rank): reattached if detached, else a new one."""
        if not job_id or len(job_id) > 256 or rank < 0:
            raise SessionError(f"job_id must be 1-256 characters and rank >= 0, got {job_id!r}, {rank}")
        existing = self._sessions.get((job_id, rank))
        if existing is not None:
            if existing.state is SessionState.ATTACHED:
                raise SessionError(f"job {job_id!r} rank {rank} already has a session attached")
            if existing.reclaim_timer is not None:
                existing.reclaim_timer.cancel()
                existing.reclaim_timer = None
            existing.state = SessionState.ATTACHED
            existing.detached_at = None
            # The old connection's handles die with it; their transfers finish in the daemon.
            existing.handles.clear()
            existing.unwaited.clear()
            logger.info("job %s rank %d reattached (session %d)", job_id, rank, existing.session_id)
            self._on_change()
            return existing, True
        quota = _round_up(quota_bytes or self._config.default_quota_bytes, 4096)
        if quota > self._pool.segment_bytes:  # a pool is a whole number of segments
            quota = _round_up(quota, self._pool.segment_bytes)
        limit = self._config.max_quota_bytes or self._pool.capacity_bytes
        if quota > limit:
            raise QuotaExceededError(f"quota of {quota} bytes exceeds the per-session limit of {limit}")
        if self.used_bytes + quota > self._pool.capacity_bytes and self._config.quota_policy == "wait":
            await self._wait_for_room(quota)
        if self.used_bytes + quota > self._pool.capacity_bytes:
            raise QuotaExceededError(
                f"quota of {quota} bytes exceeds what the node pool has left "
                f"({self._pool.capacity_bytes - self.used_bytes} of {self._pool.capacity_bytes})"
                + (f" after waiting {self._config.quota_wait_seconds} s" if self._config.quota_policy == "wait" else "")
            )
        self.used_bytes += quota  # reserved before the await: two hellos cannot both take the rest
        try:
            opened = await asyncio.to_thread(self._backend.open_store, quota)
        except BaseException:
            self.used_bytes -= quota
            raise
        if (job_id, rank) in self._sessions:  # a racing hello won while we built the store
            self.used_bytes -= quota
            await asyncio.to_thread(opened.close)
            raise SessionError(f"job {job_id!r} rank {rank} already has a session attached")
        session = Session(next(self._ids), job_id, rank, quota, opened.store, list(opened.segments), opened.close)
        self._sessions[session.key] = session
        logger.info("job %s rank %d: session %d, %d bytes in %d segments",
                    job_id, rank, session.session_id, quota, len(session.segments))
        self._on_change()
        return session, False

    async def _wait_for_room(self, quota: int) -> None:
        """quota_policy "wait": sleep until reclaims leave room for ``quota`` (or time runs out)."""
        logger.info("waiting up to %.0f s for %d bytes of the node pool", self._config.quota_wait_seconds, quota)
        async with self._room:
            try:
                await asyncio.wait_for(
                    self._room.wait_for(lambda: self.used_bytes + quota <= self._pool.capacity_bytes),
                    self._config.quota_wait_seconds)
            except asyncio.TimeoutError:
                pass

    def detach(self, session: Session) -> None:
        """The connection ended: keep the session for the grace period (see the note)."""
        if session.state is not SessionState.ATTACHED:
            return
        session.state = SessionState.DETACHED
        session.detached_at = time.monotonic()
        grace = self._config.reattach_grace_seconds
        logger.info("job %s rank %d detached; kept for %.1f s", session.job_id, session.rank, grace)
        loop = asyncio.get_running_loop()
        session.reclaim_timer = loop.call_later(grace, lambda: loop.create_task(self._expire(session)))
        self._on_change()

    async def _expire(self, session: Session) -> None:
        if session.state is SessionState.DETACHED:
            await self.reclaim(session)

    async def reclaim(self, session: Session) -> None:
        """Close the session now: drop its I/O, close its store, return its quota."""
        if session.state is SessionState.CLOSED:
            return
        session.state = SessionState.CLOSED
        if session.reclaim_timer is not None:
            session.reclaim_timer.cancel()
            session.reclaim_timer = None
        self._sessions.pop(session.key, None)
        await self._scheduler.forget(session.key)
        for h in session.handles.values():
            if not h.future.done():
                h.future.cancel()
        session.handles.clear()
        session.unwaited.clear()
        try:
            await asyncio.to_thread(session.closer)
        except Exception:  # the quota still returns: the memory is unmapped with the pool
            logger.exception("closing the store of job %s rank %d failed", session.job_id, session.rank)
        self.used_bytes -= session.quota_bytes
        self.reclaimed_total += 1
        async with self._room:
            self._room.notify_all()
        logger.info("job %s rank %d reclaimed; pool use %d bytes", session.job_id, session.rank, self.used_bytes)
        self._on_change()

    async def close_all(self) -> None:
        for session in list(self._sessions.values()):
            await self.reclaim(session)
