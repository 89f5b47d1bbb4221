"""``offload estimate``'s answer: does each row fit a machine, which change makes a configuration
fit, and what a node daemon must be given for it.

A row fits when its bytes fit each memory: with a GPU, device bytes in the GPU's memory and host
bytes in host memory; without one the model computes on the CPU, so device and host bytes share
host memory (``EstimateRow.process_bytes``). NVMe bytes must fit the free space of the swap path.
The smallest change from a configured row is the fitting row that differs from it in the fewest
of (stage, offload_optimizer, offload_param), then with the least offloading (host memory before
NVMe), then with the fewest bytes held."""
from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile

from offload.plan.budget import available_bytes
from offload.units import format_bytes

__all__ = ["Machine", "Verdict", "answer", "change_text", "daemon_sizes", "machine_here", "nvme_path",
           "smallest_change", "verdict"]

GIB = 1 << 30
_OFFLOAD_RANK = {"none": 0, "cpu": 1, "nvme": 2}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Machine:
    """The memories rows are checked against."""

    host_bytes: int
    """Host memory a trainer can use (available now, or --host-gib)."""
    nvme_bytes: int
    """Free space under the swap path (or --nvme-gib)."""
    gpu: bool = False
    """The model computes on a GPU; False: on the CPU, device and host bytes share host memory."""
    gpu_bytes: int | None = None
    """One GPU's memory (or --gpu-gib); None: not known (device bytes are then not checked)."""
    nvme_path: str = ""
    """Where the NVMe space was measured ("" when given)."""
    ranks: int = 1
    """Ranks on this node, sharing its host memory and NVMe (each with a GPU of its own)."""

    def describe(self) -> str:
        where = f" free under {self.nvme_path}" if self.nvme_path else ""
        gpu = ("GPU of unknown memory (--gpu-gib; device bytes not checked)" if self.gpu_bytes is None
               else f"GPU {format_bytes(self.gpu_bytes)}") if self.gpu else \
            "no GPU (the model computes on the CPU: device and host bytes share host memory)"
        return (f"host {format_bytes(self.host_bytes)}, NVMe {format_bytes(self.nvme_bytes)}{where}, {gpu}; "
                f"{self.ranks} rank(s) on this node share host and NVMe")


@dataclasses.dataclass(frozen=True)
class Verdict:
    fits: bool
    short: tuple[tuple[str, int], ...] = ()
    """(memory, bytes missing) for each memory the row does not fit."""

    def text(self) -> str:
        return "yes" if self.fits else "no: " + ", ".join(f"{what} +{format_bytes(n)}" for what, n in self.short)


def machine_here(*, host_gib: float | None, gpu_gib: float | None, nvme_gib: float | None,
                 nvme_path: str | None, gpu: bool, ranks: int = 1) -> Machine:
    """This machine's memories, each replaced by the figure given for it."""
    gpu_bytes = None
    if gpu_gib is not None:
        gpu_bytes = int(gpu_gib * GIB)
    elif gpu:
        import torch

        gpu_bytes = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    if nvme_gib is not None:
        nvme, where = int(nvme_gib * GIB), ""
    else:
        where = nvme_path or tempfile.gettempdir()
        probe = where
        while not os.path.exists(probe) and os.path.dirname(probe) != probe:
            probe = os.path.dirname(probe)
        nvme = shutil.disk_usage(probe).free
    host = int(host_gib * GIB) if host_gib is not None else (available_bytes() or 0)
    return Machine(host_bytes=host, nvme_bytes=nvme, gpu=gpu or gpu_bytes is not None, gpu_bytes=gpu_bytes,
                   nvme_path=where, ranks=ranks)


def verdict(row, machine: Machine) -> Verdict:
    """Whether ``row`` (an ``EstimateRow``, one rank's bytes) fits ``machine`` with its ranks, and by
    how much it does not."""
    n = machine.ranks  # the rows are per rank
    if not machine.gpu:
        need = [("host", n * row.process_bytes, machine.host_bytes)]
    else:
        need = [("GPU", row.device_bytes, machine.gpu_bytes)] if machine.gpu_bytes is not None else []
        need.append(("host", n * row.host_bytes, machine.host_bytes))
    need.append(("NVMe", n * row.nvme_bytes, machine.nvme_bytes))
    short = tuple((what, have_not - have) for what, have_not, have in need if have_not > have)
    return Verdict(not short, short)


