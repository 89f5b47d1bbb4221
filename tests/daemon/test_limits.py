"""Admission and limits, against a real daemon process: every limit is checked before anything is
reserved, names itself in the error, and leaves everyone else alone."""
from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from csrc.errors import ConfigError, QuotaExceededError
from daemon.client import DaemonConnection, TierClient, TierClientConfig
from daemon.protocol import HEADER, PROTOCOL_VERSION, Flag, Kind, encode_frame
from tests.daemon.conftest import REPO, write_config
from tests import child_pythonpath

MiB = 1 << 20


def client(d, job, rank=0, **kw) -> TierClient:
    return TierClient(TierClientConfig(socket_path=d.socket_path, job_id=job, rank=rank, timeout_seconds=30, **kw))


def hello(conn: DaemonConnection, job: str, quota: int, rank: int = 0) -> dict:
    reply, fds = conn.request(Kind.HELLO, {"version": PROTOCOL_VERSION, "job_id": job, "rank": rank,
                                           "quota_bytes": quota})
    for fd in fds:
        os.close(fd)
    return reply


def raw_sockets(path: str, n: int) -> list[socket.socket]:
    """``n`` plain connections to the daemon that have said nothing yet."""
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        s.connect(path)
        socks.append(s)
    return socks


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_negative_quota_raced_against_whole_pool_hellos_cannot_over_commit(daemon_factory):
    d = daemon_factory(pool={"capacity_bytes": 64 * MiB, "segment_bytes": 4 * MiB})
    socks = raw_sockets(d.socket_path, 4)
    quotas = [-(1 << 40), 64 * MiB, 64 * MiB, 64 * MiB]
    frames = [encode_frame(Kind.HELLO, 1, {"version": PROTOCOL_VERSION, "job_id": f"race{i}", "rank": 0,
                                           "quota_bytes": q}) for i, q in enumerate(quotas)]
    for s, frame in zip(socks, frames):  # all four in flight before any is answered
        s.sendall(frame)
    granted = 0
    for s in socks:
        head = s.recv(HEADER.size, socket.MSG_WAITALL)
        nbytes, _, flags, _ = HEADER.unpack(head)
        s.recv(nbytes, socket.MSG_WAITALL)
        granted += not flags & Flag.ERROR
    status = d.status()
    assert status["pool"]["used_bytes"] <= status["pool"]["capacity_bytes"] == 64 * MiB, status["pool"]
    assert granted == 1, granted
    for s in socks:
        s.close()
    with pytest.raises(ConfigError, match="quota_bytes"):
        DaemonConnection(d.socket_path, 10).request(Kind.HELLO, {"version": PROTOCOL_VERSION, "job_id": "n",
                                                                  "rank": 0, "quota_bytes": -4096})


def test_out_of_range_fields_are_refused_naming_them(shared_daemon):
    conn = DaemonConnection(shared_daemon.socket_path, 10)
    for body, field in (({"job_id": "r", "rank": -1, "quota_bytes": 0}, "rank"),
                        ({"job_id": "r", "rank": 0, "quota_bytes": 1 << 60}, "quota_bytes")):
        with pytest.raises(ConfigError, match=field):
            conn.request(Kind.HELLO, {"version": PROTOCOL_VERSION, **body})
    with pytest.raises(QuotaExceededError, match="min_quota_bytes"):
        conn.request(Kind.HELLO, {"version": PROTOCOL_VERSION, "job_id": "r", "rank": 0, "quota_bytes": 1})
    hello(conn, "ranges", 0)
    with pytest.raises(ConfigError, match="timeout_seconds"):
        conn.request(Kind.WAIT_PREFETCH, {"handle": 1, "timeout_seconds": -5})
    with pytest.raises(ConfigError, match="seconds"):
        conn.request(Kind.REPORT_STEP, {"seconds": 1e300})
    conn.request(Kind.BYE)
    conn.close()


def test_deeply_nested_json_is_an_error_reply_without_a_traceback(shared_daemon):
    d = shared_daemon
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(d.socket_path)
    for rid, body in enumerate((b"[" * 30000 + b"]" * 30000, b'{"a":NaN}', b'{"x":' * 1000 + b"1" + b"}" * 1000), 1):
        s.sendall(HEADER.pack(len(body), Kind.PING, 0, rid) + body)
        nbytes, _, flags, got = HEADER.unpack(s.recv(HEADER.size, socket.MSG_WAITALL))
        reply = s.recv(nbytes, socket.MSG_WAITALL)
        assert got == rid and flags == Flag.REPLY | Flag.ERROR and b"ProtocolError" in reply, reply
    s.close()
    assert "Traceback" not in d.log() and "RecursionError" not in d.log()


