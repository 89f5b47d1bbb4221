"""How torch's idle OpenMP threads wait: a short spin, then asleep, so that a shared node's other work runs.

[Note: OpenMP waits]
torch's CPU kernels run on an OpenMP team (GNU libgomp in the x86 wheels). At the barrier that ends each
parallel region, and in the pool between regions, a libgomp thread spins before it sleeps on a futex:
300,000 pauses by default, milliseconds of a core. On a quiet node that saves a wake-up. On a shared one
it is the step's undoing: the main thread, descheduled by a neighbour, is what the spinning worker waits
for, and the worker holds one of the cores it needs. Config c of the contention bench under two busy
loops: forward 0.70 -> 1.8-2.1 s, backward 1.4 -> 4.1 s, and the process's CPU time grows by half again
(the spin), where ``OMP_WAIT_POLICY=PASSIVE`` gives 1.32 s and 2.59 s.

That variable is read once, when libgomp loads with ``import torch``: before any of the engine's code runs
in a user's script. But libgomp has a second rule, read at every wait (``do_spin`` in
``libgomp/config/linux/wait.h``): while it manages more threads than the process had CPUs at start
(``gomp_managed_threads > gomp_available_cpus``), it spins only ``gomp_throttled_spin_count_var`` times,
100 by default, as it should when the CPUs are oversubscribed. So the engine starts one OpenMP team of its
own, from a thread that then blocks until the team is let go: its docked workers sleep on a futex and
cost no CPU, and they count as managed threads, so every wait of torch's team becomes the short spin.
A team started by a thread other than the first adds its size less one to the count, which starts at 1
and holds torch's team (``torch_threads - 1``); so ``cpus - torch_threads + 2`` threads tip it over.

Measured on the 2-vCPU EPYC (``contention_sections.py torch c --omp-waits spin|sleep``, results in
``tools/bench/results/contention-omp_2core-epyc_202611.md``): under two busy loops plain torch's forward of
the bench's GPT 1.67-1.69 -> 1.21-1.30 s and backward 3.34 -> 2.42-2.57 s (PASSIVE: 1.21 / 2.46); quiet,
one pair, 0.62 -> 0.66 s forward and 1.22 -> 1.27 s backward.

The throttle is not free where torch's ops are tiny: a sleeping worker is woken by a futex at every
region, tens of microseconds in this VM, so torch's fused AdamW over 100 tensors of 1e4 ran 4x slower with
the team held on a quiet machine (``bench_adam.py --omp-waits``). So the team is held only while the node
is contended: a watcher reads, every 0.25 s, how long the thread that called ``initialize`` waited for a
CPU while runnable (``run_delay`` in ``/proc/self/task/<tid>/schedstat``). A tenth of the interval or more
starts the team; under 2% for 2 s in a row ends it (its thread exits, libgomp frees the pool and lowers
its count), and torch's workers spin again.

With CPU Adam on torch's own team ([Note: one thread team] in csrc/ofl_parallel.h) the watcher was measured
again (``tools/bench/results/adam-one-team_2core-epyc_202611.md``, section 4): under two busy loops configs a
and c took 5.0 s a step with it against 7.3-7.5 s without (libgomp's own waits); on the quiet machine it held
the team in none of the runs. It stays.

``OFL_OMP_WAIT``: ``auto`` (the watcher, default; where the kernel keeps no run delay it never holds the
team, libgomp's default), ``sleep`` (the team held for good), ``spin`` (never).
Left alone too when the user chose (``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` set), and where it cannot
matter: torch runs one intra-op thread (no team waits), or no libgomp is loaded (another OpenMP runtime,
whose rules these are not).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time

import cffi
import torch

from csrc import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["ContentionSwitch", "WaitWatchConfig", "helper_active", "helper_team_size", "loaded_libgomp",
           "quiet_omp_waits"]

USER_KNOBS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
ENV_MODE = "OFL_OMP_WAIT"
MODES = ("auto", "sleep", "spin")

_ffi = cffi.FFI()
_ffi.cdef("void GOMP_parallel(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags);")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WaitWatchConfig:
    """When the watcher holds the helper team ([Note: OpenMP waits])."""

    interval_seconds: float = 0.25
    """How often the watched thread's run delay is read."""
    on_delay_share: float = 0.10
    """An interval in which the thread waited this share of it for a CPU starts the team."""
    off_delay_share: float = 0.02
    """Intervals under this share count towards ending it."""
    off_intervals: int = 8
    """That many such intervals in a row end it."""

    def __post_init__(self) -> None:
        if self.interval_seconds <= 0:
            raise ValueError(f"interval_seconds must be > 0, got {self.interval_seconds}")
        if not 0 <= self.off_delay_share <= self.on_delay_share <= 1:
            raise ValueError(f"need 0 <= off_delay_share <= on_delay_share <= 1, got {self.off_delay_share}, "
                             f"{self.on_delay_share}")
        if self.off_intervals < 1:
            raise ValueError(f"off_intervals must be >= 1, got {self.off_intervals}")


