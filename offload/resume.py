"""Training state that outlives the trainer: a per-step commit in the daemon's memory, and resume from it.

With the optimizer offloaded to the node daemon, the fp32 master weights and the Adam moments
already live in the daemon's shared memory (or its swap). The rest of the training state is
small: counters, the loss scale, the LR scheduler, RNG states, and the caller's
``engine.client_state`` (its data position). ``CommitRegion`` keeps it in one more region of
the session, rewritten at every step boundary, so that a restarted rank that reattaches to its
session (within the daemon's grace period) continues from the last completed step without
loading a checkpoint.

[Note: commit region layout] Region ``engine.commit``, ``COMMIT_BYTES`` long, little-endian:

    offset  size  field
    0       8     magic b"OFLCMT01"
    8       4     marker: 0 = committed, no optimizer step in progress; 1 = a step is in progress
    12      4     reserved (0)
    16      8     global step of the committed state
    24      8     payload length in bytes
    32      n     payload: a pickle of the engine's small state

The trainer writes it (the daemon never reads it): the marker goes to 1 before the optimizer
step touches the master weights or moments, the payload and step are written after the step,
and the marker goes back to 0 last. A process killed anywhere in between leaves marker 1: some
sub-groups stepped, others not. Such a state is finished by the restart when the step record below
says how, and is torn (never resumed from) otherwise.

[Note: restartable step] The second half of the region, from ``RECORD_AT``, is the step record:
what the step in progress consumes, written before it touches the first sub-group, and how far
it got:

    offset  size  field
    0       8     magic b"OFLSTP01"
    8       4     valid: 1 = describes the step after the committed one; 0 = none (rewriting it)
    12      4     reserved (0)
    16      8     sub-groups done: [0, done) stepped and (nvme) marked dirty, in order
    24      8     sub-group whose Adam pass is running, or -1
    32      8     payload length
    40      n     payload: a pickle of {"small": the engine's small state as the step began (its
                  RNG, client_state, LR and loss scale), "step_count", "hypers", "multiplier"}

The gradients the step reads are daemon regions already (the accumulators) and the Adam pass
only reads them, so with the record they are the whole input. A rank killed inside the step
with a valid record is finished by its restart (``Engine.finish_step``): the sub-groups from
``done`` on are stepped from the committed inputs, then the params are rebuilt from the masters
and the step's bookkeeping (LR schedule, loss scale, counters) runs as it would have: bit-equal
to a run never killed. Killed inside a sub-group's Adam pass (the sub-group whose pass is
running is then ``done`` itself), the pass is finished from the undo log (region
``engine.undo``, [Note: undo log] in ``csrc/adam_undo.c``): the C pass kept, in the daemon's
memory, which of its chunks are done and the old values of each piece in flight, so the restart
restores those pieces and runs what is left of the pass. With nvme the block is marked dirty
before its pass starts (``StateStorage.will_write``), so the daemon writes back the host copy
the pass was writing, never drops it for the copy on NVMe from before the step. With no record
(the delayed update: why not, in its module's note and the README's "Surviving crashes") the state
is torn, as before.

[Note: speculative step] The overlapped step (``offload.zero.overlap``) writes state blocks under
backward, before the step's multiplier is known: such a step cannot be finished by a restart (the
gradients not yet landed die with the process), so it is rolled back instead. As its backward
begins, the record says so (valid = 2, SPECULATIVE) and ``done`` counts the early sub-groups whose
rollback copy is whole: before an early sub-group is stepped (cpu), its state block is copied into
the daemon region ``engine.rollback.<k>`` and its index written at slot k of the payload area (an
int64 each), then ``done`` becomes k + 1. A restart that finds a speculative record copies those
blocks back and resumes at the committed step (verdict ROLLBACK): the killed step is done again, as
if the kill had come before it. With nvme nothing is copied: an early block is not marked dirty
until the speculation holds, so the restart's ``StateStorage.adopt`` drops its host copy and NVMe's,
from before the step, is the state. When the speculation holds, ``engine.step()`` replaces the
record with an ordinary one (valid = 1) that names the early sub-groups as done ("early"; with nvme
they are marked dirty after it, and by the restart before ``adopt`` if the kill came first); when it
fails, the early blocks are restored first, so both readings stay true at every instant.

A region whose step is still -1 was never committed (the trainer died before its first step
finished: in its first forward, say). Its session holds nothing a restart needs, so it is a
fresh start, not a torn one, whatever the marker says: the restarted trainer builds the state
again from the model (and loads its checkpoint, if the script does that), as the first did.
"""
from __future__ import annotations

