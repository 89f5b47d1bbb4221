"""Where the kernels' threads come from: the process's OpenMP team, or the library's own pool.

By default a kernel called from the main thread runs on the main thread's libgomp team, the one torch's
CPU ops use, so a step that follows a torch op starts on workers that are already awake instead of
waiting for cores they hold ([Note: one thread team] in csrc/ofl_parallel.h). Other threads, forked
children and processes without exactly one libgomp use the pool. ``OFFLOAD_CPU_ADAM_THREADS=pool`` (or
``set_thread_source("pool")``) keeps every call on the pool.
"""
from __future__ import annotations

import os
from typing import NamedTuple

from csrc import ConfigError
from cpu_adam.kernels import ffi, lib

__all__ = ["THREADS_ENV", "TeamStats", "set_thread_source", "team_found", "team_stats", "thread_source"]

THREADS_ENV = "OFFLOAD_CPU_ADAM_THREADS"
_SOURCES = {"team": lib.OFL_THREADS_TEAM, "pool": lib.OFL_THREADS_POOL}
_source = "team"


class TeamStats(NamedTuple):
    """What the calls on the OpenMP team cost in this process so far."""

    calls: int
    """Calls run on the team."""
    late_calls: int
    """Of those, the ones whose close waited 0.2 ms or more for a member the scheduler ran late."""
    late_seconds: float
    """What those closes waited past the caller's last task, in all."""


def set_thread_source(source: str) -> None:
    """``"team"`` (the default) or ``"pool"``, for every later call in this process."""
    global _source
    if source not in _SOURCES:
        raise ConfigError(f"{THREADS_ENV}/thread source {source!r}: expected one of {', '.join(_SOURCES)}")
    lib.ofl_parallel_set_threads(_SOURCES[source])
    _source = source


def thread_source() -> str:
    return _source


def team_found() -> bool:
    """True when this process has the one libgomp whose team main-thread calls run on."""
    return bool(lib.ofl_parallel_team_found())


def team_stats() -> TeamStats:
    out = ffi.new("uint64_t[3]")
    lib.ofl_parallel_team_stats(out)
    return TeamStats(int(out[0]), int(out[1]), out[2] / 1e9)


set_thread_source(os.environ.get(THREADS_ENV, "team").strip().lower() or "team")
