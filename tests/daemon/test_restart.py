"""Issue 42: the daemon restarts without losing a session. Real daemon processes, started again through a
player of systemd's fd store (``fd_store.py``): stopped with SIGTERM (as ``systemctl restart`` does) or
killed with SIGKILL, the next start takes over the journal, the segments and the swap files, and a
``TierClient`` that lost its connection reattaches and goes on, its bytes intact, its transfers issued
again, and none of them done twice. What cannot be proven the same is refused, and the client is told
to go back to its checkpoint."""
from __future__ import annotations

import os
import socket
import time

import pytest

from csrc.errors import DaemonNotRunningError, SessionError
from daemon.client import DaemonConnection, TierClient, TierClientConfig
from daemon.config import PoolConfig, SessionConfig
from daemon.sessions import Session, SessionState, SessionTable
from offload.cli.main import format_status
from daemon.journal import encode_record, read_records, state_of
from daemon.protocol import Kind
from tests.daemon.conftest import STORE
from tests.daemon.prom import scrape
from tests.daemon.restarts import RestartableDaemon

pytestmark = pytest.mark.skipif(STORE != "swap", reason="a takeover needs the real swap layer")

MiB = 1 << 20


@pytest.fixture
def restartable(request):
    made = []

    def make(fd_store: bool = True, slow: bool = False, keep: str | None = None, **tables) -> RestartableDaemon:
        tables.setdefault("pool", {"capacity_bytes": 64 * MiB, "segment_bytes": 4 * MiB})
        tables.setdefault("sessions", {"default_quota_bytes": 16 * MiB, "reattach_grace_seconds": 30.0})
        if slow:
            tables["io"] = {"kind": "threads", "block_size_bytes": 4096, "queue_depth": 1, "num_threads": 1}
        d = RestartableDaemon(fd_store=fd_store, keep=keep, **tables)
        made.append(d)
        return d.start()

    yield make
    for d in made:
        d.close()


def _client(d, job: str, **kw) -> TierClient:
    return TierClient(TierClientConfig(socket_path=d.socket_path, job_id=job, reconnect_seconds=kw.pop("reconnect", 60),
                                       **kw))


def _fill(c: TierClient, name: str, nbytes: int) -> bytes:
    data = os.urandom(nbytes)
    c.allocate(name, nbytes)
    c.host_view(name)[:] = data
    c.mark_dirty(name)
    return data


def _journal_state(d: RestartableDaemon) -> dict:
    """The newest journal generation the fd store holds, folded (what a start after a kill now would read)."""
    fds = [(int(n.rpartition("-")[2]), fd) for n, fd in d.store.fds() if n.startswith("journal-")]
    gen, fd = max(fds)
    data = bytearray()
    while chunk := os.pread(fd, 1 << 20, len(data)):
        data += chunk
    return state_of(read_records(bytes(data)))


def _region_in_journal(d: RestartableDaemon, name: str) -> dict | None:
    for s in _journal_state(d)["sessions"].values():
        if name in s["regions"]:
            return s["regions"][name]
    return None


def test_sigterm_restart_keeps_every_session_and_its_bytes(restartable):
    d = restartable()
    a, b = _client(d, "alpha"), _client(d, "beta", rank=3)
    data = {"host": _fill(a, "host", MiB), "clean": _fill(a, "clean", 2 * MiB), "nvme": _fill(a, "nvme", 3 * MiB),
            "fetching": _fill(a, "fetching", MiB + 5), "other": _fill(b, "other", 2 * MiB)}
    a.flush()  # "clean" and the rest: on NVMe with a host copy
    a.mark_dirty("host")
    a.wait_for_evict(a.evict(["nvme", "fetching"]))
    fetching = a.prefetch(["fetching"])  # not waited for across the restart
    views = {n: a.host_view(n) for n in ("host", "clean")}  # taken before: the same memory after
    inodes_before = [sorted(n for n in d.store.names() if n.startswith("seg-"))]
    assert d.term() == 0
    assert "stopped (drained), keeping the journal and segments in the fd store" in d.log()
    assert inodes_before == [sorted(n for n in d.store.names() if n.startswith("seg-"))]
    t0 = time.monotonic()
    d.start()
    a.wait_for_prefetch(fetching)  # issued again under a new number
    pause = time.monotonic() - t0
    assert bytes(a.host_view("fetching")) == data["fetching"]
    assert {n: bytes(v) for n, v in views.items()} == {n: data[n] for n in views}
    assert a.info("host").tier.name == "HOST" and a.info("clean").tier.name == "HOST_AND_NVME"
    assert a.info("nvme").tier.name == "NVME"
    a.wait_for_prefetch(a.prefetch(["nvme"]))
    assert bytes(a.host_view("nvme")) == data["nvme"]
    assert bytes(b.host_view("other")) == data["other"]  # a view needs no request: the same memory
    assert b.info("other").tier.name == "HOST"
    assert a.reconnects == 1 and b.reconnects == 1 and pause < 30
    status = d.status()
    rows = {r["job_id"]: r for r in status["sessions"]}
    assert rows["alpha"]["daemon_restarts"] == 1 and rows["alpha"]["reattached_after_restart"]
    assert "attached, reattached after 1 daemon restart" in format_status(status)
    metrics = scrape(d.metrics_port)
    assert metrics[("offload_sessions_adopted_total", ())] == 2
    assert metrics[("offload_sessions_reattached_after_restart_total", ())] == 2
    a.free("clean")
    a.allocate("new", MiB)  # the pool's and the swap space's accounting carried over: room as before
    a.close()
    b.close()
    assert d.status()["sessions"] == []


