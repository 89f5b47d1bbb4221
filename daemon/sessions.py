"""Sessions: one per (owner uid, job id, rank), each with its own host pool and store.

A client's HELLO names its job id, rank and quota. A new session reserves its quota
from the node pool (``QuotaExceededError`` when the pool has not that much left, the
quota is out of range, or the uid already holds ``max_sessions_per_uid`` sessions),
and the backend lends it segments of the node pool and builds its ``TierStore``.
Every limit is checked before anything is reserved, and each error names its key.

[Note: session ownership] A session belongs to the uid that opened it (SO_PEERCRED of
its connection): its key is (uid, job id, rank), so another uid's HELLO with the same
job id and rank is another session, and no uid can squat a job id in advance. The
HELLO reply carries a reattach *token* (random, 192 bits); a reattach needs the same
uid and that token, or root (uid 0) and the token. Each reattach issues a new token.

[Note: reattach grace] When the connection ends (a clean close, a crash, SIGKILL),
the session is *detached*, not closed: its memory, its regions and their NVMe extents
stay for ``reattach_grace_seconds``. A HELLO of its owner with its token in that time
gets the same session back (same segments, same regions, bytes intact). After the
grace period the session is *reclaimed*: queued I/O is dropped, running I/O is awaited,
the store is closed (which frees its extents), its segments go back to the node pool
(zeroed) and the quota returns. A second HELLO for a session that is still attached is
refused (``SessionError``): one rank, one connection. Liveness is the socket itself
(the kernel closes it when the process dies), never a heartbeat on the data path.
"""
from __future__ import annotations

import asyncio
import collections
import enum
import itertools
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

from csrc.errors import QuotaExceededError, SessionError
from daemon.backend import StoreBackend
from daemon.config import PoolConfig, SessionConfig
from daemon.handback import HandBackNeeded, take_hand_back
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
    owner_uid: int
    token: str
    quota_bytes: int
    store: Any
    segments: Sequence[Any]
    closer: Callable[[], None]
    state: SessionState = SessionState.ATTACHED
    regions: int = 0
    """Regions the session holds (ALLOCATE adds one, FREE takes one), against max_regions_per_session."""
    unwaited_handles: int = 0
    """Handles not yet waited for, against max_unwaited_handles_per_session."""
    handles: dict[int, Handle] = field(default_factory=dict)
    unwaited: dict[str, int] = field(default_factory=dict)
    """Region name -> handles naming it that the client has not waited for (see handlers)."""
    next_handle: int = 1
    _done: collections.deque[int] = field(default_factory=collections.deque)
    reclaim_timer: asyncio.TimerHandle | None = None
    detached_at: float | None = None
    previous_token: str = ""
    """The token before the last reattach's: a daemon killed before its HELLO reply left leaves the
    client with this one ([Note: adopted state] in ``daemon.journal``)."""
    adopted: bool = False
    """Taken over from the previous daemon at this daemon's start."""
    restarts: int = 0
    """Daemon restarts this session went through (0: opened by this daemon)."""
    reattached_after_restart: bool = False
    """An adopted session its trainer has reattached since."""
    pending: dict | None = None
    """The journal's row of a session whose segments its trainer is to hand back (store None until then):
    [Note: hand-back] in ``daemon.handback``."""

    @property
    def key(self) -> tuple[int, str, int]:
        return (self.owner_uid, self.job_id, self.rank)

    def new_handle(self, kind: str, names: list[str], future: asyncio.Future[None]) -> int:
        handle = self.next_handle
        self.next_handle += 1
        self.handles[handle] = Handle(kind, names, future)
        self.unwaited_handles += 1
        for name in names:
            self.unwaited[name] = self.unwaited.get(name, 0) + 1
        return handle

    def waited(self, handle: int) -> None:
        """The client waited for ``handle`` (it is done): its regions show their real tier again."""
        h = self.handles.get(handle)
        if h is None or h.waited:
            return
        h.waited = True
        self.unwaited_handles -= 1
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


