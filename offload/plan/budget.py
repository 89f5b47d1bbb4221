"""The host memory a rank's offloaded state may take, and how many of the largest blocks fit in it.

The budget is the offload section's ``host_memory_bytes``, or else 1/FREE_SHARE of the memory the
machine has available now (MemAvailable), split evenly over the node's ranks. Through a node daemon
without ``host_memory_bytes`` it is the rank's share of the daemon's pool instead
(``offload.plan.daemon_pool``). ``offload estimate --host-gib`` asks about another machine: it passes
that machine's memory as ``available`` and its ranks as ``local_ranks``, so no figure comes from this one.
"""
from __future__ import annotations

import logging
import os
from typing import Sequence

logger = logging.getLogger(__name__)

__all__ = ["FREE_SHARE", "available_bytes", "budget_bytes", "window_size"]

FREE_SHARE = 2
"""Without a configured budget the window takes at most 1/FREE_SHARE of the memory the
machine has available (MemAvailable), split evenly over the ranks on the node."""


def available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo in bytes, or None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def budget_bytes(host_memory_bytes: int | None, *, available: int | None = None,
                 local_ranks: int | None = None) -> tuple[int | None, str]:
    """The host memory a rank's offloaded state may take, and where that figure came from: the offload
    section's ``host_memory_bytes``, or 1/FREE_SHARE of the memory available split over the node's ranks;
    None where neither is known. ``available``: that memory in bytes (None: this machine's now,
    ``available_bytes``); ``local_ranks``: the ranks (None: LOCAL_WORLD_SIZE)."""
    if host_memory_bytes is not None:
        return host_memory_bytes, "offload.host_memory_bytes"
    free = available_bytes() if available is None else available
    if free is None:
        return None, "nothing"
    ranks = max(1, local_ranks if local_ranks is not None else int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    source = (f"1/{FREE_SHARE} of the {'available' if available is None else 'given host'} memory"
              + (f" over {ranks} ranks" if ranks > 1 else ""))
    return free // FREE_SHARE // ranks, source


def window_size(block_bytes: Sequence[int], *, floor: int, fixed_bytes: int, host_memory_bytes: int | None,
                what: str, log: bool = True, available: int | None = None, local_ranks: int | None = None) -> int:
    """How many of ``block_bytes`` (page-rounded sizes of the items) the window holds.

    The budget is ``host_memory_bytes`` (the offload section's) less ``fixed_bytes`` (what
    stays resident anyway: the gradient accumulators), or else 1/FREE_SHARE of the memory
    available now, split over the node's ranks (LOCAL_WORLD_SIZE). As many of the largest
    blocks as fit in it, never fewer than ``floor`` (DeepSpeed's ``buffer_count``) nor more
    than there are blocks: a window that holds every block still writes each back after its
    step and prefetches it while backward runs, but never waits for one evict to make room
    for the next prefetch. Logged once per call (``log``: the estimate, which asks per row, does not).
    ``available``, ``local_ranks``: as ``budget_bytes`` takes them."""
    count = len(block_bytes)
    if count == 0:
        return floor
    budget, source = budget_bytes(host_memory_bytes, available=available, local_ranks=local_ranks)
    if budget is None:
        if log:
            logger.info("%s window: %d (buffer_count; the free memory could not be read)", what, floor)
        return floor
    budget -= fixed_bytes
    fit, used = 0, 0
    for b in sorted(block_bytes, reverse=True):
        if used + b > budget:
            break
        used += b
        fit += 1
    size = max(floor, fit)
    if log:
        logger.info("%s window: %d of %d blocks in host memory (buffer_count %d; budget %.2f GB from %s)",
                    what, min(size, count), count, floor, max(0, budget) / 1e9, source)
    return size