def test_a_write_the_lost_daemon_finished_is_not_written_again(restartable):
    """Killed after an evict's write was done and journaled but before the client waited for it: the client
    issues the evict again, and the successor, which has the region on NVMe, writes nothing."""
    d = restartable()
    c = _client(d, "done-write")
    data = _fill(c, "x", 3 * MiB + 7)
    handle = c.evict(["x"])
    deadline = time.monotonic() + 30
    while (_region_in_journal(d, "x") or {}).get("tier") != "NVME":
        assert time.monotonic() < deadline, _journal_state(d)
        time.sleep(0.01)
    d.kill()
    d.start()
    c.wait_for_evict(handle)
    assert c.stats().bytes_written_total == 0  # nothing written twice
    assert c.info("x").tier.name == "NVME"
    c.wait_for_prefetch(c.prefetch(["x"]))
    assert bytes(c.host_view("x")) == data
    assert c.stats().bytes_read_total > 0
    c.close()


def test_a_write_killed_in_flight_is_written_again_from_the_host_copy(restartable):
    d = restartable(slow=True)
    c = _client(d, "mid-write")
    data = _fill(c, "x", 4 * MiB)
    handle = c.evict(["x"])
    deadline = time.monotonic() + 30
    while d.status()["inflight"] == 0:  # the write is under way (4 KiB at a time)
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert _region_in_journal(d, "x")["tier"] == "HOST"  # in flight: still dirty in host memory, as journaled
    d.kill()
    d.start()
    c.wait_for_evict(handle)
    assert c.stats().bytes_written_total >= 4 * MiB
    c.wait_for_prefetch(c.prefetch(["x"]))
    assert bytes(c.host_view("x")) == data
    c.close()


def test_without_kept_state_the_client_is_told_to_go_back_to_its_checkpoint(restartable):
    """keep_state "off": a stop ends every session, as before."""
    d = restartable(keep="off")
    c = _client(d, "gone", reconnect=20)
    _fill(c, "x", MiB)
    d.term()
    d.start()
    with pytest.raises(DaemonNotRunningError, match="came back without session .* go back to the last checkpoint"):
        c.info("x")
    assert d.status()["sessions"] == []  # the fresh session the reattach opened was closed again
    c.detach()


def test_no_daemon_within_reconnect_seconds_is_the_error_of_before(restartable):
    d = restartable()
    c = _client(d, "late", reconnect=0.5)
    _fill(c, "x", MiB)
    d.kill()
    t0 = time.monotonic()
    with pytest.raises(DaemonNotRunningError, match="did not come back .* within 0 s|within 1 s"):
        c.info("x")
    assert time.monotonic() - t0 < 10
    c.detach()


def test_a_segment_that_is_not_the_journals_is_refused(restartable):
    """Another memfd stored under a session's segment name: the successor cannot prove that session's memory,
    refuses it with a log line naming it, and its client is told to go back to its checkpoint."""
    d = restartable()
    c = _client(d, "swapped", reconnect=20)
    _fill(c, "x", MiB)
    lent = _journal_state(d)["sessions"]["1"]["segments"]
    d.term()
    impostor = os.memfd_create("impostor")
    os.ftruncate(impostor, 4 * MiB)
    seen = len(d.store.messages)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        name = f"seg-{lent[0]}"
        sock.sendto(f"FDSTOREREMOVE=1\nFDNAME={name}".encode(), d.store.socket_path)
        sock.sendmsg([f"FDSTORE=1\nFDNAME={name}".encode()],
                      [(socket.SOL_SOCKET, socket.SCM_RIGHTS, impostor.to_bytes(4, "little"))], 0, d.store.socket_path)
    os.close(impostor)
    d.store.wait_for(lambda s: len(s.messages) >= seen + 2, 10)
    d.start()
    assert f"not taken over from the previous daemon: job 'swapped' rank 0 (uid {os.getuid()}): its host memory " \
           f"is gone (segment(s) [{lent[0]}]" in d.log()
    assert scrape(d.metrics_port)[("offload_sessions_refused_total", ())] == 1
    with pytest.raises(DaemonNotRunningError, match="came back without session"):
        c.info("x")
    c.detach()


