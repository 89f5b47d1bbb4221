"""How many threads a rank's CPU work may use: the cores it can really run on.

[Note: threads per rank] A pool sized to every core of the node is a bad neighbour: with two ranks
on two cores each rank's CPU Adam ran two threads (four on two cores), and a worker that shares
its core with another rank's, a data loader or torch's OpenMP team waits to be scheduled while
the others wait for its chunk. So a rank's share is
- the CPUs its affinity allows (``os.sched_getaffinity``: ``taskset``, a cpuset, a launcher's
  binding),
- at most the cgroup's CPU quota, rounded up (``cpu.max`` in cgroup v2, ``cpu.cfs_quota_us`` /
  ``cpu.cfs_period_us`` in v1, along the process's own cgroup path and its parents),
- divided among the ranks of this node (``LOCAL_WORLD_SIZE``, as torchrun sets it) when the
  affinity is the whole machine's: ranks that a launcher pinned to their own cores already see
  only those,
and at least one. ``OFL_NUM_THREADS`` overrides it all (a positive int).
"""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path

from csrc import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["cgroup_cpu_limit", "usable_cores"]

ENV_OVERRIDE = "OFL_NUM_THREADS"


def _v2_limit(text: str) -> float | None:
    quota, _, period = text.strip().partition(" ")
    if quota == "max" or not period:
        return None
    return int(quota) / int(period)


def _v1_limit(quota_text: str, period_text: str) -> float | None:
    quota, period = int(quota_text.strip()), int(period_text.strip())
    return None if quota <= 0 or period <= 0 else quota / period


def _cgroup_paths(proc_cgroup: str) -> tuple[str | None, str | None]:
    """(the v2 path, the v1 ``cpu`` controller's path) of this process, from /proc/self/cgroup's text."""
    v2 = v1 = None
    for line in proc_cgroup.splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    return v2, v1


def _ancestors(path: str) -> list[str]:
    parts = [p for p in path.split("/") if p]
    return ["/".join(parts[:i]) for i in range(len(parts), -1, -1)]


def cgroup_cpu_limit(root: str | os.PathLike = "/sys/fs/cgroup", proc_cgroup: str | None = None) -> float | None:
    """The CPUs this process's cgroup quota allows (a fraction of CPUs: 1.5 is 150 ms per 100 ms), the
    tightest along its path; None when no quota applies or nothing can be read."""
    root = Path(root)
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    v2, v1 = _cgroup_paths(proc_cgroup)
    limits: list[float] = []
    for rel in _ancestors(v2) if v2 is not None else []:
        try:
            limit = _v2_limit((root / rel / "cpu.max").read_text())
        except (OSError, ValueError):
            continue
        if limit is not None:
            limits.append(limit)
    if v1 is not None and not limits:
        for base in (root / "cpu", root / "cpu,cpuacct"):
            for rel in _ancestors(v1):
                try:
                    limit = _v1_limit((base / rel / "cpu.cfs_quota_us").read_text(),
                                      (base / rel / "cpu.cfs_period_us").read_text())
                except (OSError, ValueError):
                    continue
                if limit is not None:
                    limits.append(limit)
    return min(limits) if limits else None


_OWN: dict[int, float | None] = {}


def _own_limit() -> float | None:
    """This process's quota, read once per process (the hot paths ask at every call)."""
    pid = os.getpid()
    if pid not in _OWN:
        _OWN.clear()
        _OWN[pid] = cgroup_cpu_limit()
    return _OWN[pid]


def usable_cores(*, environ: dict | None = None, cgroup_root: str | os.PathLike = "/sys/fs/cgroup",
                 proc_cgroup: str | None = None) -> int:
    """The threads this rank's CPU work should use ([Note: threads per rank])."""
    env = os.environ if environ is None else environ
    override = env.get(ENV_OVERRIDE)
    if override:
        try:
            n = int(override)
        except ValueError:
            n = 0
        if n < 1:
            raise ConfigError(f"{ENV_OVERRIDE} must be a positive int, got {override!r}")
        return n
    allowed = len(os.sched_getaffinity(0))
    cores = allowed
    if proc_cgroup is None and str(cgroup_root) == "/sys/fs/cgroup":
        limit = _own_limit()
    else:
        limit = cgroup_cpu_limit(cgroup_root, proc_cgroup)
    if limit is not None:
        cores = min(cores, max(1, math.ceil(limit - 1e-9)))
    try:
        local = int(env.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        local = 1
    if local > 1 and allowed >= (os.cpu_count() or allowed):  # not pinned: the ranks share these cores
        cores = cores // local
    return max(1, cores)
