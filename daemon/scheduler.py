"""The fair NVMe scheduler: per-session queues served round robin by bytes.

Every prefetch, evict and flush a client asks for becomes a *job*: one batch for the
session's store, with its byte count. Jobs wait in their session's FIFO queue. When a
slot is free (``max_inflight_jobs`` over all sessions), the scheduler picks the next
job by deficit round robin over sessions: each session gets ``quantum_bytes`` of credit
per turn and dispatches while its head job fits its credit, so sessions with equal
demand move equal bytes however their requests are sized. Sessions whose head job is
a prefetch are served before sessions whose head job is a write-back (a rank waiting
for data is stalled; a write-back only frees memory).

[Note: per-session order] Within one session jobs run one at a time and in the order
they were asked for: an evict followed by a prefetch of the same region must not be
reordered, and the store's verbs are not assumed safe to overlap for one session.
Sessions overlap with each other up to ``max_inflight_jobs``.
"""
from __future__ import annotations

import asyncio
import collections
import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Hashable

from csrc.errors import OffloadError, SessionError
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
    queued_at: float = field(default_factory=time.monotonic)


class FairScheduler:
    """Deficit round robin by bytes over sessions; see the module docstring."""

    def __init__(self, config: SchedulerConfig, on_depth: Callable[[JobClass, int], None] | None = None) -> None:
        self._config = config
        self._queues: dict[Hashable, collections.deque[_Job]] = {}
        self._order: collections.deque[Hashable] = collections.deque()  # sessions with queued jobs
        self._deficit: dict[Hashable, int] = collections.defaultdict(int)
        self._running: dict[Hashable, asyncio.Task[None]] = {}
        self._closed = False
        self._on_depth = on_depth
        self.served_bytes: dict[Hashable, int] = collections.defaultdict(int)

    def submit(self, key: Hashable, cls: JobClass, nbytes: int, run: Callable[[], Awaitable[None]]) -> asyncio.Future[None]:
        """Queue a job for session ``key``; the future completes when ``run()`` has."""
        if self._closed:
            raise OffloadError("the daemon is shutting down and takes no new I/O")
        job = _Job(key, cls, max(int(nbytes), 1), run, asyncio.get_running_loop().create_future())
        queue = self._queues.setdefault(key, collections.deque())
        if not queue and key not in self._order:
            self._order.append(key)
        queue.append(job)
        self._report_depth()
        self._dispatch()
        return job.future

    def depth(self, cls: JobClass | None = None) -> int:
        return sum(1 for q in self._queues.values() for j in q if cls is None or j.cls is cls)

    def busy(self, key: Hashable) -> bool:
        """Whether session ``key`` has a job queued or running."""
        return key in self._running or bool(self._queues.get(key))

    @property
    def inflight(self) -> int:
        return len(self._running)

    def _report_depth(self) -> None:
        if self._on_depth is not None:
            for cls in JobClass:
                self._on_depth(cls, self.depth(cls))

    def _eligible(self, cls: JobClass) -> list[Hashable]:
        return [k for k in self._order if k not in self._running and self._queues[k][0].cls is cls]

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
                    if not self._queues[key]:
                        self._order.popleft()
                        self._deficit[key] = 0
                    return head
                self._deficit[key] += self._config.quantum_bytes
                self._order.rotate(-1)
        return None

    def _dispatch(self) -> None:
        while len(self._running) < self._config.max_inflight_jobs:
            job = self._pick()
            if job is None:
                break
            self._running[job.key] = asyncio.get_running_loop().create_task(self._run(job))
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
            self._running.pop(job.key, None)
            self._dispatch()

    async def forget(self, key: Hashable) -> None:
        """Drop ``key``'s queued jobs (their futures fail) and wait for its running one."""
        queue = self._queues.pop(key, collections.deque())
        if key in self._order:
            self._order.remove(key)
        self._deficit.pop(key, None)
        for job in queue:
            if not job.future.done():
                job.future.set_exception(SessionError("the session was closed before this I/O ran"))
                job.future.exception()  # retrieved: nobody may be waiting any more
        task = self._running.get(key)
        if task is not None:
            await asyncio.wait([task])
        self._report_depth()

    async def drain(self, timeout_seconds: float) -> bool:
        """Refuse new jobs; wait up to ``timeout_seconds`` for queued and running ones."""
        self._closed = True
        deadline = time.monotonic() + timeout_seconds
        while self._order or self._running:
            left = deadline - time.monotonic()
            if left <= 0:
                logger.warning("drain timed out with %d queued and %d running jobs", self.depth(), self.inflight)
                return False
            if self._running:
                await asyncio.wait(list(self._running.values()), timeout=left)
            else:
                self._dispatch()
                await asyncio.sleep(0)
        return True