import logging
import pickle
import struct
from typing import Any

from csrc import ConfigError, SessionError, StateTornError

logger = logging.getLogger(__name__)

__all__ = ["COMMIT_BYTES", "CommitRegion", "daemon_lost", "open_undo", "roll_back"]

COMMIT_NAME = "engine.commit"
UNDO_NAME = "engine.undo"
COMMIT_BYTES = 256 << 10
MAGIC = b"OFLCMT01"
_HEADER = struct.Struct("<8sIIqq")
COMMITTED, IN_STEP = 0, 1
RECORD_AT = 128 << 10  # [Note: restartable step]
RECORD_MAGIC = b"OFLSTP01"
_RECORD = struct.Struct("<8sIIqqq")
NO_PASS = -1
RECORDED, SPECULATIVE = 1, 2
ROLLBACK_NAME = "engine.rollback.{}"


class CommitRegion:
    """The per-session commit region of [Note: commit region layout]."""

    def __init__(self, store: Any, *, existing: bool) -> None:
        self.store = store
        if not existing:
            store.allocate(COMMIT_NAME, COMMIT_BYTES)
        self._view = store.host_view(COMMIT_NAME)
        if not existing:
            self._write_header(IN_STEP, -1, 0)  # nothing committed yet: not resumable

    @staticmethod
    def exists(store: Any) -> bool:
        if getattr(store, "reattached", None) is False:
            return False  # a fresh daemon session holds nothing: asking would be an error reply the daemon counts
        try:
            store.info(COMMIT_NAME)
        except ConfigError:
            return False
        return True

    def _write_header(self, marker: int, step: int, length: int) -> None:
        self._view[:_HEADER.size] = _HEADER.pack(MAGIC, marker, 0, step, length)

    def read(self) -> tuple[int, int, dict[str, Any] | None]:
        """(marker, step, payload). With marker IN_STEP the payload is the last commit's if it is still
        whole (only its last_checkpoint is of use then), else None."""
        magic, marker, _, step, length = _HEADER.unpack(bytes(self._view[:_HEADER.size]))
        if magic != MAGIC:
            raise SessionError(f"region {COMMIT_NAME!r} is not a commit region (magic {magic!r})")
        try:
            payload = pickle.loads(bytes(self._view[_HEADER.size:_HEADER.size + length])) if length else None
        except Exception:  # a commit cut short mid-write: the marker says torn anyway
            payload = None
        if marker != COMMITTED or step < 0:
            return IN_STEP, step, payload
        return COMMITTED, step, payload

    def begin_step(self) -> None:
        """Before the optimizer step writes the state: mark it in progress (with no step record: torn if
        it is cut short)."""
        self._view[RECORD_AT + 8:RECORD_AT + 12] = struct.pack("<I", 0)
        self._view[8:12] = struct.pack("<I", IN_STEP)

    def commit(self, step: int, payload: dict[str, Any]) -> None:
        """After the step: the small state, then the step number, then the marker."""
        data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        _fits(data, RECORD_AT - _HEADER.size)
        self._view[_HEADER.size:_HEADER.size + len(data)] = data
        self._view[16:32] = struct.pack("<qq", step, len(data))
        self._view[8:12] = struct.pack("<I", COMMITTED)

    # -- the step record ([Note: restartable step]) --

    def begin_recorded_step(self, record: dict[str, Any]) -> None:
        """Before the step touches the state: what it consumes, then the marker."""
        data = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
        _fits(data, COMMIT_BYTES - RECORD_AT - _RECORD.size)
        at = RECORD_AT + _RECORD.size
        self._view[RECORD_AT + 8:RECORD_AT + 12] = struct.pack("<I", 0)
        self._view[at:at + len(data)] = data
        self._view[RECORD_AT:RECORD_AT + _RECORD.size] = _RECORD.pack(RECORD_MAGIC, 0, 0, 0, NO_PASS, len(data))
        self._view[RECORD_AT + 8:RECORD_AT + 12] = struct.pack("<I", 1)
        self._view[8:12] = struct.pack("<I", IN_STEP)

    def begin_speculative_step(self) -> None:
        """As an overlapped step's backward begins ([Note: speculative step]): no early copy yet, then the
        marker."""
        self._view[RECORD_AT + 8:RECORD_AT + 12] = struct.pack("<I", 0)
        self._view[RECORD_AT:RECORD_AT + _RECORD.size] = _RECORD.pack(RECORD_MAGIC, 0, 0, 0, NO_PASS, 0)
        self._view[RECORD_AT + 8:RECORD_AT + 12] = struct.pack("<I", SPECULATIVE)
        self._view[8:12] = struct.pack("<I", IN_STEP)

    def early_copied(self, k: int, sg: int) -> None:
        """Rollback copy ``k`` (region ROLLBACK_NAME) holds sub-group ``sg``'s state from before the step."""
        at = RECORD_AT + _RECORD.size + 8 * k
        if at + 8 > COMMIT_BYTES:
            raise ConfigError(f"rollback copy {k}: the commit region records at most "
                              f"{(COMMIT_BYTES - RECORD_AT - _RECORD.size) // 8} early sub-groups")
        self._view[at:at + 8] = struct.pack("<q", sg)
        self._view[RECORD_AT + 16:RECORD_AT + 24] = struct.pack("<q", k + 1)

    def read_rollback(self) -> list[tuple[int, int]] | None:
        """(copy, sub-group) of each whole rollback copy of a speculative step; None if the record is not one."""
        magic, valid, _, done, _, _ = _RECORD.unpack(bytes(self._view[RECORD_AT:RECORD_AT + _RECORD.size]))
        if magic != RECORD_MAGIC or valid != SPECULATIVE:
            return None
        at = RECORD_AT + _RECORD.size
        return [(k, struct.unpack("<q", bytes(self._view[at + 8 * k:at + 8 * k + 8]))[0]) for k in range(done)]

    def sub_group_started(self, index: int) -> None:
        self._view[RECORD_AT + 24:RECORD_AT + 32] = struct.pack("<q", index)

    def sub_group_done(self, done: int) -> None:
        """Sub-groups [0, done) are stepped (and marked dirty): no pass is running."""
        self._view[RECORD_AT + 16:RECORD_AT + 32] = struct.pack("<qq", done, NO_PASS)

    def read_record(self) -> tuple[dict[str, Any], int, bool] | None:
        """(payload, sub-groups done, whether sub-group ``done``'s pass was running) of a step that can
        be finished; None if there is none."""
        magic, valid, _, done, in_pass, length = _RECORD.unpack(bytes(self._view[RECORD_AT:RECORD_AT + _RECORD.size]))
        if magic != RECORD_MAGIC or valid != RECORDED:
            return None
        at = RECORD_AT + _RECORD.size
        record = pickle.loads(bytes(self._view[at:at + length]))
        early = set(record.get("early", ()))
        pending = next(i for i in range(done, done + len(early) + 1) if i not in early)
        if in_pass not in (NO_PASS, pending):  # the pass running is always the first sub-group not yet stepped
            return None
        return record, done, in_pass != NO_PASS

    def release(self) -> None:
        self._view = None