def test_a_reattach_with_the_token_before_the_last_is_taken():
    """A daemon killed after it journaled a reattach's new token but before its reply left: the client still
    holds the token before it, and the successor takes that one too (and no other)."""
    table = SessionTable(SessionConfig(), PoolConfig(capacity_bytes=4 * MiB, segment_bytes=4 * MiB), None, None)
    s = Session(1, "job", 0, os.getuid(), "new-token", 4 * MiB, None, [], lambda: None, state=SessionState.DETACHED,
                previous_token="old-token", adopted=True)
    with pytest.raises(SessionError, match="needs the token"):
        table._reattach(s, os.getuid(), "some-other-token")
    assert table._reattach(s, os.getuid(), "old-token") == (s, True)
    assert s.previous_token == "new-token" and s.token not in ("new-token", "old-token")


@pytest.mark.parametrize("forgery", ["shared-host-block", "segment-held-twice"])
def test_a_session_that_cannot_be_restored_is_refused_and_the_others_taken_over(restartable, forgery):
    """The newest journal generation says two of one session's regions share a host block, or that it holds a
    segment another session holds: that session is refused with a line naming it, its client is told to go
    back to its checkpoint, its segments go back to the pool, and the other session, whole, is taken over."""
    d = restartable()
    good, bad = _client(d, "good", rank=1), _client(d, "bad", reconnect=20)  # bad is restored second
    _fill(bad, "p", MiB)
    _fill(bad, "q", MiB)
    kept = _fill(good, "g", MiB)
    assert d.term() == 0
    state = _journal_state(d)
    sid = next(k for k, s in state["sessions"].items() if s["job_id"] == "bad")
    if forgery == "shared-host-block":  # two regions in one block: no state a store can be in
        regions = state["sessions"][sid]["regions"]
        regions["q"]["host"] = list(regions["p"]["host"])
    else:
        other = next(s for k, s in state["sessions"].items() if k != sid)
        state["sessions"][sid]["segments"][-1] = other["segments"][0]
    gen = max(int(n.rpartition("-")[2]) for n in d.store.names() if n.startswith("journal-"))
    forged = os.memfd_create("forged")
    os.write(forged, encode_record(0, {"op": "base", "state": state}))
    seen = len(d.store.messages)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendmsg([f"FDSTORE=1\nFDNAME=journal-{gen + 1}".encode()],
                     [(socket.SOL_SOCKET, socket.SCM_RIGHTS, forged.to_bytes(4, "little"))], 0, d.store.socket_path)
    os.close(forged)
    d.store.wait_for(lambda s: len(s.messages) > seen, 10)
    d.start()
    assert "not taken over from the previous daemon: job 'bad' rank 0" in d.log()
    assert "took over job good rank 1" in d.log()
    assert scrape(d.metrics_port)[("offload_sessions_refused_total", ())] == 1
    assert bytes(good.host_view("g")) == kept and good.info("g").tier.name == "HOST"
    with pytest.raises(DaemonNotRunningError, match="came back without session"):
        bad.info("p")
    bad.detach()
    others = [_client(d, f"new{i}") for i in range(3)]  # 3 x 16 MiB: only with the refused session's back
    for c in [good, *others]:
        c.close()


# -- [Note: hand-back]: no fd store, the trainers give their memory back ---------------------------------
@pytest.mark.parametrize("stop", ["kill", "term"])
def test_trainers_hand_their_memory_back_to_a_daemon_without_an_fd_store(restartable, stop):
    d = restartable(keep="state_dir")
    a, b = _client(d, "alpha"), _client(d, "beta", rank=2)
    data = {"host": _fill(a, "host", MiB), "nvme": _fill(a, "nvme", 3 * MiB), "other": _fill(b, "other", 2 * MiB)}
    a.wait_for_evict(a.evict(["nvme"]))
    fetching = a.prefetch(["nvme"])  # not waited for across the restart
    view = a.host_view("host")
    d.kill() if stop == "kill" else d.term()
    d.start()
    assert "kept job alpha rank 0" in d.log() and "for its trainer to hand its 1 segment(s) back" in d.log() \
        or "segment(s) back" in d.log()
    a.wait_for_prefetch(fetching)
    assert bytes(a.host_view("nvme")) == data["nvme"] and bytes(view) == data["host"]
    assert b.info("other").tier.name == "HOST" and bytes(b.host_view("other")) == data["other"]
    assert "alpha rank 0 handed its" in d.log() and "beta rank 2 handed its" in d.log()
    assert a.reconnects == 1 and b.reconnects == 1
    a.mark_dirty("host")
    a.wait_for_evict(a.evict(["host"]))  # the journal goes on: a second restart finds this too
    d.kill()
    d.start()
    a.wait_for_prefetch(a.prefetch(["host"]))
    assert bytes(a.host_view("host")) == data["host"]
    rows = {r["job_id"]: r for r in d.status()["sessions"]}
    assert rows["alpha"]["daemon_restarts"] == 2
    a.close()
    b.close()


