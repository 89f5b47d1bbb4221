"""The daemon's bookkeeping, journaled where a successor finds it.

[Note: adopted state] A daemon that dies (an upgrade's ``systemctl restart``, a bug, SIGKILL) leaves its
state behind: the session segments are memfds that systemd's fd store (or the trainers) still hold,
the swap files are on disk. What dies is the bookkeeping: which session holds which segments, each
region's host block, swap extents and checksums, the reattach tokens. The journal keeps that. It is a
sequence of records, each one whole state change; the first of each *generation* is a ``base`` record
holding the whole state, and the journal starts a new generation (compaction) when it has grown to
several times its base. A successor folds the records of the newest whole generation, in order, and
stops at the first record that is short, fails its checksum or breaks the sequence: a daemon killed at
any instant leaves the state after some whole record, never part of one.

The order of writes makes that state true of the bytes (see [Note: durable regions] in
``swap.durable``): a region's record is appended only after every byte it names is in place (a
finished write-back's record after the write, never at its start), a transfer in flight is recorded
as not begun, and the reply that tells a client of a change leaves after its record. So whatever
prefix a successor reads, each region it describes holds the bytes the record says.

Record framing: ``b"OFLJ"``, payload length u32, sequence number u64, CRC-32 of the sequence number
and the payload u32, then the payload (UTF-8 JSON). Where it lives: ``MemfdSink``, a memfd per
generation kept in systemd's fd store (``FDNAME=journal-<generation>``; the new generation is
stored before the old one is removed), or ``FileSink``, ``<state_dir>/journal`` (a new generation is
written beside it and renamed over it).
"""
from __future__ import annotations

import copy
import json
import logging
import os
import struct
import threading
import time
import zlib
from typing import Any, Callable, Protocol

logger = logging.getLogger(__name__)

__all__ = ["Journal", "FileSink", "MemfdSink", "read_records", "fold", "empty_state", "newest_state",
           "JOURNAL_FDNAME"]

MAGIC = b"OFLJ"
HEADER = struct.Struct("<4sIQI")
"""magic, payload length, sequence number, CRC-32 (of the sequence number's 8 bytes and the payload)."""
MAX_RECORD_BYTES = 1 << 30
JOURNAL_FDNAME = "journal"
"""Prefix of the fd store names of the journal's memfds: ``journal-<generation>``."""
COMPACT_FACTOR = 4
COMPACT_MIN_BYTES = 1 << 20


def _crc(seq: int, payload: bytes) -> int:
    return zlib.crc32(payload, zlib.crc32(struct.pack("<Q", seq)))


def encode_record(seq: int, record: dict[str, Any]) -> bytes:
    payload = json.dumps(record, separators=(",", ":")).encode()
    return HEADER.pack(MAGIC, len(payload), seq, _crc(seq, payload)) + payload


def read_records(data: bytes) -> list[dict[str, Any]]:
    """The whole records at the start of ``data``, up to the first that is short, corrupt or out of
    sequence; ``[]`` unless the first is a ``base``."""
    records: list[dict[str, Any]] = []
    pos, expect = 0, None
    while pos + HEADER.size <= len(data):
        magic, length, seq, crc = HEADER.unpack_from(data, pos)
        end = pos + HEADER.size + length
        if magic != MAGIC or length > MAX_RECORD_BYTES or end > len(data) or (expect is not None and seq != expect):
            break
        payload = bytes(data[pos + HEADER.size:end])
        if _crc(seq, payload) != crc:
            break
        try:
            record = json.loads(payload)
        except ValueError:
            break
        if not records and record.get("op") != "base":
            return []
        records.append(record)
        pos, expect = end, seq + 1
    return records


# -- the state and its fold -----------------------------------------------------------------
def empty_state() -> dict[str, Any]:
    """The state of a daemon that holds nothing: see ``fold`` for its fields."""
    return {"pool": {"segment_bytes": 0, "count": 0, "inodes": {}, "given": {}}, "swap": {"dirs": [], "files": []},
            "sessions": {}, "next_session_id": 1}


def fold(state: dict[str, Any], record: dict[str, Any]) -> None:
    """Apply one record to ``state`` in place.

    ``pool``: its segment size and count, each segment's memfd inode by index (str keys, as JSON has
    them), and ``given``: uid -> the free segments a session of that uid gave back (kept for that uid:
    [Note: recycling segments] in ``daemon.pool``). ``swap``: the claimed directories and each swap
    file's ``SwapFile.record()``. ``sessions``: id -> uid, job, rank, token (and the one before it),
    quota, segment indices, regions (name -> ``TierStore.durable`` record)."""
    op = record["op"]
    if op == "base":
        state.clear()
        state.update(copy.deepcopy(record["state"]))
    elif op == "pool":
        state["pool"] = {"segment_bytes": record["segment_bytes"], "count": record["count"],
                         "inodes": dict(record["inodes"]), "given": {}}
    elif op == "segment":
        state["pool"]["inodes"][str(record["index"])] = record["inode"]
    elif op == "swap":
        state["swap"] = {"dirs": list(record["dirs"]), "files": list(record["files"])}
    elif op == "open":
        given = state["pool"]["given"]
        for uid in list(given):
            given[uid] = [i for i in given[uid] if i not in record["segments"]]
            if not given[uid]:
                del given[uid]
        state["sessions"][str(record["id"])] = {
            "uid": record["uid"], "job_id": record["job_id"], "rank": record["rank"], "token": record["token"],
            "previous_token": "", "quota_bytes": record["quota_bytes"], "segments": list(record["segments"]),
            "regions": {}}
        state["next_session_id"] = max(state["next_session_id"], record["id"] + 1)
    elif op == "token":
        s = state["sessions"].get(str(record["id"]))
        if s is not None:
            s["previous_token"], s["token"] = s["token"], record["token"]
    elif op == "close":
        s = state["sessions"].pop(str(record["id"]), None)
        if s is not None:
            state["pool"]["given"].setdefault(str(s["uid"]), []).extend(s["segments"])
    elif op == "region":
        s = state["sessions"].get(str(record["id"]))
        if s is not None:
            s["regions"][record["name"]] = record["region"]
    elif op == "free":
        s = state["sessions"].get(str(record["id"]))
        if s is not None:
            s["regions"].pop(record["name"], None)
    else:
        raise ValueError(f"unknown journal record {op!r}")