def _key(row) -> tuple[int, str, str]:
    return row.stage, row.optimizer, row.param


def smallest_change(rows, configured, machine: Machine):
    """The fitting row nearest ``configured`` (module docstring), or None when no row fits."""
    def changes(row) -> int:
        return sum(a != b for a, b in zip(_key(row), _key(configured)))

    fitting = [r for r in rows if verdict(r, machine).fits]
    if not fitting:
        return None
    return min(fitting, key=lambda r: (changes(r), _OFFLOAD_RANK[r.optimizer] + _OFFLOAD_RANK[r.param],
                                       r.process_bytes, _key(r)))


def daemon_sizes(row, world_size: int) -> tuple[int, int, int]:
    """(per-session quota, sessions per rank, pool capacity) for ``row`` through a node daemon: each session's
    bytes as the memory plan gives them (``EstimateRow.sessions``: its regions' host bytes, the commit region
    and the undo log, page-rounded); the quota is the larger session's, the pool holds every session of every
    rank (all on one node)."""
    if not row.sessions:
        return 0, 0, 0
    return max(row.sessions), len(row.sessions), sum(row.sessions) * world_size


def change_text(configured, row) -> str:
    """The settings to change from ``configured`` to ``row``."""
    out = []
    if row.stage != configured.stage:
        out.append(f"zero_optimization.stage {row.stage}")
    if row.optimizer != configured.optimizer:
        out.append(f"zero_optimization.offload_optimizer.device {row.optimizer}")
    if row.param != configured.param:
        out.append(f"zero_optimization.offload_param.device {row.param}")
    return ", ".join(out)


def nvme_path(cfg) -> str | None:
    """The config's swap path (where the NVMe space is measured), if any."""
    if cfg is None:
        return None
    return cfg.zero.offload_optimizer.nvme_path or cfg.zero.offload_param.nvme_path


def _name(row) -> str:
    return f"stage {row.stage}, offload_optimizer {row.optimizer}, offload_param {row.param}"


def answer(rows, configured, machine: Machine, world_size: int) -> list[str]:
    """The verdict in words: the configured row's, the smallest change that fits, the daemon's sizes."""
    lines = [""]
    if configured is not None and verdict(configured, machine).fits:
        lines.append(f"the config ({_name(configured)}) fits")
        chosen = configured
    else:
        anchor = configured or min(rows, key=lambda r: (r.process_bytes, r.nvme_bytes))
        chosen = smallest_change(rows, anchor, machine) if configured is not None else \
            smallest_change(rows, rows[0], machine)
        if configured is not None:
            lines.append(f"the config ({_name(configured)}) does not fit: "
                         f"{verdict(configured, machine).text()[4:]} beyond this machine")
        if chosen is None:
            lines.append(f"no row fits; the smallest ({_name(anchor)}) needs "
                         f"{verdict(anchor, machine).text()[4:]}: more memory, more ranks "
                         f"(--world-size), or a smaller model")
        elif configured is not None:
            lines.append(f"the smallest change that fits: {change_text(configured, chosen)} ({_name(chosen)})")
        else:
            lines.append(f"{sum(verdict(r, machine).fits for r in rows)} of {len(rows)} rows fit; "
                         f"the least offloading that fits: {_name(chosen)}")
    quota, sessions, pool = daemon_sizes(chosen, world_size) if chosen is not None else (0, 0, 0)
    if pool:
        lines.append(f"through a node daemon ({_name(chosen)}): sessions.default_quota_bytes >= {quota} "
                     f"({format_bytes(quota)}; {sessions} session(s) per rank), pool.capacity_bytes >= {pool} "
                     f"({format_bytes(pool)}) for {world_size} rank(s) on the node")
    return lines
