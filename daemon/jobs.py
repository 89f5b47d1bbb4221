"""Per-job training metrics: what each rank reports per step (JOB_STEP), kept per job and rank.

A training engine that runs through the daemon sends one JOB_STEP per optimizer step (see
``daemon.protocol``): its step count, and what the step took (seconds, seconds waiting on I/O,
bytes moved each way, steps skipped) and the loss scale. ``JobTable`` adds them up per
(uid, job id, rank) and exports them, at every scrape, as these series:

==========================================  =======  =====================================================
metric                                      type     what
==========================================  =======  =====================================================
offload_job_step                            gauge    the engine's step count at its last report
offload_job_steps_total                     counter  optimizer steps reported (skipped ones included)
offload_job_skipped_steps_total             counter  steps skipped for a non-finite gradient
offload_job_step_seconds_total              counter  time in optimizer steps
offload_job_io_wait_seconds_total           counter  time the steps waited on tier I/O
offload_job_bytes_total                     counter  bytes the rank's tier moved; ``direction`` read|write
offload_job_loss_scale                      gauge    the loss scale after the last step
offload_jobs                                gauge    jobs with series now (no labels)
offload_job_reports_over_cap_total          counter  reports of jobs beyond ``max_jobs`` (no labels)
==========================================  =======  =====================================================

Every per-job series has the labels ``uid``, ``job`` and ``rank`` (the session's). With a
training job label named ``job``, Prometheus must scrape with ``honor_labels: true`` (the
shipped ``tools/prometheus/offload.yml`` does), else it files the label as ``exported_job``.

[Note: bounded job labels] The label set stays bounded however many jobs come and go:
* at most ``max_jobs`` jobs (a job is a (uid, job id) pair) have series at once. A job gets
  its place at its first report; a report of a job without one while all are taken is
  counted in ``offload_job_reports_over_cap_total`` and labels nothing (the reply says
  ``labelled: false``; the engine goes on).
* a finished job's series are removed: when the last of its sessions is reclaimed (BYE, or
  the reattach grace ran out after a crash), plus what is left of the reattach grace after
  its sessions ended, so a scrape can still see its last steps. A session of the job that
  opens in that time keeps the series (a restarted job continues its counters).
Ranks are bounded by the sessions a job may hold (``[sessions] max_sessions``).

Reports arrive on the event loop and scrapes in the metrics server's threads: one lock
guards the table, and a scrape copies the numbers out under it.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from typing import Any, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

logger = logging.getLogger(__name__)

__all__ = ["JobTable", "RankFigures", "RATE_WINDOW_REPORTS"]

RATE_WINDOW_REPORTS = 32
"""Step rates are taken over the last this many reports of a rank."""
_LABELS = ["uid", "job", "rank"]


@dataclasses.dataclass
class RankFigures:
    """What one rank of one job has reported, added up."""

    step: int = 0
    steps_total: int = 0
    skipped_steps_total: int = 0
    step_seconds_total: float = 0.0
    io_wait_seconds_total: float = 0.0
    read_bytes_total: int = 0
    write_bytes_total: int = 0
    loss_scale: float = 1.0
    reports: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=RATE_WINDOW_REPORTS))
    """(monotonic time, steps_total) of the last reports, for the step rate."""

    def steps_per_second(self) -> float:
        if len(self.reports) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self.reports[0], self.reports[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def status(self) -> dict[str, Any]:
        """This rank's figures as STATUS reports them."""
        steps = self.steps_total
        return {"step": self.step, "steps_total": steps, "skipped_steps_total": self.skipped_steps_total,
                "steps_per_second": self.steps_per_second(),
                "mean_step_seconds": self.step_seconds_total / steps if steps else 0.0,
                "io_wait_seconds_total": self.io_wait_seconds_total, "step_seconds_total": self.step_seconds_total,
                "read_bytes_total": self.read_bytes_total, "write_bytes_total": self.write_bytes_total,
                "loss_scale": self.loss_scale}


@dataclasses.dataclass
class _Job:
    sessions: set = dataclasses.field(default_factory=set)
    """Session ids of the job not yet reclaimed."""
    ranks: dict = dataclasses.field(default_factory=dict)
    """rank -> RankFigures; empty until the job's first report is labelled."""
    labelled: bool = False
    ends_at: float = 0.0
    """Monotonic time its reclaimed sessions' reattach grace ends (the latest of them)."""
    removal: asyncio.TimerHandle | None = None


