"""The fair NVMe scheduler: per-session queues served round robin by bytes.

Every prefetch, evict and flush a client asks for becomes a *job*: one batch for the
session's store, with its byte count. Jobs wait in their session's FIFO queue. When a
slot is free (``max_inflight_jobs`` over all sessions), the scheduler picks the next
job by deficit round robin over sessions: each session gets ``quantum_bytes`` of credit
per turn and dispatches while its head job fits its credit, so sessions with equal
demand move equal bytes however their requests are sized. Sessions whose head job is
a prefetch are served before sessions whose head job is a write-back (a rank waiting
for data is stalled; a write-back only frees memory).

[Note: per-session order] Within one session, jobs start in the order they were asked
for, and a job starts only when it names no region that a running job of the session
names (an evict followed by a prefetch of the same region runs in that order). Jobs on
disjoint regions overlap, up to ``max_inflight_jobs_per_session``, so one session can
keep the disk's queue as deep as a local store does when it prefetches ahead. A job
with no names (FLUSH) runs alone. Over all sessions, ``max_inflight_jobs`` run at once.

Bookkeeping is O(1) per job: queue depths are counters kept as jobs come and go, and
the depth callback runs only when a depth changed. Choosing the next job walks the
sessions that have jobs queued (not the jobs).
"""
from __future__ import annotations

import asyncio
import collections
import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Hashable, Iterable

from csrc.errors import DaemonNotRunningError, SessionError
from daemon.config import SchedulerConfig

logger = logging.getLogger(__name__)

__all__ = ["JobClass", "FairScheduler"]


class JobClass(enum.Enum):
    PREFETCH = "prefetch"
    """Reads from NVMe into a session's host memory: served first."""
    WRITEBACK = "writeback"
    """Evicts and flushes: writes to NVMe, served when no prefetch waits."""


@dataclass(eq=False)
class _Job:
    key: Hashable
    cls: JobClass
    nbytes: int
    run: Callable[[], Awaitable[None]]
    future: asyncio.Future[None]
    names: frozenset[str] | None  # None: conflicts with every job of the session
    queued_at: float = field(default_factory=time.monotonic)

    def conflicts(self, other: "_Job") -> bool:
        return self.names is None or other.names is None or not self.names.isdisjoint(other.names)


