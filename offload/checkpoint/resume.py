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
    0       8     magic b"OFLSTP02"
    8       4     valid: 1 = describes the step after the committed one; 3 = its inputs but the
                  multiplier (PENDING, below); 2 = SPECULATIVE (below); 0 = none (rewriting it)
    12      4     reserved (0)
    16      8     sub-groups done: [0, done) stepped and (nvme) marked dirty, in order
    24      8     sub-group whose Adam pass is running, or -1
    32      8     payload length
    40      8     the step's gradient multiplier (float64; NaN until known)
    48      n     payload: a pickle of {"small": the engine's small state as the step began (its
                  RNG, client_state, LR and loss scale), "step_count", "hypers"}

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

[Note: pending step] Ranks agree on the step's multiplier by an all-reduce (the gradient norm), and
a rank killed just after it, before its record, would otherwise resume at the committed step while a
peer that got the same result goes on: it writes its record, steps, and may commit (torchrun's
SIGTERM makes it finish the step), so the ranks would resume one step apart and the state be torn.
So the plain recorded step writes its record before the all-reduce, all but the multiplier, with
valid = 3 (PENDING) and the marker left committed (nothing is touched yet), and after it writes the
multiplier, then valid = 1, then the marker. A restart that finds a PENDING record for the step after
its committed one says so (``agree``): where every rank is at that committed step, the record is
dropped and all resume there; where the peers are one step on (finishing it, or committed), its
gradients had all landed (it had entered the all-reduce), so it finishes that step from its own record
with the multiplier a peer reports (from its record, or the ``step_multiplier`` of its last commit;
None: the step was skipped on overflow), bit-equal to a run never killed.
The overlapped step's record is a speculative one from its backward on, and its all-reduce comes
after: so once its gradients have all landed (at ``engine.step()``), it writes the same inputs beside
the rollback copies' slots (``speculative_pending``). A restart that finds them one step behind peers
that passed restores the early sub-groups first (ROLLBACK) and then finishes the whole step the same way.

