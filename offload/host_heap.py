"""Give the host heap's free pages back to the kernel at each optimizer step.

[Note: host heap creep] glibc's malloc raises its mmap threshold (up to 32 MiB) the first time
a large mmap'd block is freed; from then on, tensors below it come from the heap, where the
engine's per-step pattern (autograd's weight gradients landed and freed during backward, stage
3's gathers and unit gradient buffers) leaves holes that the next step's differently ordered
requests do not fit. Measured on a 28M-parameter GPT trained on the CPU, stage 1: resident
memory grew from 1.17 to 1.59 GiB over 120 steps while the live tensors stayed the same; plain
torch with torch's AdamW stayed flat. ``malloc_trim(0)`` after the step hands every free page
back (inside the heap too, not only its top), so the next step starts from what is live: the
same run stays at 1.16 GiB, at no measurable cost to the step. Fixing the mmap threshold instead
also stops the creep but makes every large tensor a fresh mmap and its pages fresh faults:
60% slower steps on the CPU. Other C libraries have no ``malloc_trim``; there this is a no-op.
"""
from __future__ import annotations

import functools
import logging

import cffi

logger = logging.getLogger(__name__)

__all__ = ["release_free_heap"]


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
