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
own, from a thread that then sleeps for the life of the process: its docked workers sleep on a futex and
cost no CPU, and they count as managed threads, so every wait of torch's team becomes the short spin.
A team started by a thread other than the first adds its size less one to the count, which starts at 1
and holds torch's team (``torch_threads - 1``); so ``cpus - torch_threads + 2`` threads tip it over.

Measured on the 2-vCPU EPYC (``tools/bench/results/contention-omp_2core-epyc_202611.md``): under two busy
loops plain torch's forward of the bench's GPT 2.08 -> 1.29 s and backward 4.20 -> 2.56 s (PASSIVE:
1.38 / 2.70); quiet, no cost (0.69 -> 0.67 s forward, medians of 6).

Left alone when the user chose: ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` set, or ``OFL_OMP_SPIN=1``; and
where it cannot matter: torch runs one intra-op thread (no team waits), or no libgomp is loaded (another
OpenMP runtime, whose rules these are not).
"""
from __future__ import annotations

import functools
import logging
import os
import threading

import cffi
import torch

logger = logging.getLogger(__name__)

__all__ = ["helper_team_size", "loaded_libgomp", "quiet_omp_waits"]

USER_KNOBS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
ENV_KEEP_SPIN = "OFL_OMP_SPIN"

_lock = threading.Lock()
_started: int | None = None  # the helper team's size once started (0: decided to start none)
_pid: int | None = None  # the process that decided: a forked child has no helper thread
_ffi = cffi.FFI()
_ffi.cdef("void GOMP_parallel(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags);")


def helper_team_size(cpus: int, torch_threads: int, environ: dict | None = None) -> int:
    """The OpenMP team to start so that libgomp throttles its spins ([Note: OpenMP waits]); 0 for none."""
    env = os.environ if environ is None else environ
    if any(env.get(k) for k in USER_KNOBS) or env.get(ENV_KEEP_SPIN, "") not in ("", "0"):
        return 0
    if torch_threads < 2:
        return 0
    return max(2, cpus - torch_threads + 2)


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


def _hold_team(lib, size: int, started: threading.Event, forever: threading.Event) -> None:
    lib.GOMP_parallel(_empty_region(), _ffi.NULL, size, 0)  # returns when every member has run the region
    started.set()
    forever.wait()  # the pool lives as long as this thread does


def quiet_omp_waits() -> int:
    """Start the helper team once per process ([Note: OpenMP waits]); returns its size, 0 when none."""
    global _started, _pid
    with _lock:
        if _started is not None and _pid == os.getpid():
            return _started
        _pid, _started = os.getpid(), 0
        size = helper_team_size(len(os.sched_getaffinity(0)), torch.get_num_threads())
        path = loaded_libgomp() if size else None
        if path is None:
            if size:
                logger.debug("torch's OpenMP waits left as they are: no single libgomp is loaded")
            return 0
        lib = _ffi.dlopen(path)  # already loaded: the same library torch's kernels run on
        started, forever = threading.Event(), threading.Event()
        threading.Thread(target=_hold_team, args=(lib, size, started, forever), name="ofl-omp-quiet",
                         daemon=True).start()
        started.wait()
        _started = size
        logger.debug("torch's OpenMP waits throttled: a helper team of %d threads", size)
        return size