A region whose step is still -1 was never committed (the trainer died before its first step
finished: in its first forward, say). Its session holds nothing a restart needs, so it is a
fresh start, not a torn one, whatever the marker says: the restarted trainer builds the state
again from the model (and loads its checkpoint, if the script does that), as the first did.
"""
from __future__ import annotations

import logging
import math
import pickle
import struct
from typing import Any

from csrc import ConfigError, SessionError, StateTornError

logger = logging.getLogger(__name__)

__all__ = ["COMMIT_BYTES", "CommitRegion", "agree", "daemon_lost", "inspect_session", "open_undo", "roll_back",
           "step_multiplier"]

COMMIT_NAME = "engine.commit"
UNDO_NAME = "engine.undo"
COMMIT_BYTES = 256 << 10
MAGIC = b"OFLCMT01"
_HEADER = struct.Struct("<8sIIqq")
COMMITTED, IN_STEP = 0, 1
RECORD_AT = 128 << 10  # [Note: restartable step]
RECORD_MAGIC = b"OFLSTP02"
_RECORD = struct.Struct("<8sIIqqqd")
_MULTIPLIER_AT = RECORD_AT + 40
NO_PASS = -1
RECORDED, SPECULATIVE, PENDING = 1, 2, 3
ROLLBACK_NAME = "engine.rollback.{}"
MAX_EARLY = 4096
"""Rollback copies a speculative record names (an int64 slot each); its pending inputs follow them."""
_SPECULATIVE_PENDING_AT = RECORD_AT + _RECORD.size + 8 * MAX_EARLY


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
        """After the step: the small state, then the step number, then the marker; then the step record is
        spent (a record beside a committed marker is one of the step after it: [Note: pending step])."""
        data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        _fits(data, RECORD_AT - _HEADER.size)
        self._view[_HEADER.size:_HEADER.size + len(data)] = data
        self._view[16:32] = struct.pack("<qq", step, len(data))
        self._view[8:12] = struct.pack("<I", COMMITTED)
        self._view[RECORD_AT + 8:RECORD_AT + 12] = struct.pack("<I", 0)  # the step record is spent

    # -- the step record ([Note: restartable step]) --

    def begin_recorded_step(self, record: dict[str, Any]) -> None:
        """Before the step touches the state: what it consumes (its "multiplier" included), then the marker."""
        record = dict(record)
        multiplier = record.pop("multiplier")
        self._write_record(record, valid=0, multiplier=multiplier)
        self._view[RECORD_AT + 8:RECORD_AT + 12] = struct.pack("<I", RECORDED)
        self._view[8:12] = struct.pack("<I", IN_STEP)

    def begin_pending_step(self, record: dict[str, Any]) -> None:
        """Before the all-reduce that fixes the step's multiplier: what the step consumes but the multiplier,
        valid = PENDING, the marker left committed ([Note: pending step])."""
        self._write_record(record, valid=0, multiplier=math.nan)
        self._view[RECORD_AT + 8:RECORD_AT + 12] = struct.pack("<I", PENDING)

    def record_multiplier(self, multiplier: float) -> None:
        """The pending record's multiplier, then valid, then the marker: the step may touch the state now."""
        self._view[_MULTIPLIER_AT:_MULTIPLIER_AT + 8] = struct.pack("<d", multiplier)
        self._view[RECORD_AT + 8:RECORD_AT + 12] = struct.pack("<I", RECORDED)
        self._view[8:12] = struct.pack("<I", IN_STEP)

    def _write_record(self, record: dict[str, Any], *, valid: int, multiplier: float) -> None:
        data = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
        _fits(data, COMMIT_BYTES - RECORD_AT - _RECORD.size)
        at = RECORD_AT + _RECORD.size
        self._view[RECORD_AT + 8:RECORD_AT + 12] = struct.pack("<I", 0)
        self._view[at:at + len(data)] = data
        self._view[RECORD_AT:RECORD_AT + _RECORD.size] = _RECORD.pack(RECORD_MAGIC, valid, 0, 0, NO_PASS, len(data),
                                                                     multiplier)

    def read_pending(self, step: int) -> tuple[dict[str, Any], float | None] | None:
        """With the marker committed at ``step``: a record of the step after it ([Note: pending step]), as
        (record, multiplier), the multiplier None while PENDING; None if there is none."""
        magic, valid, _, _, _, length, multiplier = _RECORD.unpack(
            bytes(self._view[RECORD_AT:RECORD_AT + _RECORD.size]))
        if magic != RECORD_MAGIC or valid not in (PENDING, RECORDED):
            return None
        at = RECORD_AT + _RECORD.size
        try:
            record = pickle.loads(bytes(self._view[at:at + length]))
        except Exception:  # rewritten since: valid would say 0
            return None
        if record["small"]["global_steps"] != step:  # an older step's (committed, or skipped on overflow)
            return None
        return record, (None if valid == PENDING else multiplier)

    def begin_speculative_step(self) -> None:
        """As an overlapped step's backward begins ([Note: speculative step]): no early copy yet, then the
        marker."""
        self._view[RECORD_AT + 8:RECORD_AT + 12] = struct.pack("<I", 0)
        self._view[RECORD_AT:RECORD_AT + _RECORD.size] = _RECORD.pack(RECORD_MAGIC, 0, 0, 0, NO_PASS, 0, math.nan)
        self._view[RECORD_AT + 8:RECORD_AT + 12] = struct.pack("<I", SPECULATIVE)
        self._view[8:12] = struct.pack("<I", IN_STEP)

    def early_copied(self, k: int, sg: int) -> None:
        """Rollback copy ``k`` (region ROLLBACK_NAME) holds sub-group ``sg``'s state from before the step."""
        if k >= MAX_EARLY:
            raise ConfigError(f"rollback copy {k}: the commit region records at most {MAX_EARLY} early sub-groups")
        at = RECORD_AT + _RECORD.size + 8 * k
        self._view[at:at + 8] = struct.pack("<q", sg)
        self._view[RECORD_AT + 16:RECORD_AT + 24] = struct.pack("<q", k + 1)

    def speculative_pending(self, record: dict[str, Any]) -> None:
        """An overlapped step's backward is over and its gradients all landed: before the all-reduce that
        fixes its multiplier, what it consumes but the multiplier, beside the rollback copies' slots, then
        its length ([Note: pending step]). Nothing if the record is not a speculative one."""
        magic, valid = struct.unpack("<8sI", bytes(self._view[RECORD_AT:RECORD_AT + 12]))
        if magic != RECORD_MAGIC or valid != SPECULATIVE:
            return
        data = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
        _fits(data, COMMIT_BYTES - _SPECULATIVE_PENDING_AT)
        self._view[_SPECULATIVE_PENDING_AT:_SPECULATIVE_PENDING_AT + len(data)] = data
        self._view[RECORD_AT + 32:RECORD_AT + 40] = struct.pack("<q", len(data))

    def read_speculative_pending(self, step: int) -> dict[str, Any] | None:
        """A speculative record's pending inputs of the step after ``step``; None if there are none."""
        magic, valid, _, _, _, length, _ = _RECORD.unpack(bytes(self._view[RECORD_AT:RECORD_AT + _RECORD.size]))
        if magic != RECORD_MAGIC or valid != SPECULATIVE or length <= 0:
            return None
        record = pickle.loads(bytes(self._view[_SPECULATIVE_PENDING_AT:_SPECULATIVE_PENDING_AT + length]))
        return record if record["small"]["global_steps"] == step else None

    def read_rollback(self) -> list[tuple[int, int]] | None:
        """(copy, sub-group) of each whole rollback copy of a speculative step; None if the record is not one."""
        magic, valid, _, done, _, _, _ = _RECORD.unpack(bytes(self._view[RECORD_AT:RECORD_AT + _RECORD.size]))
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
        magic, valid, _, done, in_pass, length, multiplier = _RECORD.unpack(
            bytes(self._view[RECORD_AT:RECORD_AT + _RECORD.size]))
        if magic != RECORD_MAGIC or valid != RECORDED:
            return None
        at = RECORD_AT + _RECORD.size
        record = dict(pickle.loads(bytes(self._view[at:at + length])), multiplier=multiplier)
        early = set(record.get("early", ()))
        pending = next(i for i in range(done, done + len(early) + 1) if i not in early)
        if in_pass not in (NO_PASS, pending):  # the pass running is always the first sub-group not yet stepped
            return None
        return record, done, in_pass != NO_PASS

    def release(self) -> None:
        self._view = None