def undo_exists(store: Any) -> bool:
    try:
        store.info(UNDO_NAME)
    except ConfigError:
        return False
    return True


def undo_slots() -> int:
    """Thread slots of the undo log: one per core this process may run on (the Adam pass's threads)."""
    from cpu_adam import default_num_threads

    return max(1, min(256, default_num_threads()))


def session_fixed_bytes(plan: Any) -> int:
    """What a daemon session holds besides the optimizer state: the commit region and the undo log
    (for sub-groups of the plan's largest gradient region), page-aligned."""
    return fixed_bytes_for(max(plan.region_bytes, default=0) // 4)  # >= the largest sub-group's elements


def fixed_bytes_for(max_elems: int) -> int:
    """``session_fixed_bytes`` for sub-groups of at most ``max_elems`` elements."""
    from cpu_adam.undo import undo_bytes

    page = 4096
    return COMMIT_BYTES + -(-undo_bytes(undo_slots(), max_elems) // page) * page


def open_undo(store: Any, *, existing: bool, slots: int, max_elems: int):
    """The session's undo log ([Note: restartable step]): made for ``slots`` threads and sub-groups of up
    to ``max_elems`` elements, or the one a previous process of the session left."""
    from cpu_adam.undo import UndoLog, undo_bytes

    if not existing:
        store.allocate(UNDO_NAME, undo_bytes(slots, max_elems))
    return UndoLog(store.host_view(UNDO_NAME), fresh=not existing, slots=slots, max_elems=max_elems)


def roll_back(store: Any, storage: Any, copies: list[tuple[int, int]]) -> None:
    """A speculative step's early sub-groups back to their state from before it ([Note: speculative step])."""
    import torch

    for k, sg in copies:
        state = storage.state(sg)
        state.view(torch.uint8).copy_(torch.frombuffer(store.host_view(ROLLBACK_NAME.format(k)), dtype=torch.uint8,
                                                       count=state.numel() * state.element_size()))
    logger.info("restored %d sub-group(s) stepped under the killed step's backward from their rollback copies",
                len(copies))


def _fits(data: bytes, room: int) -> None:
    if len(data) > room:
        raise ConfigError(f"the per-step state is {len(data)} bytes, over the commit region's {room}: keep "
                          "engine.client_state small (a data position, not data)")


FRESH, RESUME, TORN, FINISH, ROLLBACK = "fresh", "resume", "torn", "finish", "rollback"


def inspect_session(store: Any) -> tuple[str, int, dict[str, Any] | None, CommitRegion | None]:
    """What this rank's session holds: (verdict, step, payload, commit region). FINISH: a step that
    can be finished ([Note: restartable step]); its step is the one it reaches, and the payload
    is the last commit's with the step record under "step_record" as (record, sub-groups done, whether
    a pass was cut: then the undo log must be there). ROLLBACK: an overlapped step killed before its
    verdict ([Note: speculative step]); its step is the committed one, and the payload has the
    rollback copies to restore under "rollback"."""
    if not CommitRegion.exists(store):
        return FRESH, -1, None, None
    commit = CommitRegion(store, existing=True)
    marker, step, payload = commit.read()
    if step < 0:  # never committed: a fresh start ([Note: commit region layout])
        return FRESH, step, None, None
    if marker != COMMITTED:
        copies = commit.read_rollback() if payload is not None else None
        if copies is not None:  # an overlapped step killed before its verdict: undone ([Note: speculative step])
            return ROLLBACK, step, dict(payload, rollback=copies), commit
        record = commit.read_record() if payload is not None else None
        if record is not None and record[2] and not undo_exists(store):
            record = None  # cut inside a pass by a version without the undo log
        if record is None:
            return TORN, step, payload, commit
        return FINISH, step + 1, dict(payload, step_record=record), commit
    return RESUME, step, payload, commit


def agree(verdict: str, step: int, group: Any, world_size: int) -> tuple[str, str]:
    """The verdict every rank acts on: resume (a rank's own FINISH: after finishing its step) only if
    every rank reaches the same step, fresh only if every rank is fresh, torn otherwise. Returns
    (verdict, what the ranks said)."""
    if world_size == 1:
        return verdict, f"{verdict} at step {step}"
    import torch
    import torch.distributed as dist

    codes = {FRESH: 0, RESUME: 1, TORN: 2, FINISH: 3, ROLLBACK: 4}
    mine = torch.tensor([codes[verdict], step], dtype=torch.int64)
    every = [torch.zeros(2, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(every, mine, group=group)
    names = {v: k for k, v in codes.items()}
    said = ", ".join(f"rank {r}: {names[int(t[0])]} at step {int(t[1])}" for r, t in enumerate(every))
    kinds = {int(t[0]) for t in every}
    steps = {int(t[1]) for t in every}
    if kinds == {codes[FRESH]}:
        return FRESH, said
    if kinds <= {codes[RESUME], codes[FINISH], codes[ROLLBACK]} and len(steps) == 1:
        return verdict, said  # each finishes (or undoes) its step or not, and all resume at the same one
    return TORN, said


def daemon_lost(*, rank: int, step: int, tier: str, last_checkpoint: str | None, cause: BaseException) -> str:
    """The message of a trainer whose daemon went away: what was lost, and what to do next."""
    if last_checkpoint:
        then = (f"then restart the job: it starts from its last checkpoint, {last_checkpoint} (the script's "
                "engine.load_checkpoint loads it), and redoes the steps after it")
    else:
        then = ("then restart the job: it saved no checkpoint since it started, so it starts again from step 0 "
                "(save checkpoints with engine.save_checkpoint to bound what a daemon crash costs)")
    return (f"rank {rank}: the offload daemon was found gone at step {step} ({tier}: {cause}). The optimizer state it "
            "held for this job is lost (the fp32 master weights, the Adam moments in its memory and swap, and the "
            "per-step commit a restart resumes from): this job cannot resume from the daemon. Restart the daemon "
            f"(offload daemon --config <node.toml>), {then}.")