class JobTable:
    """Per-job, per-rank training figures; a Prometheus collector (see the module docstring)."""

    def __init__(self, *, max_jobs: int, grace_seconds: float) -> None:
        self.max_jobs = max_jobs
        self.grace_seconds = grace_seconds
        self._jobs: dict[tuple[int, str], _Job] = {}
        self._labelled = 0
        self.over_cap_total = 0
        self._lock = threading.Lock()

    # -- from the event loop ------------------------------------------------------------
    def attached(self, uid: int, job_id: str, session_id: int) -> None:
        """A session of the job opened or reattached: the job is alive (a pending removal is off)."""
        with self._lock:
            job = self._jobs.setdefault((uid, job_id), _Job())
            job.sessions.add(session_id)
            if job.removal is not None:
                job.removal.cancel()
                job.removal = None

    def reclaimed(self, uid: int, job_id: str, session_id: int, detached_at: float | None) -> None:
        """A session of the job was reclaimed; when it was the job's last, its series go after the grace."""
        key = (uid, job_id)
        with self._lock:
            job = self._jobs.get(key)
            if job is None:
                return
            job.sessions.discard(session_id)
            now = time.monotonic()
            job.ends_at = max(job.ends_at, (detached_at if detached_at is not None else now) + self.grace_seconds)
            if job.sessions:
                return
            delay = job.ends_at - now
            if delay <= 0:
                self._remove(key)
                return
        job.removal = asyncio.get_running_loop().call_later(delay, self._remove_if_finished, key)

    def _remove_if_finished(self, key: tuple[int, str]) -> None:
        with self._lock:
            job = self._jobs.get(key)
            if job is not None and not job.sessions:
                self._remove(key)

    def _remove(self, key: tuple[int, str]) -> None:
        """Under the lock: the job and its series go."""
        job = self._jobs.pop(key)
        if job.labelled:
            self._labelled -= 1
            logger.info("job %s (uid %d) finished: its %d ranks' series removed", key[1], key[0], len(job.ranks))

    def report(self, uid: int, job_id: str, rank: int, body: dict[str, Any]) -> bool:
        """One JOB_STEP (fields already checked by the protocol); False when the job is beyond the cap."""
        with self._lock:
            job = self._jobs.setdefault((uid, job_id), _Job())
            if not job.labelled:
                if self._labelled >= self.max_jobs:
                    self.over_cap_total += 1
                    return False
                job.labelled = True
                self._labelled += 1
            figures = job.ranks.get(rank)
            if figures is None:
                figures = job.ranks[rank] = RankFigures()
            figures.step = body["step"]
            closing = body.get("closing", False)
            figures.steps_total += 0 if closing else 1
            figures.skipped_steps_total += body["skipped_steps"]
            figures.step_seconds_total += body["step_seconds"]
            figures.io_wait_seconds_total += body["io_wait_seconds"]
            figures.read_bytes_total += body["read_bytes"]
            figures.write_bytes_total += body["write_bytes"]
            figures.loss_scale = float(body["loss_scale"])
            if not closing:
                figures.reports.append((time.monotonic(), figures.steps_total))
        return True

    def rank_status(self, uid: int, job_id: str, rank: int) -> dict[str, Any] | None:
        with self._lock:
            job = self._jobs.get((uid, job_id))
            figures = job.ranks.get(rank) if job is not None else None
            return figures.status() if figures is not None else None

    @property
    def labelled_jobs(self) -> int:
        return self._labelled

    # -- from a scrape ------------------------------------------------------------------
    def _snapshot(self) -> list[tuple[list[str], RankFigures]]:
        with self._lock:
            return [([str(uid), job_id, str(rank)], dataclasses.replace(f, reports=collections.deque()))
                    for (uid, job_id), job in self._jobs.items() if job.labelled for rank, f in job.ranks.items()]

    def collect(self) -> Iterator[Any]:
        rows = self._snapshot()
        step = GaugeMetricFamily("offload_job_step", "The engine's step count at its last report.", labels=_LABELS)
        steps = CounterMetricFamily("offload_job_steps", "Optimizer steps reported (skipped ones included).",
                                    labels=_LABELS)
        skipped = CounterMetricFamily("offload_job_skipped_steps", "Steps skipped for a non-finite gradient.",
                                      labels=_LABELS)
        seconds = CounterMetricFamily("offload_job_step_seconds", "Time in optimizer steps.", labels=_LABELS)
        wait = CounterMetricFamily("offload_job_io_wait_seconds", "Time the steps waited on tier I/O.", labels=_LABELS)
        moved = CounterMetricFamily("offload_job_bytes", "Bytes the rank's tier moved.", labels=[*_LABELS, "direction"])
        scale = GaugeMetricFamily("offload_job_loss_scale", "The loss scale after the last step.", labels=_LABELS)
        for labels, f in rows:
            step.add_metric(labels, f.step)
            steps.add_metric(labels, f.steps_total)
            skipped.add_metric(labels, f.skipped_steps_total)
            seconds.add_metric(labels, f.step_seconds_total)
            wait.add_metric(labels, f.io_wait_seconds_total)
            moved.add_metric([*labels, "read"], f.read_bytes_total)
            moved.add_metric([*labels, "write"], f.write_bytes_total)
            scale.add_metric(labels, f.loss_scale)
        yield from (step, steps, skipped, seconds, wait, moved, scale)
        yield GaugeMetricFamily("offload_jobs", "Jobs with per-job series now.", value=self._labelled)
        over = CounterMetricFamily("offload_job_reports_over_cap", "JOB_STEP reports of jobs beyond [metrics] "
                                   "max_jobs, not labelled.", value=self.over_cap_total)
        yield over
