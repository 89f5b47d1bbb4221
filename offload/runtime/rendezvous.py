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
import importlib
import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from csrc.errors import RendezvousError

__all__ = ["DIST_INIT_TIMEOUT_SECONDS", "GENERATION_KEY", "AttemptStore", "attempt_store", "init_distributed",
           "open_job_store"]

DIST_INIT_TIMEOUT_SECONDS = 600.0
"""How long ``init_distributed`` waits for the other ranks of this attempt to meet it."""
GENERATION_KEY = "offload/generation"
_POLL_SECONDS = 0.02

logger = logging.getLogger(__name__)


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


def init_distributed(dist_backend: str | None = None, timeout_seconds: float | None = None) -> None:
    """Join the ranks torchrun started (NCCL with GPUs, gloo without); a no-op for one process
    or when torch.distributed is already initialized.

    Under torchrun the ranks meet in a namespace of the job's store of their own attempt ([Note: attempt
    generation]), so a job restarted after a lost rank forms its group again on every node. The meeting is
    bounded by ``timeout_seconds`` (default ``OFFLOAD_INIT_TIMEOUT_SECONDS``, else 600 s); past it,
    ``RendezvousError`` names what this rank waited for. The group's collectives keep torch's timeout."""
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # [Note: world group lifetime] Nothing may hold the world group but torch's registry, or
    # it outlives destroy_process_group(); gloo's worker threads then live into interpreter
    # exit, and one that drops a finished collective's tensors there aborts the process
    # ("terminate called without an active exception"). So the engine's parts use group None
    # (the default group), and torch.distributed.nn, whose functions take group.WORLD as a
    # default argument, is imported before the group exists (the first optimizer imports it,
    # through dynamo, otherwise).
    importlib.import_module("torch.distributed.nn")
    if timeout_seconds is None:
        timeout_seconds = float(os.environ.get("OFFLOAD_INIT_TIMEOUT_SECONDS", DIST_INIT_TIMEOUT_SECONDS))
    if "TORCHELASTIC_RUN_ID" not in os.environ or "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend=backend)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    base = open_job_store(host, port, world, rank=rank, timeout_seconds=timeout_seconds,
                          agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True")
    attempt = attempt_store(base, rank, world, timeout_seconds=timeout_seconds)
    try:
        dist.init_process_group(backend=backend, store=attempt.store, rank=rank, world_size=world)
    except RuntimeError as exc:  # gloo's connect to a peer of this generation
        raise RendezvousError(
            f"rank {rank}: the {backend} process group of generation {attempt.generation} (store "
            f"{host}:{port}) did not form: {str(exc).splitlines()[0][:300]}") from exc
    logger.info("rank %d joined generation %d of the job's store (torchrun restart %s on this node)", rank,
                attempt.generation, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