def undo_exists(store: Any) -> bool:
    """Whether the session holds an undo log, or the undo copy of compressed states ([Note: block undo])."""
    from offload.zero.block_undo import BLOCK_UNDO_NAME

    for name in (UNDO_NAME, BLOCK_UNDO_NAME):
        try:
            store.info(name)
        except ConfigError:
            continue
        return True
    return False


def undo_slots() -> int:
    """Thread slots of the undo log: one per core this process may run on (the Adam pass's threads)."""
    from cpu_adam import default_num_threads

    return max(1, min(256, default_num_threads()))


def open_undo(store: Any, *, existing: bool, slots: int, max_elems: int, block_bytes: int | None = None):
    """The session's undo log ([Note: restartable step]): made for ``slots`` threads and sub-groups of up
    to ``max_elems`` elements, or the one a previous process of the session left. ``block_bytes``: the
    states are compressed, in blocks of up to that many bytes: their undo copy ([Note: block undo])."""
    from cpu_adam.undo import UndoLog, undo_bytes

    if block_bytes is not None:
        from offload.zero.block_undo import open_block_undo

        return open_block_undo(store, existing=existing, max_block_bytes=block_bytes)
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
    if copies:
        logger.warning("restored %d sub-group(s) stepped under the killed step's backward from their rollback copies",
                       len(copies))


def _fits(data: bytes, room: int) -> None:
    if len(data) > room:
        raise ConfigError(f"the per-step state is {len(data)} bytes, over the commit region's {room}: keep "
                          "engine.client_state small (a data position, not data)")