class FairScheduler:
    """Deficit round robin by bytes over sessions; see the module docstring."""

    def __init__(self, config: SchedulerConfig, on_depth: Callable[[JobClass, int], None] | None = None) -> None:
        self._config = config
        self._queues: dict[Hashable, collections.deque[_Job]] = {}
        self._order: collections.deque[Hashable] = collections.deque()  # sessions with queued jobs
        self._deficit: dict[Hashable, int] = collections.defaultdict(int)
        self._running: dict[Hashable, list[_Job]] = {}  # per session, the jobs running now
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._on_depth = on_depth
        self._depth = {cls: 0 for cls in JobClass}  # queued jobs per class, kept as they come and go
        self._reported: dict[JobClass, int] = {}
        self._idle: dict[Hashable, asyncio.Event] = {}  # set when a session has nothing running
        self.served_bytes: dict[Hashable, int] = collections.defaultdict(int)

    def submit(self, key: Hashable, cls: JobClass, nbytes: int, run: Callable[[], Awaitable[None]],
               names: Iterable[str] | None = None) -> asyncio.Future[None]:
        """Queue a job on regions ``names`` (None: all) for session ``key``; the future completes when ``run()`` has."""
        if self._closed:
            raise DaemonNotRunningError("the daemon is shutting down and takes no new I/O")
        job = _Job(key, cls, max(int(nbytes), 1), run, asyncio.get_running_loop().create_future(),
                   None if names is None else frozenset(names))
        queue = self._queues.setdefault(key, collections.deque())
        if not queue and key not in self._order:
            self._order.append(key)
        queue.append(job)
        self._depth[cls] += 1
        self._dispatch()
        return job.future

    def depth(self, cls: JobClass | None = None) -> int:
        """Jobs queued (not yet started), of ``cls`` or of every class."""
        return sum(self._depth.values()) if cls is None else self._depth[cls]

    def queued(self, key: Hashable) -> int:
        """Jobs of session ``key`` queued, not yet started."""
        queue = self._queues.get(key)
        return len(queue) if queue else 0

    def busy(self, key: Hashable) -> bool:
        """Whether session ``key`` has a job queued or running."""
        return bool(self._running.get(key)) or bool(self._queues.get(key))

    @property
    def inflight(self) -> int:
        return len(self._tasks)

    def _report_depth(self) -> None:
        if self._on_depth is not None:
            for cls, n in self._depth.items():
                if self._reported.get(cls) != n:
                    self._reported[cls] = n
                    self._on_depth(cls, n)

    def _can_start(self, key: Hashable) -> bool:
        head, running = self._queues[key][0], self._running.get(key, ())
        return len(running) < self._config.max_inflight_jobs_per_session and \
            not any(head.conflicts(job) for job in running)

    def _eligible(self, cls: JobClass) -> set[Hashable]:
        return {k for k in self._order if self._queues[k][0].cls is cls and self._can_start(k)}

    def _pick(self) -> _Job | None:
        for cls in (JobClass.PREFETCH, JobClass.WRITEBACK):
            eligible = self._eligible(cls)
            if not eligible:
                continue
            # Rotate the global order to the first eligible session, then run DRR on it.
            while True:
                key = self._order[0]
                if key not in eligible:
                    self._order.rotate(-1)
                    continue
                head = self._queues[key][0]
                if self._deficit[key] >= head.nbytes:
                    self._deficit[key] -= head.nbytes
                    self._queues[key].popleft()
                    self._depth[head.cls] -= 1
                    if not self._queues[key]:
                        self._order.popleft()
                        self._deficit[key] = 0
                    return head
                self._deficit[key] += self._config.quantum_bytes
                self._order.rotate(-1)
        return None

    def _dispatch(self) -> None:
        while len(self._tasks) < self._config.max_inflight_jobs:
            job = self._pick()
            if job is None:
                break
            self._running.setdefault(job.key, []).append(job)
            idle = self._idle.get(job.key)
            if idle is not None:
                idle.clear()
            task = asyncio.get_running_loop().create_task(self._run(job))
            self._tasks.add(task)
            task.add_done_callback(self._finished)
        self._report_depth()

    async def _run(self, job: _Job) -> None:
        try:
            await job.run()
        except BaseException as exc:  # handed to whoever waits on the job
            if not job.future.done():
                job.future.set_exception(exc)
        else:
            self.served_bytes[job.key] += job.nbytes
            if not job.future.done():
                job.future.set_result(None)
        finally:
            running = self._running.get(job.key, [])
            running.remove(job)
            if not running:
                self._running.pop(job.key, None)
                idle = self._idle.pop(job.key, None)
                if idle is not None:
                    idle.set()

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._dispatch()

    async def forget(self, key: Hashable) -> None:
        """Drop ``key``'s queued jobs (their futures fail) and wait for its running one."""
        queue = self._queues.pop(key, collections.deque())
        if key in self._order:
            self._order.remove(key)
        self._deficit.pop(key, None)
        for job in queue:
            self._depth[job.cls] -= 1
            if not job.future.done():
                job.future.set_exception(SessionError("the session was closed before this I/O ran"))
                job.future.exception()  # retrieved: nobody may be waiting any more
        self._report_depth()
        if self._running.get(key):  # its running jobs finish (their I/O cannot be called back)
            idle = self._idle.setdefault(key, asyncio.Event())
            await idle.wait()

    async def drain(self, timeout_seconds: float) -> bool:
        """Refuse new jobs; wait up to ``timeout_seconds`` for queued and running ones."""
        self._closed = True
        deadline = time.monotonic() + timeout_seconds
        while self._order or self._tasks:
            left = deadline - time.monotonic()
            if left <= 0:
                logger.warning("drain timed out with %d queued and %d running jobs", self.depth(), self.inflight)
                return False
            if self._tasks:
                await asyncio.wait(list(self._tasks), timeout=left)
            else:
                self._dispatch()
                await asyncio.sleep(0)
        return True
