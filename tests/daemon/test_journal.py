"""Issue 42: the daemon's journal ([Note: adopted state] in daemon.journal). A journal cut at every write
boundary, and inside every record, reads as the state after the last whole record: never a mix. A region's
record never names bytes that are not there yet ([Note: durable regions] in swap.durable): each record a
store emits is checked against the swap file's bytes (plain reads) and the host copy at the moment it is
emitted, with the engine held so that a transfer is surely in flight."""
from __future__ import annotations

import copy
import os
import threading

import pytest

from daemon import journal as journal_mod
from daemon.journal import Journal, MemfdSink, FileSink, newest_state, read_records, state_of
from swap import IoEngineConfig, Tier, TierStore
from swap.durable import durable_record


class RecordingSink:
    """A sink that keeps each generation's bytes, where each record ends, and the state after it."""

    def __init__(self) -> None:
        self.generations: list[bytearray] = []
        self.ends: list[list[int]] = []
        self.states: list[list[dict]] = []
        self.journal: Journal | None = None

    def start_generation(self, data: bytes) -> None:
        self.generations.append(bytearray(data))
        self.ends.append([len(data)])
        self.states.append([None])  # the base's state is filled in by the first record's check

    def write(self, offset: int, data: bytes) -> None:
        gen = self.generations[-1]
        assert offset == len(gen)  # appended, never rewritten
        gen += data
        self.ends[-1].append(len(gen))
        self.states[-1].append(copy.deepcopy(self.journal.state))

    def close(self) -> None:
        pass


def _store(tmp_path, on_change, engine=None):
    store = TierStore.create(host_capacity_bytes=8 << 20, swap_paths=[str(tmp_path)], swap_capacity_bytes=32 << 20,
                             segment_bytes=4 << 20, engine_config=IoEngineConfig(kind="threads"))
    store._on_change = on_change
    if engine is not None:
        store.engine = engine
    return store


def _workload(store: TierStore, journal: Journal) -> None:
    """Sessions opened and closed, regions allocated, written, evicted, prefetched, dirtied and freed."""
    journal.append({"op": "open", "id": 1, "uid": 0, "job_id": "j", "rank": 0, "token": "t1", "quota_bytes": 8 << 20,
                    "segments": [0, 1]})
    for i in range(6):
        store.allocate(f"r{i}", (i + 1) * 70000)
        store.host_view(f"r{i}")[:] = bytes([i]) * ((i + 1) * 70000)
        store.mark_dirty(f"r{i}")
    store.wait_for_evict(store.evict(["r0", "r1", "r2"]))
    journal.append({"op": "token", "id": 1, "token": "t2"})
    store.wait_for_prefetch(store.prefetch(["r1"]))
    store.mark_dirty("r1")
    store.flush()
    store.free("r3")
    journal.append({"op": "open", "id": 2, "uid": 5, "job_id": "k", "rank": 1, "token": "u", "quota_bytes": 4 << 20,
                    "segments": [2]})
    store.wait_for_evict(store.evict(["r1", "r4", "r5"]))
    journal.append({"op": "close", "id": 2})
    store.free("r0")


def test_every_cut_of_the_journal_reads_as_the_state_after_a_whole_record(tmp_path, monkeypatch):
    monkeypatch.setattr(journal_mod, "COMPACT_MIN_BYTES", 1200)  # several generations in one workload
    monkeypatch.setattr(journal_mod, "COMPACT_FACTOR", 2)
    sink = RecordingSink()
    journal = Journal.__new__(Journal)
    sink.journal = journal
    journal.__init__(sink)
    store = _store(tmp_path, lambda name, rec: journal.append(
        {"op": "free", "id": 1, "name": name} if rec is None else {"op": "region", "id": 1, "name": name, "region": rec}))
    try:
        _workload(store, journal)
        final = copy.deepcopy(journal.state)
    finally:
        store.close()
    assert len(sink.generations) >= 3, "the workload must cross generations"
    checked = 0
    for g, (data, ends, states) in enumerate(zip(sink.generations, sink.ends, sink.states)):
        base_state = state_of(read_records(bytes(data[:ends[0]])))
        states[0] = base_state
        if g > 0:  # a generation's base is the state the one before it ended with
            assert base_state == sink.states[g - 1][-1] or base_state == states[0]
        cuts = sorted({c for end in ends for c in (end - 1, end, end + 1, end + 17)} | {0, 5, 16, 17})
        for cut in cuts:
            if not 0 <= cut <= len(data):
                continue
            whole = [i for i, end in enumerate(ends) if end <= cut]
            expected = states[whole[-1]] if whole else None
            assert state_of(read_records(bytes(data[:cut]))) == expected, (g, cut)
            checked += 1
    assert state_of(read_records(bytes(sink.generations[-1]))) == final
    assert checked > 100
    assert final["sessions"]["1"]["token"] == "t2" and final["sessions"]["1"]["previous_token"] == "t1"
    assert "2" not in final["sessions"] and final["pool"]["given"] == {"5": [2]}
    assert set(final["sessions"]["1"]["regions"]) == {"r1", "r2", "r4", "r5"}


def test_a_corrupt_record_ends_the_journal_there(tmp_path):
    sink = RecordingSink()
    journal = Journal.__new__(Journal)
    sink.journal = journal
    journal.__init__(sink)
    for i in range(4):
        journal.append({"op": "open", "id": i + 1, "uid": 0, "job_id": f"j{i}", "rank": 0, "token": "t",
                        "quota_bytes": 1, "segments": [i]})
    data, ends = bytes(sink.generations[-1]), sink.ends[-1]
    flipped = bytearray(data)
    flipped[ends[2] - 3] ^= 0x40  # inside the second record's payload
    assert state_of(read_records(bytes(flipped))) == sink.states[-1][1]  # the state after the first
    assert read_records(data[ends[0]:]) == []  # no base: nothing to fold


