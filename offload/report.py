"""The engine's per-step report to the node daemon: what each optimizer step took, for its metrics.

With the optimizer state in the daemon, ``Engine.step`` calls ``StepReporter.report`` at every
accumulation boundary, after the commit (``offload.checkpoint.resume``). It sends one JOB_STEP (see
``daemon.protocol``) with the step count and, since the last report, the seconds in the step,
the seconds waiting on tier I/O, the bytes the tier moved each way, the steps skipped, and the
loss scale. The daemon adds them up per job and rank (``daemon.jobs``). Embedded stores have no
reporter: nothing is sent and nothing is measured.

What is reported is the difference of the engine's own totals (``Engine.offload_stats``), so the
daemon's counters equal them. The evicts of a step's last sub-groups finish after the step (while
the next forward runs), so their bytes come with the next report; ``Engine.close`` sends a last,
*closing* report once every transfer has settled, and from then on the daemon holds exactly what
the session moved. Where the totals start: a fresh session starts every total at zero; a resumed one starts
the bytes at what the session's store has moved so far (the daemon counted those already, bar
the steps after the last report of the process that died) and the step time and I/O wait at
zero (they belong to the process). A report the daemon refuses (an older daemon without JOB_STEP,
a figure out of range) is logged once and reporting stops: metrics never stop training. A daemon
that went away is not a refusal: ``DaemonNotRunningError`` goes up to ``Engine.step``, which says
what was lost with it (``offload.checkpoint.resume.daemon_lost``).
"""
from __future__ import annotations

import logging
from typing import Any

from csrc import DaemonNotRunningError, OffloadError

logger = logging.getLogger(__name__)

__all__ = ["StepReporter", "reporter_for"]


class StepReporter:
    """Sends an engine's per-step figures to its daemon session (a ``TierClient``)."""

    def __init__(self, client: Any, *, skipped_steps: int, resumed: bool) -> None:
        self._client = client
        self._read = self._written = 0
        if resumed:
            stats = client.stats()
            self._read, self._written = stats.bytes_read_total, stats.bytes_written_total
        self._step_seconds = 0.0
        self._io_wait_seconds = 0.0
        self._skipped = skipped_steps
        self.reports = 0
        """Reports the daemon accepted."""
        self.enabled = True

    def report(self, engine: Any, *, closing: bool = False) -> None:
        """After an optimizer step of ``engine``: one JOB_STEP with what changed since the last one.
        ``closing``: at close, once every transfer is settled: the bytes moved since, and no step."""
        if not self.enabled:
            return
        try:
            self._send(engine, closing)
        except DaemonNotRunningError:
            raise
        except (OffloadError, ValueError) as exc:
            self.enabled = False
            logger.warning("rank %d: the daemon refused the step report (%s); no more reports from this rank",
                           engine.global_rank, exc)

    def _send(self, engine: Any, closing: bool) -> None:
        stats = self._client.stats()
        step_seconds, io_wait = engine.step_seconds, engine.adam.storage.io_wait_seconds
        figures = {
            "step": engine.global_steps,
            "step_seconds": max(0.0, step_seconds - self._step_seconds),
            "io_wait_seconds": max(0.0, io_wait - self._io_wait_seconds),
            "read_bytes": max(0, stats.bytes_read_total - self._read),
            "write_bytes": max(0, stats.bytes_written_total - self._written),
            "skipped_steps": max(0, engine.skipped_steps - self._skipped),
            "loss_scale": float(engine.scaler.scale),
        }
        if closing:
            figures["closing"] = True
        self._client.job_step(**figures)
        self.reports += 0 if closing else 1
        self._step_seconds, self._io_wait_seconds = step_seconds, io_wait
        self._read, self._written = stats.bytes_read_total, stats.bytes_written_total
        self._skipped = engine.skipped_steps


def reporter_for(tier: Any, *, skipped_steps: int, resumed: bool) -> StepReporter | None:
    """The reporter for ``tier`` (an ``offload.tiers.Tier``): None unless it is a daemon session."""
    if tier is None or not tier.daemon or not hasattr(tier.store, "job_step"):
        return None
    return StepReporter(tier.store, skipped_steps=skipped_steps, resumed=resumed)