FRESH, RESUME, TORN, FINISH, ROLLBACK = "fresh", "resume", "torn", "finish", "rollback"
PENDING_STEP = "pending"  # a RESUME with a PENDING record, as ``agree`` hears it


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
            payload = dict(payload, rollback=copies)
            pending = commit.read_speculative_pending(step)
            if pending is not None:  # killed about its all-reduce: its peers say what follows ([Note: pending step])
                payload["pending"] = pending
            return ROLLBACK, step, payload, commit
        record = commit.read_record() if payload is not None else None
        if record is not None and record[2] and not undo_exists(store):
            record = None  # cut inside a pass by a version without the undo log
        if record is None:
            return TORN, step, payload, commit
        return FINISH, step + 1, dict(payload, step_record=record), commit
    pending = commit.read_pending(step)
    if pending is not None and pending[1] is not None:  # its multiplier recorded, the marker not yet moved
        return FINISH, step + 1, dict(payload, step_record=(dict(pending[0], multiplier=pending[1]), 0, False)), commit
    if pending is not None:  # killed about the step's all-reduce: its peers say what follows ([Note: pending step])
        payload = dict(payload, pending=pending[0])
    return RESUME, step, payload, commit


UNKNOWN = object()
"""``step_multiplier`` of a rank that cannot say what its last step's multiplier was."""


def step_multiplier(verdict: str, payload: dict[str, Any] | None) -> Any:
    """The multiplier of the step a rank resumes at (None: skipped on overflow), or UNKNOWN."""
    if verdict == FINISH:
        return payload["step_record"][0]["multiplier"]
    if verdict in (RESUME, ROLLBACK) and payload is not None:  # the committed step's
        return payload.get("step_multiplier", UNKNOWN)
    return UNKNOWN


def agree(verdict: str, step: int, group: Any, world_size: int, *, pending: bool = False,
          multiplier: Any = UNKNOWN) -> tuple[str, str, Any]:
    """The verdict every rank acts on: resume (a rank's own FINISH: after finishing its step) only if
    every rank reaches the same step, fresh only if every rank is fresh, torn otherwise; a rank with a
    ``pending`` record one step behind peers that passed its all-reduce finishes that step
    ([Note: pending step]). ``multiplier``: this rank's ``step_multiplier``. Returns (verdict, what the
    ranks said, the multiplier a pending rank finishes its step with)."""
    if world_size == 1:
        return verdict, f"{verdict} at step {step}", UNKNOWN
    import torch
    import torch.distributed as dist

    codes = {FRESH: 0, RESUME: 1, TORN: 2, FINISH: 3, ROLLBACK: 4, PENDING_STEP: 5}
    code = codes[PENDING_STEP if pending and verdict in (RESUME, ROLLBACK) else verdict]
    known = 0 if multiplier is UNKNOWN else 1 if multiplier is None else 2
    mine = torch.tensor([code, step, known, multiplier if known == 2 else 0.0], dtype=torch.float64)
    every = [torch.zeros(4, dtype=torch.float64) for _ in range(world_size)]
    dist.all_gather(every, mine, group=group)
    names = {v: k for k, v in codes.items()}
    said = ", ".join(f"rank {r}: {names[int(t[0])]} at step {int(t[1])}" for r, t in enumerate(every))
    kinds = {int(t[0]) for t in every}
    steps = {int(t[1]) for t in every}
    if kinds == {codes[FRESH]}:
        return FRESH, said, UNKNOWN
    if not kinds <= {codes[RESUME], codes[FINISH], codes[ROLLBACK], codes[PENDING_STEP]}:
        return TORN, said, UNKNOWN
    if len(steps) == 1:  # each finishes (or undoes) its step or not, and all resume at the same one
        return verdict, said, UNKNOWN  # a pending rank among them drops its record: its state is untouched
    behind, ahead = min(steps), max(steps)
    laggards = [t for t in every if int(t[1]) == behind]
    leaders = [t for t in every if int(t[1]) == ahead]
    heard = {(int(t[2]), float(t[3])) for t in leaders if int(t[2]) != 0}
    if (ahead != behind + 1 or any(int(t[0]) != codes[PENDING_STEP] for t in laggards)
            or any(int(t[0]) not in (codes[RESUME], codes[FINISH], codes[ROLLBACK]) for t in leaders)
            or len(heard) != 1):
        return TORN, said, UNKNOWN
    (kind, value), = heard
    if step == behind:  # this rank is one of the pending ones: it finishes the step its peers passed
        return FINISH, said, (None if kind == 1 else value)
    return verdict, said, UNKNOWN


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
