"""Give the host heap's free pages back to the kernel at optimizer steps where memory has crept.

[Note: host heap creep] glibc's malloc raises its mmap threshold (up to 32 MiB) the first time
a large mmap'd block is freed; from then on, tensors below it come from the heap, where the
engine's per-step pattern (autograd's weight gradients landed and freed during backward, stage
3's gathers and unit gradient buffers) leaves holes that the next step's differently ordered
requests do not fit. ``malloc_trim(0)`` hands every free page back (inside the heap too, not only
its top). A trim is not free (the pages it drops are faulted in again by the next step), so
``HeapTrimmer`` trims after the first step (the start-up's garbage) and then only when resident
memory at a step boundary has grown 64 MiB past where it settled after the last trim: the creep
stays bounded by the slack, and a run whose heap does not creep never pays. Fixing the mmap
threshold instead also stops the creep but makes every large tensor a fresh mmap and its pages
fresh faults. Other C libraries have no ``malloc_trim``; there this is a no-op.

``tools/bench/bench_host_heap.py --steps 120`` (a 28M-parameter GPT on the CPU, stage 1, offload
cpu; results in tools/bench/results/host-heap_2core-epyc_202611.md): resident memory grows by
303 MiB over steps 10-120 without the trim, by 68 MiB with it (11 trims of ~8 ms; step time
1.01x), and by 80 MiB for plain torch with its AdamW; the fixed threshold holds it at +7 MiB but
steps are 1.14x slower.
"""
from __future__ import annotations

import functools
import logging
import os

import cffi

logger = logging.getLogger(__name__)

__all__ = ["HeapTrimmer", "release_free_heap", "resident_bytes"]

MIB = 1 << 20


@functools.cache
def _libc():
    ffi = cffi.FFI()
    ffi.cdef("int malloc_trim(size_t pad);")
    lib = ffi.dlopen(None)
    try:
        lib.malloc_trim  # noqa: B018 - resolve the symbol now: absent outside glibc
    except AttributeError:
        logger.info("this C library has no malloc_trim: the host heap is not trimmed at steps")
        return None
    return lib


def release_free_heap() -> bool:
    """Return the heap's free pages to the kernel; True if the C library could (glibc)."""
    lib = _libc()
    if lib is None:
        return False
    lib.malloc_trim(0)
    return True


def resident_bytes() -> int:
    """This process's resident set (VmRSS), from /proc/self/statm."""
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_resident_bytes() -> int:
    """This process's peak resident set (VmHWM, from /proc/self/status) since it started or the last reset."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")


def reset_peak_resident() -> int:
    """Set the peak resident set to the current one (Linux's /proc/self/clear_refs); returns it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return resident_bytes()


class HeapTrimmer:
    """Trims the heap at step boundaries when resident memory has crept ([Note: host heap creep])."""

    def __init__(self, *, slack_bytes: int = 64 * MIB) -> None:
        self.slack_bytes = slack_bytes
        self._settled: int | None = None
        self._trim_next = True  # the first boundary: what start-up left behind
        self.trims = 0
        """Trims done so far."""

    def after_step(self) -> bool:
        """At a step boundary; True if it trimmed."""
        rss = resident_bytes()
        if not self._trim_next:
            if self._settled is None:
                self._settled = rss  # the first boundary after a trim: the pages the step needs are back
                return False
            if rss <= self._settled + self.slack_bytes:
                return False
        if not release_free_heap():
            return False
        self.trims += 1
        self._trim_next = False
        self._settled = None
        logger.debug("host heap trimmed at %d MiB resident", rss // MIB)
        return True