def test_the_newest_whole_generation_in_the_fd_store_wins(tmp_path):
    stored: dict[str, list[int]] = {}

    def store(fds, name):
        stored.setdefault(name, []).extend(os.dup(fd) for fd in fds)
        return True

    def remove(name):
        for fd in stored.pop(name, []):
            os.close(fd)
        return True

    sink = MemfdSink(store, remove)
    journal = Journal(sink)
    journal.append({"op": "open", "id": 1, "uid": 0, "job_id": "j", "rank": 0, "token": "t", "quota_bytes": 1,
                    "segments": [0]})
    journal.snapshot()  # generation 2 stored, generation 1 removed
    assert sorted(stored) == ["journal-2"]
    state, gen = newest_state(stored)
    assert gen == 2 and state["sessions"]["1"]["job_id"] == "j"
    # A kill while generation 3 was being written: its base is torn, so generation 2 is read.
    torn = os.memfd_create("torn")
    os.write(torn, journal_mod.encode_record(0, {"op": "base", "state": journal_mod.empty_state()})[:20])
    stored["journal-3"] = [torn]
    state, gen = newest_state(stored)
    assert gen == 2 and "1" in state["sessions"]
    journal.close()
    for fds in stored.values():
        for fd in fds:
            os.close(fd)


def test_the_state_directory_journal_is_replaced_whole(tmp_path):
    sink = FileSink(str(tmp_path / "state"))
    journal = Journal(sink)
    journal.append({"op": "open", "id": 1, "uid": 0, "job_id": "j", "rank": 0, "token": "t", "quota_bytes": 1,
                    "segments": [0]})
    (tmp_path / "state" / "journal.new").write_bytes(b"OFLJ\x00")  # a generation a kill left half-written
    assert state_of(read_records(sink.read()))["sessions"]["1"]["job_id"] == "j"
    journal.snapshot()
    assert state_of(read_records(sink.read()))["sessions"]["1"]["job_id"] == "j"
    assert not (tmp_path / "state" / "journal.new").exists()
    journal.close()


# -- [Note: durable regions] -------------------------------------------------------------------
class _Held:
    """An engine request submitted only once the gate opens (so a transfer is surely in flight)."""

    def __init__(self, engine, args, kwargs, gate):
        self._engine, self._args, self._kwargs, self._gate = engine, args, kwargs, gate
        self._request = None

    def _real(self):
        if self._request is None:
            self._gate.wait(30)
            self._request = self._engine.submit(*self._args, **self._kwargs)
        return self._request

    def wait(self, timeout=None):
        return self._real().wait(timeout)

    def error(self):
        return self._real().error()

    def crc(self):
        return self._real().crc()

    def times_ns(self):
        return self._real().times_ns()


class HeldEngine:
    def __init__(self, engine):
        self._engine = engine
        self.gate = threading.Event()

    def submit(self, *args, **kwargs):
        return _Held(self._engine, args, kwargs, self.gate)

    def __getattr__(self, name):
        return getattr(self._engine, name)


def test_a_region_record_never_names_bytes_not_yet_in_place(tmp_path):
    """Each record is checked as it is emitted: an NVMe copy it names is read back from the swap file (plain
    reads), a host copy it names is read from the pool. Writes and reads are held in flight meanwhile."""
    contents: dict[str, bytes] = {}
    seen: list[tuple[str, str]] = []
    box: dict = {}

    def check(name, record):
        if record is None:
            return
        seen.append((name, record["tier"]))
        store = box["store"]
        want = contents[name]
        if record["tier"] in ("NVME", "HOST_AND_NVME") and record["placements"]:
            got = bytearray()
            for file_index, file_offset, region_offset, nbytes in sorted(record["placements"], key=lambda p: p[2]):
                with open(store.space.files[file_index].path, "rb") as f:
                    f.seek(file_offset)
                    got += f.read(nbytes)
            assert bytes(got[:len(want)]) == want, f"{name}: record {record['tier']} names NVMe bytes not written"
        if record["tier"] in ("HOST", "HOST_AND_NVME") and record["host"] is not None and not record["dirty"]:
            seg, off, _ = record["host"]
            assert bytes(store.pool.segments[seg].view(off, len(want))) == want, \
                f"{name}: record {record['tier']} names a host copy not yet read"

    store = _store(tmp_path, check)
    held = HeldEngine(store.engine)
    store.engine = held
    box["store"] = store
    try:
        for i, name in enumerate(("a", "b")):
            contents[name] = os.urandom(300_000 + i)
            store.allocate(name, len(contents[name]))
            store.host_view(name)[:] = contents[name]
        handle = store.evict(["a", "b"])  # held: nothing written yet
        assert [t for _, t in seen] == ["HOST", "HOST"]  # the allocations; the evict says nothing yet
        assert durable_record(store._regions["a"])["tier"] == "HOST"
        held.gate.set()
        store.wait_for_evict(handle)
        assert seen[-2:] == [("a", "NVME"), ("b", "NVME")]
        held.gate.clear()
        handle = store.prefetch(["a"])  # held: nothing read yet
        assert seen[-1] == ("b", "NVME")
        assert durable_record(store._regions["a"])["tier"] == "NVME"
        held.gate.set()
        store.wait_for_prefetch(handle)
        assert seen[-1] == ("a", "HOST_AND_NVME")
        assert store.info("a").tier is Tier.HOST_AND_NVME
    finally:
        held.gate.set()
        store.close()
