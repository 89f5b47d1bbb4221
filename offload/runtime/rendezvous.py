"""The ranks of one attempt of a torchrun job meet on a store namespace of their own.

[Note: attempt generation] torchrun's agents share one TCP store for the whole job (its c10d rendezvous
keeps the store server of round 0 for every later round), so the keys of an attempt that died are still
there when torchrun starts the group again: a fast rank read the dead attempt's peer addresses before the
slow one overwrote them, and gloo gave up connecting to a dead port. Keys under a per-attempt prefix avoid
that, but ``TORCHELASTIC_RESTART_COUNT`` cannot name the attempt: it counts the restarts of *this node's*
agent, and when a rank is lost on one node only that agent spends a restart (the others restart their
workers for the new round without counting one), so two nodes would use two prefixes and wait for each
other forever. So the ranks agree on a generation through the store itself:

- rank 0 takes the next generation, ``add(GEN, 1)``, and waits for the other ``world - 1`` ranks to join it;
  then it says ``go``;
- every other rank reads the generation and joins it, ``add(<gen>/joined, 1)``. A generation whose count
  is already full is a finished attempt's (its rank 0 is gone): the rank waits for the next one. A rank
  that joined a dead attempt's generation (read before the new rank 0 took its own) sees no ``go`` there,
  and joins the new generation once it appears;
- the process group is formed under the prefix of the generation every rank joined.

Every wait is bounded, and the error names what the rank waited for.
"""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch.distributed as dist

from csrc.errors import RendezvousError

__all__ = ["GENERATION_KEY", "AttemptStore", "attempt_store", "open_job_store"]

GENERATION_KEY = "offload/generation"
_POLL_SECONDS = 0.02


@dataclass(frozen=True)
class AttemptStore:
    """The store namespace of this attempt (``offload/gen<N>/``) and its generation ``N``."""
    store: dist.PrefixStore
    generation: int


def _prefix(generation: int) -> str:
    return f"offload/gen{generation}"


def open_job_store(host: str, port: int, world_size: int, *, rank: int, agent_store: bool,
                   timeout_seconds: float) -> dist.TCPStore:
    """The job's TCP store at ``host:port``: torchrun's agent store (a client of it), or, without one, the
    store global rank 0 hosts for the workers."""
    try:
        return dist.TCPStore(host, port, world_size, is_master=rank == 0 and not agent_store,
                             multi_tenant=not agent_store, timeout=datetime.timedelta(seconds=timeout_seconds))
    except (RuntimeError, OSError) as exc:  # DistStoreError is a RuntimeError
        raise RendezvousError(f"rank {rank}: the job's store at {host}:{port} did not answer within "
                              f"{timeout_seconds:.0f} s ({str(exc).splitlines()[0][:200]})") from exc


def attempt_store(base: dist.Store, rank: int, world_size: int, *, timeout_seconds: float) -> AttemptStore:
    """Agree with the other ranks on this attempt's generation ([Note: attempt generation]) and return
    its namespace of ``base``. Raises ``RendezvousError`` after ``timeout_seconds``."""
    deadline = time.monotonic() + timeout_seconds
    if rank == 0:
        generation = base.add(GENERATION_KEY, 1)
        joined = f"{_prefix(generation)}/joined"
        while base.add(joined, 0) < world_size - 1:
            _wait_or_raise(deadline, timeout_seconds, lambda: (
                f"rank 0: {base.add(joined, 0)} of the other {world_size - 1} ranks joined generation "
                f"{generation} of the job's store"))
        base.set(f"{_prefix(generation)}/go", "1")
        return AttemptStore(dist.PrefixStore(_prefix(generation), base), generation)
    tried = None
    joined_generation = None
    while True:
        if base.check([GENERATION_KEY]):
            generation = base.add(GENERATION_KEY, 0)
            if generation != tried:
                tried = generation
                count = base.add(f"{_prefix(generation)}/joined", 1)
                joined_generation = generation if count <= world_size - 1 else None  # full: a finished attempt's
            if joined_generation is not None and base.check([f"{_prefix(joined_generation)}/go"]):
                return AttemptStore(dist.PrefixStore(_prefix(joined_generation), base), joined_generation)
        _wait_or_raise(deadline, timeout_seconds, lambda: (
            f"rank {rank}: rank 0 of this attempt did not open a generation on the job's store (last seen: "
            f"{tried if tried is not None else 'none'}; joined: {joined_generation})"))


def _wait_or_raise(deadline: float, timeout_seconds: float, what) -> None:
    if time.monotonic() > deadline:
        raise RendezvousError(f"{what()}, after {timeout_seconds:.0f} s")
    time.sleep(_POLL_SECONDS)
