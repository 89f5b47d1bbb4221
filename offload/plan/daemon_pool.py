"""A node daemon's pool as the budget of a rank's optimizer state window.

Embedded, the window is sized from the host budget (``offload.plan.budget.window_size``). Through
a daemon without ``offload.host_memory_bytes`` the host memory is the daemon's pool, shared by
every rank and job on the node: ``daemon_window_size`` gives a rank 1/POOL_SHARE of the pool (no
more than is free now) split over the node's ranks, no more than one session may hold, and in it
as many state blocks as fit once the session's quota is packed in whole segments the way
``offload.plan.tier_plan.packed_quota_bytes`` packs it; never fewer than ``buffer_count``.
"""
from __future__ import annotations

import logging
import os
from typing import NamedTuple, Sequence

from csrc import OffloadError
from offload.plan.tier_plan import packed_quota_bytes

logger = logging.getLogger(__name__)

__all__ = ["POOL_ERRORS", "POOL_SHARE", "DaemonPool", "blocks_in_quota", "daemon_window_size", "local_ranks_here",
           "read_pool", "reattached_window"]

POOL_SHARE = 2
"""The ranks of one job take at most 1/POOL_SHARE of the daemon's pool: the rest is for other jobs."""

PAGE = 4096


def _align(n: int) -> int:
    return -(-n // PAGE) * PAGE


def daemon_window_size(block_bytes: Sequence[int], *, floor: int, fixed_bytes: int, largest_region_bytes: int,
                       pool_capacity_bytes: int, pool_free_bytes: int, max_quota_bytes: int, segment_bytes: int,
                       local_ranks: int) -> tuple[int, int]:
    """(window, budget in bytes): how many of ``block_bytes`` (page-rounded state blocks) a rank holds.

    ``fixed_bytes``: what the session holds anyway (grads, commit region). The budget is
    min(pool / POOL_SHARE, free) / local_ranks, capped at ``max_quota_bytes``; the window is the
    largest count of the largest blocks whose packed quota (``packed_quota_bytes`` of
    ``fixed_bytes`` + the blocks, in ``segment_bytes`` segments) fits in it, at least ``floor``
    and at most the number of blocks (a floor above that stays: the caller's buffer_count)."""
    if not block_bytes:
        return floor, 0
    budget = rank_budget_bytes(pool_capacity_bytes=pool_capacity_bytes, pool_free_bytes=pool_free_bytes,
                               max_quota_bytes=max_quota_bytes, local_ranks=local_ranks)
    return max(floor, blocks_in_quota(block_bytes, fixed_bytes=fixed_bytes, largest_region_bytes=largest_region_bytes,
                                      segment_bytes=segment_bytes, quota_bytes=budget)), budget


def rank_budget_bytes(*, pool_capacity_bytes: int, pool_free_bytes: int, max_quota_bytes: int, local_ranks: int) -> int:
    """What one rank's session may hold of the pool: min(pool / POOL_SHARE, free) / local_ranks, capped at
    ``max_quota_bytes`` (0: no cap)."""
    budget = min(pool_capacity_bytes // POOL_SHARE, max(0, pool_free_bytes)) // max(1, local_ranks)
    return min(budget, max_quota_bytes) if max_quota_bytes > 0 else budget


class DaemonPool(NamedTuple):
    """A daemon's pool as its STATUS gave it, in bytes."""

    capacity_bytes: int
    used_bytes: int
    segment_bytes: int
    max_quota_bytes: int

    def rank_budget_bytes(self, local_ranks: int) -> int:
        return rank_budget_bytes(pool_capacity_bytes=self.capacity_bytes,
                                 pool_free_bytes=self.capacity_bytes - self.used_bytes,
                                 max_quota_bytes=self.max_quota_bytes, local_ranks=local_ranks)

    def window(self, block_bytes: Sequence[int], *, floor: int, fixed_bytes: int, largest_region_bytes: int,
               local_ranks: int) -> tuple[int, int]:
        """``daemon_window_size`` in this pool."""
        return daemon_window_size(block_bytes, floor=floor, fixed_bytes=fixed_bytes,
                                  largest_region_bytes=largest_region_bytes, pool_capacity_bytes=self.capacity_bytes,
                                  pool_free_bytes=self.capacity_bytes - self.used_bytes,
                                  max_quota_bytes=self.max_quota_bytes, segment_bytes=self.segment_bytes,
                                  local_ranks=local_ranks)

    def describe(self) -> str:
        return (f"a pool of {self.capacity_bytes / 1e9:.2f} GB ({(self.capacity_bytes - self.used_bytes) / 1e9:.2f} "
                f"GB free) in {self.segment_bytes >> 20} MiB segments")


def read_pool(socket_path: str) -> DaemonPool:
    """The pool of the daemon at ``socket_path``, from STATUS (raises what the client raises, or KeyError,
    TypeError, ValueError for an answer without it: ``POOL_ERRORS``)."""
    from daemon.client import daemon_status

    pool = daemon_status(socket_path)["pool"]
    return DaemonPool(int(pool["capacity_bytes"]), int(pool["used_bytes"]), int(pool["segment_bytes"]),
                      int(pool["max_quota_bytes"]))


POOL_ERRORS = (OSError, OffloadError, KeyError, TypeError, ValueError)


def local_ranks_here() -> int:
    """The job's ranks on this node (LOCAL_WORLD_SIZE), sharing the daemon's pool."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))


def blocks_in_quota(block_bytes: Sequence[int], *, fixed_bytes: int, largest_region_bytes: int, segment_bytes: int,
                    quota_bytes: int) -> int:
    """How many of the largest ``block_bytes`` a session of ``quota_bytes`` holds beside ``fixed_bytes``,
    its regions packed in ``segment_bytes`` segments as ``packed_quota_bytes`` packs them."""
    fit, held = 0, fixed_bytes
    for b in sorted(block_bytes, reverse=True):
        held += b
        if packed_quota_bytes(_align(held), largest_region_bytes, segment_bytes) > quota_bytes:
            break
        fit += 1
    return fit


def reattached_window(store: object, block_bytes: Sequence[int], window: int, *, floor: int, fixed_bytes: int,
                      largest_region_bytes: int) -> int:
    """A reattached session keeps the quota it was opened with: no larger window than that holds
    (the pool may have more room now than when it was opened)."""
    if not getattr(store, "reattached", False):
        return window
    held = blocks_in_quota(block_bytes, fixed_bytes=fixed_bytes, largest_region_bytes=largest_region_bytes,
                           segment_bytes=store.segment_bytes, quota_bytes=store.quota_bytes)
    if held < window:
        logger.info("optimizer state window: %d (the reattached session's quota of %d bytes holds no more)",
                    max(floor, held), store.quota_bytes)
    return min(window, max(floor, held))