def state_of(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The state the records leave (None without a base record)."""
    if not records:
        return None
    state = empty_state()
    for record in records:
        fold(state, record)
    return state


# -- where the journal lives -----------------------------------------------------------------
class Sink(Protocol):
    def write(self, offset: int, data: bytes) -> None: ...

    def start_generation(self, data: bytes) -> None: ...

    def close(self) -> None: ...


class FileSink:
    """``<state_dir>/journal``: appended in place; a new generation written beside it, then renamed over it."""

    def __init__(self, state_dir: str) -> None:
        os.makedirs(state_dir, mode=0o700, exist_ok=True)
        self.path = os.path.join(state_dir, "journal")
        self._fd: int | None = None

    def read(self) -> bytes:
        try:
            with open(self.path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return b""

    def write(self, offset: int, data: bytes) -> None:
        os.pwrite(self._fd, data, offset)

    def start_generation(self, data: bytes) -> None:
        tmp = self.path + ".new"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.pwrite(fd, data, 0)
            os.fsync(fd)
            os.replace(tmp, self.path)
        except BaseException:
            os.close(fd)
            raise
        if self._fd is not None:
            os.close(self._fd)
        self._fd = fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class MemfdSink:
    """A memfd per generation, in systemd's fd store: ``store(fd, name)`` and ``remove(name)`` speak to it
    (``daemon.notify``). The new generation is stored before the old one is removed, so the store
    always holds a whole one."""

    def __init__(self, store: Callable[[list[int], str], bool], remove: Callable[[str], bool], generation: int = 0) -> None:
        self._store, self._remove = store, remove
        self.generation = generation
        self._fd: int | None = None

    def write(self, offset: int, data: bytes) -> None:
        os.pwrite(self._fd, data, offset)

    def start_generation(self, data: bytes) -> None:
        fd = os.memfd_create("offload-journal", os.MFD_CLOEXEC)
        try:
            os.pwrite(fd, data, 0)
            if not self._store([fd], f"{JOURNAL_FDNAME}-{self.generation + 1}"):
                raise OSError("the fd store did not take the journal")
        except BaseException:
            os.close(fd)
            raise
        if self.generation > 0:
            self._remove(f"{JOURNAL_FDNAME}-{self.generation}")
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self.generation = fd, self.generation + 1

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _read_fd(fd: int) -> bytes:
    chunks, offset = [], 0
    while True:
        chunk = os.pread(fd, 1 << 20, offset)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        offset += len(chunk)


def newest_state(stored: dict[str, list[int]]) -> tuple[dict[str, Any] | None, int]:
    """From the fd store's fds by name: the state of the newest journal generation that reads whole
    (a base record), and that generation (0: none)."""
    generations = []
    for name, fds in stored.items():
        prefix, _, gen = name.rpartition("-")
        if prefix == JOURNAL_FDNAME and gen.isdigit():
            generations.extend((int(gen), fd) for fd in fds)
    for gen, fd in sorted(generations, reverse=True):
        state = state_of(read_records(_read_fd(fd)))
        if state is not None:
            return state, gen
        logger.warning("journal generation %d in the fd store has no whole base record; trying an older one", gen)
    return None, 0


class Journal:
    """The daemon's journal: ``append`` folds a record into the state and writes it; a new generation
    (the whole state as its base) starts when the current one has grown ``COMPACT_FACTOR`` times its base.
    Thread safe: records are written in the order they are folded."""

    def __init__(self, sink: Sink, state: dict[str, Any] | None = None) -> None:
        self._sink = sink
        self._lock = threading.Lock()
        self.state = state if state is not None else empty_state()
        self._seq = 0
        self._end = 0
        self._base_bytes = 0
        self.records_total = 0
        self.seconds_total = 0.0
        """Time spent in ``append`` (encoding, checksum, write, new generations), for the metrics."""
        with self._lock:
            self._new_generation()

    def _new_generation(self) -> None:
        data = encode_record(0, {"op": "base", "state": self.state})
        self._sink.start_generation(data)
        self._seq, self._end, self._base_bytes = 1, len(data), len(data)

    def append(self, record: dict[str, Any]) -> None:
        with self._lock:
            t0 = time.perf_counter()
            fold(self.state, record)
            data = encode_record(self._seq, record)
            self._sink.write(self._end, data)
            self._seq += 1
            self._end += len(data)
            self.records_total += 1
            if self._end > max(COMPACT_MIN_BYTES, COMPACT_FACTOR * self._base_bytes):
                self._new_generation()
            self.seconds_total += time.perf_counter() - t0

    def snapshot(self) -> None:
        """Start a new generation now (a clean stop writes one, so its successor reads one record)."""
        with self._lock:
            self._new_generation()

    def close(self) -> None:
        with self._lock:
            self._sink.close()
