"""The optimizer state window of a rank whose tier is a node daemon session.

Embedded, the window is sized from the host budget (``offload.zero.window.window_size``). Through
a daemon without ``offload.host_memory_bytes`` the host memory is the daemon's pool, shared by
every rank and job on the node: ``daemon_window_size`` gives a rank 1/POOL_SHARE of the pool (no
more than is free now) split over the node's ranks, no more than one session may hold, and in it
as many state blocks as fit once the session's quota is packed in whole segments the way
``offload.tiers.packed_quota_bytes`` packs it; never fewer than ``buffer_count``.
"""
from __future__ import annotations

import logging
import os
from typing import Any, NamedTuple, Sequence

from csrc import OffloadError
from offload.tiers import packed_quota_bytes

logger = logging.getLogger(__name__)

__all__ = ["POOL_ERRORS", "POOL_SHARE", "DaemonPool", "blocks_in_quota", "daemon_budget_bytes", "daemon_state_window",
           "daemon_window_size", "read_pool", "reattached_window", "session_terms"]

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


def session_terms(plan: Any) -> dict[str, int]:
    """What a daemon session of ``plan`` (``offload.tiers.TierPlan``, window 0) holds besides its window's
    blocks, and its largest region: the ``fixed_bytes`` and ``largest_region_bytes`` of the window rules."""
    from offload.resume import session_fixed_bytes

    return {"fixed_bytes": plan.resident_bytes + session_fixed_bytes(plan),
            "largest_region_bytes": max(plan.region_bytes, default=0)}


def _local_ranks() -> int:
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))


def daemon_budget_bytes(socket_path: str) -> tuple[int | None, str]:
    """The host memory a rank may hold in the daemon at ``socket_path`` (``rank_budget_bytes`` of its pool
    now), and where that figure came from; None where the daemon does not say."""
    try:
        pool = read_pool(socket_path)
    except POOL_ERRORS as exc:
        return None, f"nothing (the daemon's pool could not be read: {exc})"
    ranks = _local_ranks()
    where = f"1/{POOL_SHARE} of the daemon's pool" + (f" over {ranks} ranks" if ranks > 1 else "")
    return pool.rank_budget_bytes(ranks), where


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


def daemon_state_window(socket_path: str, block_bytes: Sequence[int], *, floor: int, fixed_bytes: int,
                        largest_region_bytes: int, what: str = "optimizer state") -> int:
    """Ask the daemon at ``socket_path`` (STATUS) for its pool and size the window with
    ``daemon_window_size`` over LOCAL_WORLD_SIZE ranks; ``floor`` where the daemon does not say.
    Logged once per call."""
    try:
        pool = read_pool(socket_path)
    except POOL_ERRORS as exc:
        logger.info("%s window: %d (buffer_count; the daemon's pool could not be read: %s)", what, floor, exc)
        return floor
    ranks = _local_ranks()
    size, budget = pool.window(block_bytes, floor=floor, fixed_bytes=fixed_bytes,
                               largest_region_bytes=largest_region_bytes, local_ranks=ranks)
    logger.info("%s window: %d of %d blocks in host memory (buffer_count %d; budget %.2f GB: 1/%d of the daemon's "
                "%s, over %d ranks)", what, min(size, len(block_bytes)), len(block_bytes), floor, budget / 1e9,
                POOL_SHARE, pool.describe(), ranks)
    return size