PRIVILEGED_UID = 0
"""Root: may reattach any uid's session (with its token) and sees every session in STATUS."""


class SessionTable:
    """All sessions of the daemon, the node pool's accounting, and reclaiming."""

    def __init__(
        self,
        config: SessionConfig,
        pool: PoolConfig,
        backend: StoreBackend,
        scheduler: FairScheduler,
        on_change: Callable[[str, Session], None] | None = None,
        run_blocking: Callable[..., Awaitable[Any]] | None = None,
        keeper: Any = None,
    ) -> None:
        self._config = config
        self._pool = pool
        self._backend = backend
        self._scheduler = scheduler
        self._sessions: dict[tuple[int, str, int], Session] = {}
        self._opening: set[tuple[int, str, int]] = set()
        self._per_uid: collections.Counter[int] = collections.Counter()  # sessions, open or being opened
        self._ids = itertools.count(1)
        self.next_session_id = 1
        self._keeper = keeper
        """``daemon.restart.StateKeeper``, told of every session opened, reattached or closed (None: none)."""
        self._on_change = on_change or (lambda event, session: None)
        self._run = run_blocking or (lambda fn, *args: asyncio.to_thread(fn, *args))
        self.used_bytes = 0
        self.attached = 0
        self.reclaimed_total = 0
        self._room = asyncio.Condition()  # notified when a reclaim returns memory to the node pool

    @property
    def capacity_bytes(self) -> int:
        return self._pool.capacity_bytes // self._pool.segment_bytes * self._pool.segment_bytes

    @property
    def segment_bytes(self) -> int:
        return self._pool.segment_bytes

    @property
    def quota_limit_bytes(self) -> int:
        """The largest quota one session may hold ([sessions] max_quota_bytes, else the pool)."""
        return self._config.max_quota_bytes or self.capacity_bytes

    def __iter__(self):
        return iter(list(self._sessions.values()))

    def __len__(self) -> int:
        return len(self._sessions)

    def counts(self) -> tuple[int, int]:
        return self.attached, len(self._sessions) - self.attached

    def quota_for(self, quota_bytes: int) -> int:
        """The quota a HELLO asking for ``quota_bytes`` gets (0: the default), in whole segments; or the error."""
        c, seg = self._config, self._pool.segment_bytes
        if quota_bytes == 0:
            quota_bytes = c.default_quota_bytes
        elif quota_bytes < c.min_quota_bytes:
            raise QuotaExceededError(f"quota of {quota_bytes} bytes is below [sessions] min_quota_bytes = "
                                     f"{c.min_quota_bytes} (0 asks for the default)")
        quota = _round_up(quota_bytes, seg)  # a session's pool is a whole number of node-pool segments
        limit = self.quota_limit_bytes
        if quota > limit:
            raise QuotaExceededError(f"quota of {quota} bytes exceeds the per-session limit of {limit} "
                                     f"([sessions] max_quota_bytes, or the pool's capacity_bytes)")
        return quota

    def _reattach(self, existing: Session, uid: int, token: str) -> tuple[Session, bool]:
        if existing.state is SessionState.ATTACHED:
            raise SessionError(f"job {existing.job_id!r} rank {existing.rank} already has a session attached")
        if not token or not (secrets.compare_digest(token, existing.token) or
                             (existing.previous_token and secrets.compare_digest(token, existing.previous_token))):
            raise SessionError(f"job {existing.job_id!r} rank {existing.rank} is detached and kept for its "
                               f"owner: a reattach needs the token of its last HELLO reply")
        if existing.pending is not None:
            raise HandBackNeeded(existing)  # its memory first ([Note: hand-back])
        if existing.reclaim_timer is not None:
            existing.reclaim_timer.cancel()
            existing.reclaim_timer = None
        existing.state = SessionState.ATTACHED
        existing.detached_at = None
        existing.previous_token, existing.token = existing.token, secrets.token_urlsafe(24)
        if self._keeper is not None:
            self._keeper.token(existing)  # before the reply that carries it
        self.attached += 1
        # The old connection's handles die with it; their transfers finish in the daemon.
        existing.handles.clear()
        existing.unwaited.clear()
        existing.unwaited_handles = 0
        logger.info("job %s rank %d reattached by uid %d (session %d%s)", existing.job_id, existing.rank, uid,
                    existing.session_id, ", after a daemon restart" if existing.adopted else "")
        self._on_change("attach", existing)
        return existing, True

    def _find_for_root(self, job_id: str, rank: int, token: str) -> Session | None:
        for s in self._sessions.values():
            if s.job_id == job_id and s.rank == rank and token and secrets.compare_digest(token, s.token):
                return s
        return None

    async def attach(self, job_id: str, rank: int, quota_bytes: int, uid: int, token: str = "") -> tuple[Session, bool]:
        """The session of ``uid`` for (job_id, rank): reattached if detached (with its token), else a new one."""
        if not job_id or len(job_id) > 256 or not 0 <= rank < 1 << 31:
            raise SessionError(f"job_id must be 1-256 characters and rank in [0, 2**31), got {job_id!r}, {rank}")
        key = (uid, job_id, rank)
        existing = self._sessions.get(key)
        if existing is None and uid == PRIVILEGED_UID and token:
            existing = self._find_for_root(job_id, rank, token)
        if existing is not None:
            return self._reattach(existing, uid, token)
        if key in self._opening:
            raise SessionError(f"job {job_id!r} rank {rank} already has a session attached")
        quota = self.quota_for(quota_bytes)
        c = self._config
        if len(self._sessions) + len(self._opening) >= c.max_sessions:
            raise QuotaExceededError(f"the daemon holds [sessions] max_sessions = {c.max_sessions} sessions")
        if self._per_uid[uid] >= c.max_sessions_per_uid:
            raise QuotaExceededError(f"uid {uid} holds [sessions] max_sessions_per_uid = {c.max_sessions_per_uid} "
                                     "sessions (attached or detached)")
        self._opening.add(key)
        self._per_uid[uid] += 1
        try:
            session = await self._open(job_id, rank, uid, quota)
        except BaseException:
            self._per_uid[uid] -= 1
            raise
        finally:
            self._opening.discard(key)
        self._sessions[key] = session
        self.attached += 1
        if self._keeper is not None:
            self._keeper.opened(session)
        logger.info("job %s rank %d uid %d: session %d, %d bytes in %d segments",
                    job_id, rank, uid, session.session_id, quota, len(session.segments))
        self._on_change("attach", session)
        return session, False

    async def _open(self, job_id: str, rank: int, uid: int, quota: int) -> Session:
        if self.used_bytes + quota > self.capacity_bytes and self._config.quota_policy == "wait":
            await self._wait_for_room(quota)
        if self.used_bytes + quota > self.capacity_bytes:
            raise QuotaExceededError(
                f"quota of {quota} bytes exceeds what the node pool has left "
                f"({self.capacity_bytes - self.used_bytes} of {self.capacity_bytes})"
                + (f" after waiting {self._config.quota_wait_seconds} s" if self._config.quota_policy == "wait" else "")
            )
        self.used_bytes += quota  # reserved before the await: two hellos cannot both take the rest
        session_id = self._new_id()
        hook = self._keeper.region_hook(session_id) if self._keeper is not None else None
        try:
            opened = await self._run(self._backend.open_store, quota, uid, *([hook] if hook else []))
        except BaseException:
            self.used_bytes -= quota
            raise
        return Session(session_id, job_id, rank, uid, secrets.token_urlsafe(24), quota, opened.store,
                       list(opened.segments), opened.close)

    def _new_id(self) -> int:
        session_id = next(self._ids)
        self.next_session_id = session_id + 1
        return session_id

    async def restore(self, rows: dict[str, dict[str, Any]]) -> int:
        """Take over the previous daemon's sessions (``daemon.journal``'s state rows, by id): each store
        rebuilt over its adopted segments and its regions restored, the session detached and kept for the
        grace period. A session whose regions cannot be restored (a host block or swap extent taken
        twice, a record no region can be in) is refused with a log line and its segments go back; the
        rows left are those taken over; returns how many were refused."""
        refused = 0
        for sid in sorted(rows, key=int):
            row = rows[sid]
            hook = self._keeper.region_hook(int(sid)) if self._keeper is not None else None
            try:
                opened = await self._run(self._backend.open_store, row["quota_bytes"], row["uid"], hook,
                                         row["segments"])
            except Exception as exc:
                logger.warning("not taken over from the previous daemon: job %r rank %d (uid %d): %s",
                               row["job_id"], row["rank"], row["uid"], exc)
                await self._run(self._backend.return_adopted, row["segments"], row["uid"])
                del rows[sid]
                refused += 1
                continue
            try:
                for name, record in row["regions"].items():
                    opened.store.restore(name, record)
            except Exception as exc:
                logger.warning("not taken over from the previous daemon: job %r rank %d (uid %d): region %s",
                               row["job_id"], row["rank"], row["uid"], exc)
                await self._run(opened.close)
                del rows[sid]
                refused += 1
                continue
            session = Session(int(sid), row["job_id"], row["rank"], row["uid"], row["token"], row["quota_bytes"],
                              opened.store, list(opened.segments), opened.close, state=SessionState.ATTACHED,
                              regions=len(row["regions"]), previous_token=row.get("previous_token", ""),
                              adopted=True, restarts=int(row.get("restarts", 0)) + 1)
            row["restarts"] = session.restarts
            self._add_adopted(session)
            logger.info("took over job %s rank %d (uid %d, session %d, %d region(s)) from the previous daemon",
                        session.job_id, session.rank, session.owner_uid, session.session_id, session.regions)
        return refused

    @property
    def backend(self) -> StoreBackend:
        return self._backend

    def run(self, fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
        """``fn(*args)`` off the event loop (it may fault memory or wait on I/O)."""
        return self._run(fn, *args)

    def region_hook(self, session_id: int) -> Callable[[str, dict | None], None] | None:
        return self._keeper.region_hook(session_id) if self._keeper is not None else None

    async def restore_pending(self, rows: dict[str, dict[str, Any]]) -> int:
        """Keep the previous daemon's sessions whose trainers are to hand their segments back ([Note:
        hand-back]): their swap extents held, each detached for the grace period. Returns how many were
        refused (their extents could not be held)."""
        refused = 0
        for sid in sorted(rows, key=int):
            row = rows[sid]
            try:
                await self._run(self._backend.reserve_extents, row["regions"])
            except Exception as exc:
                logger.warning("not taken over from the previous daemon: job %r rank %d (uid %d): %s",
                               row["job_id"], row["rank"], row["uid"], exc)
                await self._run(self._backend.fill, row["segments"])
                del rows[sid]
                refused += 1
                continue

            def closer(row: dict = row) -> None:  # never handed back: the extents go, the segments are made anew
                self._backend.release_extents(row["regions"])
                self._backend.fill(row["segments"])

            session = Session(int(sid), row["job_id"], row["rank"], row["uid"], row["token"], row["quota_bytes"],
                              None, [], closer, regions=len(row["regions"]),
                              previous_token=row.get("previous_token", ""), adopted=True,
                              restarts=int(row.get("restarts", 0)) + 1, pending=row)
            row["restarts"] = session.restarts
            self._add_adopted(session)
            logger.info("kept job %s rank %d (uid %d, session %d, %d region(s)) for its trainer to hand its "
                        "%d segment(s) back", session.job_id, session.rank, session.owner_uid, session.session_id,
                        session.regions, len(row["segments"]))
        return refused

    def _add_adopted(self, session: Session) -> None:
        self._sessions[session.key] = session
        self._per_uid[session.owner_uid] += 1
        self.used_bytes += session.quota_bytes
        self.attached += 1
        self.detach(session)  # kept for the grace period, as after a lost connection
        self.next_session_id = max(self.next_session_id, session.session_id + 1)
        self._ids = itertools.count(self.next_session_id)

    async def take_hand_back(self, session: Session, fds: list[int]) -> None:
        """The segments of a pending session, from its trainer: checked, mapped, its store restored."""
        await take_hand_back(self, session, fds)

    def restart_ids(self) -> None:
        """Number new sessions from ``next_session_id`` on (after a takeover: none reuses an old id)."""
        self._ids = itertools.count(self.next_session_id)

    def rows(self) -> dict[str, dict[str, Any]]:
        """Every session as the journal's base keeps it."""
        return {str(s.session_id): {"uid": s.owner_uid, "job_id": s.job_id, "rank": s.rank, "token": s.token,
                                    "previous_token": s.previous_token, "quota_bytes": s.quota_bytes,
                                    "segments": [seg.index for seg in s.segments] if s.pending is None
                                    else list(s.pending["segments"]),
                                    "regions": s.store.durable() if s.pending is None else s.pending["regions"],
                                    "restarts": s.restarts}
                for s in self._sessions.values()}

    async def _wait_for_room(self, quota: int) -> None:
        """quota_policy "wait": sleep until reclaims leave room for ``quota`` (or time runs out)."""
        logger.info("waiting up to %.0f s for %d bytes of the node pool", self._config.quota_wait_seconds, quota)
        async with self._room:
            try:
                await asyncio.wait_for(
                    self._room.wait_for(lambda: self.used_bytes + quota <= self.capacity_bytes),
                    self._config.quota_wait_seconds)
            except asyncio.TimeoutError:
                pass

    def detach(self, session: Session) -> None:
        """The connection ended: keep the session for the grace period (see the note)."""
        if session.state is not SessionState.ATTACHED:
            return
        session.state = SessionState.DETACHED
        session.detached_at = time.monotonic()
        self.attached -= 1
        grace = self._config.reattach_grace_seconds
        logger.info("job %s rank %d detached; kept for %.1f s", session.job_id, session.rank, grace)
        loop = asyncio.get_running_loop()
        session.reclaim_timer = loop.call_later(grace, lambda: loop.create_task(self._expire(session)))
        self._on_change("detach", session)

    async def _expire(self, session: Session) -> None:
        if session.state is SessionState.DETACHED:
            await self.reclaim(session)

    async def reclaim(self, session: Session) -> None:
        """Close the session now: drop its I/O, close its store, return its quota."""
        if session.state is SessionState.CLOSED:
            return
        if session.state is SessionState.ATTACHED:
            self.attached -= 1
        session.state = SessionState.CLOSED
        if self._keeper is not None:
            self._keeper.closing(session)  # before its segments are zeroed and its extents freed
        self._per_uid[session.owner_uid] -= 1
        if self._per_uid[session.owner_uid] <= 0:
            del self._per_uid[session.owner_uid]
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
        self._on_change("reclaim", session)
        try:
            await self._run(session.closer)
        except Exception:  # the quota still returns: the memory is unmapped with the pool
            logger.exception("closing the store of job %s rank %d failed", session.job_id, session.rank)
        self.used_bytes -= session.quota_bytes
        self.reclaimed_total += 1
        async with self._room:
            self._room.notify_all()
        logger.info("job %s rank %d reclaimed; pool use %d bytes", session.job_id, session.rank, self.used_bytes)
        self._on_change("returned", session)

    async def close_all(self) -> None:
        for session in list(self._sessions.values()):
            await self.reclaim(session)