class ContentionSwitch:
    """On when a thread waits for CPUs, off once it has not for a while: fed each interval's wall time and the
    thread's run delay over it."""

    def __init__(self, config: WaitWatchConfig) -> None:
        self._config = config
        self._calm = 0
        self.on = False

    def update(self, wall_seconds: float, delay_seconds: float) -> bool:
        share = delay_seconds / wall_seconds if wall_seconds > 0 else 0.0
        if share >= self._config.on_delay_share:
            self.on, self._calm = True, 0
        elif self.on:
            self._calm = self._calm + 1 if share < self._config.off_delay_share else 0
            if self._calm >= self._config.off_intervals:
                self.on, self._calm = False, 0
        return self.on


def helper_team_size(cpus: int, torch_threads: int, environ: dict | None = None, mode: str | None = None) -> int:
    """The OpenMP team to start so that libgomp throttles its spins ([Note: OpenMP waits]); 0 for none.
    ``mode``: one of MODES, default ``OFL_OMP_WAIT``'s."""
    env = os.environ if environ is None else environ
    if any(env.get(k) for k in USER_KNOBS) or (mode or _mode(env)) == "spin":
        return 0
    if torch_threads < 2:
        return 0
    return max(2, cpus - torch_threads + 2)


def _mode(env) -> str:
    mode = (env.get(ENV_MODE) or "auto").strip().lower()
    if mode not in MODES:
        raise ConfigError(f"{ENV_MODE} must be one of {', '.join(MODES)}, got {env.get(ENV_MODE)!r}")
    return mode


def loaded_libgomp(maps_path: str = "/proc/self/maps") -> str | None:
    """The path of the one libgomp this process has loaded; None when it has none, or two (which one torch
    uses is then not known)."""
    try:
        with open(maps_path) as f:
            paths = {line.split(None, 5)[-1].strip() for line in f if "libgomp" in line}
    except OSError:
        return None
    paths = {p for p in paths if os.path.basename(p).startswith("libgomp")}
    return paths.pop() if len(paths) == 1 else None


@functools.cache
def _empty_region():
    return _ffi.callback("void(void *)", lambda _data: None)


class _HelperTeam:
    """The idle OpenMP team: held by a thread of its own from ``hold()`` until ``release()``."""

    def __init__(self, lib, size: int) -> None:
        self._lib, self.size = lib, size
        self._thread: threading.Thread | None = None
        self._release = threading.Event()

    @property
    def held(self) -> bool:
        return self._thread is not None

    def hold(self) -> None:
        if self._thread is not None:
            return
        started = threading.Event()
        self._release.clear()
        self._thread = threading.Thread(target=self._run, args=(started,), name="ofl-omp-team", daemon=True)
        self._thread.start()
        started.wait()

    def release(self) -> None:
        if self._thread is None:
            return
        self._release.set()
        self._thread.join()  # the thread's exit frees its pool: libgomp's count falls back
        self._thread = None

    def _run(self, started: threading.Event) -> None:
        self._lib.GOMP_parallel(_empty_region(), _ffi.NULL, self.size, 0)  # returns once every member ran it
        started.set()
        self._release.wait()


def _run_delay_seconds(tid: int) -> float | None:
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def _watch(team: _HelperTeam, tid: int, config: WaitWatchConfig) -> None:
    switch = ContentionSwitch(config)
    wall, delay = time.monotonic(), _run_delay_seconds(tid)
    if delay is None:
        logger.info("no run delay in /proc/self/task/%d/schedstat: torch's OpenMP waits stay libgomp's default "
                    "(OFL_OMP_WAIT=sleep shortens them always)", tid)
    while delay is not None:
        time.sleep(config.interval_seconds)
        now, later = time.monotonic(), _run_delay_seconds(tid)
        if later is None:  # the watched thread has ended
            break
        if switch.update(now - wall, later - delay):
            team.hold()
        else:
            team.release()
        wall, delay = now, later
    team.release()


_lock = threading.Lock()
_team: _HelperTeam | None = None
_pid: int | None = None  # the process that decided: a forked child has no helper or watcher thread


def helper_active() -> bool:
    """Whether the helper team is held now (under ``auto``: whether the node is contended)."""
    return _team is not None and _pid == os.getpid() and _team.held


def quiet_omp_waits(config: WaitWatchConfig | None = None, mode: str | None = None) -> int:
    """Set up torch's OpenMP waits for this process once ([Note: OpenMP waits]): the helper team held for good
    (``sleep``) or while the calling thread waits for CPUs (``auto``). ``mode`` (a bench's choice) overrides
    ``OFL_OMP_WAIT``. Returns the team's size, 0 for none."""
    global _team, _pid
    with _lock:
        if _pid == os.getpid():
            return _team.size if _team is not None else 0
        _pid, _team = os.getpid(), None
        mode = _mode({ENV_MODE: mode} if mode is not None else os.environ)
        size = helper_team_size(len(os.sched_getaffinity(0)), torch.get_num_threads(), mode=mode)
        path = loaded_libgomp() if size else None
        if path is None:
            if size:
                logger.debug("torch's OpenMP waits left as they are: no single libgomp is loaded")
            return 0
        team = _HelperTeam(_ffi.dlopen(path), size)  # dlopen of a loaded library: the one torch runs on
        if mode == "sleep":
            team.hold()
        else:
            config = config or WaitWatchConfig()
            threading.Thread(target=_watch, args=(team, threading.get_native_id(), config), name="ofl-omp-watch",
                             daemon=True).start()
        _team = team
        logger.debug("torch's OpenMP waits: %s, a helper team of %d threads", mode, size)
        return size
