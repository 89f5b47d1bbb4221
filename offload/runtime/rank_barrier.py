"""A barrier with a time limit, for the points where a rank must know that every other one got there."""
from __future__ import annotations

import datetime
import logging
from typing import Any

import torch.distributed as dist

logger = logging.getLogger(__name__)

__all__ = ["CLOSE_WAIT_SECONDS", "every_rank_reached"]

CLOSE_WAIT_SECONDS = 60.0
"""How long ``Engine.close`` waits for every rank to reach it before keeping its daemon session."""


def every_rank_reached(what: str, group: Any, world_size: int, *, rank: int, timeout_seconds: float) -> bool:
    """Whether every rank of ``group`` reached ``what`` within ``timeout_seconds`` (gloo's monitored barrier).

    ``Engine.close`` asks before it drops its daemon session: a rank killed after its last commit and before
    its close is restarted by torchrun with the others, and were their sessions dropped they would start
    fresh beside it and the state be torn; so they keep theirs for the restart (within the daemon's
    reattach grace) when one is missing. True without asking for one rank, no process group, or NCCL
    (it has no barrier with a time limit: a rank that never closes would hang the rest)."""
    if world_size == 1 or not dist.is_initialized() or dist.get_backend(group) != "gloo":
        return True
    try:
        dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=timeout_seconds))
        return True
    except RuntimeError as exc:
        logger.warning("rank %d: not every rank reached %s (%s); this rank's session is kept for a restart within "
                       "the daemon's reattach grace", rank, what, str(exc).splitlines()[0][:200])
        return False