def test_five_thousand_regions_with_long_names_are_refused_and_cost_no_memory(daemon_factory):
    d = daemon_factory()
    conn = DaemonConnection(d.socket_path, 30)
    hello(conn, "names", 0)
    before = rss_bytes(d.proc.pid)
    sock = conn._sock
    for start in range(0, 5000, 100):  # pipelined, 100 at a time, each name 60 KB
        batch = b"".join(encode_frame(Kind.ALLOCATE, 1000 + i, {"name": f"{i:05d}" + "n" * 60_000, "nbytes": 1})
                         for i in range(start, start + 100))
        sock.sendall(batch)
        for _ in range(100):
            nbytes, _, flags, _ = HEADER.unpack(sock.recv(HEADER.size, socket.MSG_WAITALL))
            reply = sock.recv(nbytes, socket.MSG_WAITALL)
            assert flags & Flag.ERROR and b"max_region_name_bytes = 256" in reply, reply[:300]
    grown = rss_bytes(d.proc.pid) - before
    assert grown < 64 * MiB, f"the daemon grew by {grown / MiB:.0f} MiB"
    assert conn.request(Kind.ALLOCATE, {"name": "n" * 256, "nbytes": 1})[0]["region"]["nbytes"] == 1
    conn.close()


def evict_until_refused(c: TierClient, names: list[str], limit: str):
    """Evict each of ``names`` (one handle each, none waited for) until refused naming ``limit``; other
    refusals (a queue still full) are waited out. Returns (handles, the refusal or None)."""
    handles, deadline = [], time.monotonic() + 60
    for name in names:
        while True:
            try:
                handles.append(c.evict([name]))
                break
            except QuotaExceededError as exc:
                if limit in str(exc) or time.monotonic() > deadline:
                    return handles, exc if limit in str(exc) else None
                time.sleep(0.2)
    return handles, None


def test_per_session_caps_name_their_keys(daemon_factory):
    d = daemon_factory(slow=True, sessions={"max_regions_per_session": 8, "max_queued_transfers_per_session": 3,
                                            "max_unwaited_handles_per_session": 6, "max_sessions_per_uid": 2},
                       server={"max_outstanding_requests": 4})
    c = client(d, "caps", quota_bytes=16 * MiB)
    for i in range(8):
        c.allocate(f"r{i}", MiB)
    with pytest.raises(QuotaExceededError, match=r"max_regions_per_session = 8"):
        c.allocate("r8", 4096)
    c.free("r7")
    c.allocate("r7", MiB)  # freeing gives the slot back
    # Queued transfers: the slow engine (4 KiB per write, one at a time) keeps two running while the rest queue.
    handles, refused = evict_until_refused(c, [f"r{i}" for i in range(6)], "max_queued_transfers_per_session = 3")
    assert refused is not None, len(handles)
    for h in handles:
        c.wait_for_evict(h, timeout_seconds=60)
    # Unwaited handles: clean regions queue nothing long, but each handle counts until waited for.
    got, refused = evict_until_refused(c, [f"r{i % 8}" for i in range(10)], "max_unwaited_handles_per_session = 6")
    assert refused is not None, len(got)
    for h in got:
        c.wait_for_evict(h, timeout_seconds=60)
    c.evict(["r0"])  # room again once waited for
    # Sessions per uid.
    second = client(d, "caps2")
    with pytest.raises(QuotaExceededError, match="max_sessions_per_uid = 2"):
        client(d, "caps3")
    second.close()
    client(d, "caps3").close()
    c.close()


def test_outstanding_requests_per_connection_are_capped(daemon_factory):
    d = daemon_factory(slow=True, server={"max_outstanding_requests": 4}, pool={"segment_bytes": 8 * MiB})
    c = client(d, "outstanding")
    c.allocate("x", 8 * MiB)
    c.wait_for_evict(c.evict(["x"]), timeout_seconds=60)
    h = c.prefetch(["x"])  # slow: it stays in flight while the waits below pile up
    sock = c._conn._sock
    sock.sendall(b"".join(encode_frame(Kind.WAIT_PREFETCH, 900 + i, {"handle": h.number, "timeout_seconds": 60})
                          for i in range(10)))
    errors = []
    for _ in range(10):
        nbytes, _, flags, rid = HEADER.unpack(sock.recv(HEADER.size, socket.MSG_WAITALL))
        body = sock.recv(nbytes, socket.MSG_WAITALL)
        if flags & Flag.ERROR:
            errors.append((rid, body))
    assert len(errors) == 6 and all(b"max_outstanding_requests = 4" in b for _, b in errors), errors
    c.close()