def test_a_hand_back_of_other_memory_is_refused(restartable):
    d = restartable(keep="state_dir")
    c = _client(d, "imposter", reconnect=20)
    _fill(c, "x", MiB)
    other = os.memfd_create("other")
    os.ftruncate(other, os.fstat(c._segments.fds[0]).st_size)
    os.close(c._segments.fds[0])
    c._segments.fds[0] = other  # what it would hand back is not the session's memory
    d.kill()
    d.start()
    with pytest.raises(DaemonNotRunningError, match="not the memory the journal names.*go back to the last checkpoint"):
        c.info("x")
    assert "the segments handed back are not the memory the journal names" in d.log()
    assert d.status()["sessions"] == []
    c.detach()


def test_a_pending_session_nobody_claims_gives_its_memory_back(restartable):
    """Its trainer gone too: after the grace period the session is reclaimed and the pool is whole again."""
    d = restartable(keep="state_dir", sessions={"default_quota_bytes": 16 * MiB, "reattach_grace_seconds": 1.0})
    c = _client(d, "orphan", reconnect=20)
    _fill(c, "x", MiB)
    c.wait_for_evict(c.evict(["x"]))
    d.kill()
    c.detach()  # the trainer dies too: nobody will hand the memory back
    d.start()
    status = d.status()
    assert status["sessions"][0]["state"] == "waiting for its memory"
    assert status["swap"]["used_bytes"] == MiB  # its extents are held for it meanwhile
    deadline = time.monotonic() + 20
    while d.status()["sessions"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert d.status()["swap"]["used_bytes"] == 0  # the held extents went
    clients = [_client(d, f"new{i}") for i in range(4)]  # 4 x 16 MiB: the whole pool, made anew where vacant
    for x in clients:
        x.close()


def test_a_new_process_of_a_pending_session_gets_a_fresh_one(restartable):
    """A trainer process restarted too (it does not hold the memory) gets a new session, as before."""
    d = restartable(keep="state_dir")
    c = _client(d, "restarted")
    _fill(c, "x", MiB)
    d.kill()
    c.detach()
    d.start()
    fresh = _client(d, "restarted")  # the same job and rank, its token from the token file
    assert not fresh.reattached
    assert "the session is dropped and a new one opened" in d.log()
    fresh.close()


def test_a_bye_done_by_the_lost_daemon_is_done(restartable):
    """Killed after it closed the session (and journaled that) but before its reply left: the client's close
    finds the session gone, which is what it asked for, and does not fail (a torchrun run met this)."""
    d = restartable()
    c = _client(d, "closing")
    _fill(c, "x", MiB)
    conn, real = c._conn, c._conn.request

    def reply_lost(kind, body=None, wait_seconds=0.0):
        result = real(kind, body, wait_seconds)
        if kind is Kind.BYE:
            d.kill()
            d.start()
            raise DaemonNotRunningError("the daemon closed the connection")
        return result

    conn.request = reply_lost
    c.close()
    assert d.status()["sessions"] == []


def test_a_daemon_lost_again_while_reattaching_is_looked_for_again(restartable, monkeypatch):
    """Stopped again right after the reattach, before the transfers were issued again (a torchrun run met a
    SIGTERM there under load): the client looks for the next daemon within the same reconnect time."""
    d = restartable()
    c = _client(d, "twice")
    data = _fill(c, "x", MiB)
    c.wait_for_evict(c.evict(["x"]))
    handle = c.prefetch(["x"])
    d.kill()
    d.start()
    real, hits = DaemonConnection.request, []

    def refused_once(self, kind, body=None, wait_seconds=0.0):
        if kind is Kind.PREFETCH and not hits:  # the first transfer issued again meets a daemon going down
            hits.append(kind)
            d.kill()
            d.start()
            raise DaemonNotRunningError("the daemon is shutting down and takes no new I/O")
        return real(self, kind, body, wait_seconds)

    monkeypatch.setattr(DaemonConnection, "request", refused_once)
    c.wait_for_prefetch(handle)
    assert hits and bytes(c.host_view("x")) == data and c.reconnects == 1
    c.close()