def test_idle_connections_without_a_session_are_closed_or_make_room(daemon_factory):
    d = daemon_factory(server={"hello_timeout_seconds": 1.0, "max_connections_per_uid": 4})
    idle = raw_sockets(d.socket_path, 4)
    c = client(d, "real")  # the fifth connection of this uid: the oldest idle one makes room
    assert b"max_connections_per_uid = 4" in idle[0].recv(4096)
    t0 = time.monotonic()
    for s in idle[1:]:  # the others go at the HELLO deadline
        assert s.recv(4096) == b""
    assert time.monotonic() - t0 < 5
    c.ping()
    # With every connection holding a session, there is nothing to evict: a new one is refused by name.
    held = [client(d, f"held{i}") for i in range(3)]
    with pytest.raises(QuotaExceededError, match="max_connections_per_uid = 4"):
        TierClient(TierClientConfig(socket_path=d.socket_path, job_id="over", timeout_seconds=1))
    for h in held:
        h.close()
    c.close()


def test_a_real_client_gets_in_while_600_idle_connections_hold_a_512_fd_daemon(tmp_path):
    workdir = str(tmp_path)
    config = write_config(workdir, server={"socket_path": os.path.join(workdir, "d.sock")})
    log_path = os.path.join(workdir, "daemon.log")

    def limit_fds() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (512, 512))

    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "offload.cli", "daemon", "--config", config], cwd=REPO,
                                stdout=log, stderr=subprocess.STDOUT, preexec_fn=limit_fds,
                                env={**os.environ, "PYTHONPATH": child_pythonpath(REPO)})
    sock_path = os.path.join(workdir, "d.sock")
    idle: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(sock_path):
            assert proc.poll() is None and time.monotonic() < deadline, Path(log_path).read_text()
            time.sleep(0.05)
        for _ in range(600):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            try:
                s.connect(sock_path)
            except OSError:
                s.close()
                continue
            idle.append(s)
        t0 = time.monotonic()
        c = TierClient(TierClientConfig(socket_path=sock_path, job_id="real", timeout_seconds=30))
        c.allocate("x", 4096)
        c.wait_for_evict(c.evict(["x"]), timeout_seconds=20)
        c.wait_for_prefetch(c.prefetch(["x"]), timeout_seconds=20)
        took = time.monotonic() - t0
        c.close()
        assert took < 30, took
        assert proc.poll() is None
        lines = Path(log_path).read_text().count("\n")
        assert lines < 200, f"{lines} log lines"
    finally:
        for s in idle:
            s.close()
        proc.terminate()
        proc.wait(30)


def test_an_idle_connection_is_closed_and_tierclient_reattaches_by_itself(daemon_factory, tmp_path):
    d = daemon_factory(server={"idle_timeout_seconds": 1.0})
    c = client(d, "sleepy", token_dir=str(tmp_path))
    c.allocate("x", 4096)
    c.host_view("x")[:] = b"z" * 4096
    old = c._conn
    deadline = time.monotonic() + 10
    while not old.peer_closed():  # the daemon closes the connection once it has been idle for 1 s
        assert time.monotonic() < deadline, "the idle connection was not closed"
        time.sleep(0.1)
    assert [s["state"] for s in d.status()["sessions"]] == ["detached"]
    assert bytes(c.host_view("x")) == b"z" * 4096  # the mapping outlives the connection
    c.mark_dirty("x")  # the next call reattaches, transparently
    assert c._conn is not old and [s["state"] for s in d.status()["sessions"]] == ["attached"]
    c.wait_for_evict(c.evict(["x"]), timeout_seconds=20)
    c.wait_for_prefetch(c.prefetch(["x"]), timeout_seconds=20)
    assert bytes(c.host_view("x")) == b"z" * 4096
    c.close()


def test_the_held_back_count_is_the_lines_held_in_the_window_before(monkeypatch):
    """RateLimitedLog: a line logged says how many like it were held back since the last one logged, not since
    the first; a window that held none back says nothing."""
    from types import SimpleNamespace

    from daemon import admission

    now = [0.0]
    monkeypatch.setattr(admission, "time", SimpleNamespace(monotonic=lambda: now[0]))
    logged = []
    log = admission.RateLimitedLog(SimpleNamespace(warning=lambda msg, *args: logged.append(msg % args)))
    every = admission.LOG_EVERY_SECONDS
    for t, held in ((0.0, 3), (every, 1), (2 * every, 0), (3 * every, 0)):  # logged at t, `held` more before t + every
        for i in range(held + 1):
            now[0] = t + i * every / (held + 2)
            log.warning("refuse", "refused %d", int(t))
    assert logged == [
        "refused 0",
        f"refused {int(every)} (3 more like this in the last {every:.0f} s)",
        f"refused {int(2 * every)} (1 more like this in the last {every:.0f} s)",
        f"refused {int(3 * every)}",
    ]
