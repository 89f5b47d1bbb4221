"""Faults: a client SIGKILLed mid-prefetch, 1,000 bad messages, SIGTERM while I/O runs."""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import csrc.errors
from daemon.client import TierClient, TierClientConfig
from daemon.protocol import HEADER, PROTOCOL_VERSION, Flag, Kind, encode_frame
from tests.daemon.conftest import STORE

TierFullError = getattr(csrc.errors, "TierFullError", None)

REPO = Path(__file__).resolve().parents[2]

VICTIM = r"""
import sys, numpy as np
from daemon.client import TierClient, TierClientConfig
c = TierClient(TierClientConfig(socket_path=sys.argv[1], job_id="victim", rank=0, quota_bytes=16 << 20))
names = [f"r{i}" for i in range(4)]
for i, n in enumerate(names):
    c.allocate(n, 4 << 20)
    c.host_view(n)[:] = (np.arange(4 << 20, dtype=np.uint64).astype(np.uint8) + i).tobytes()
    c.mark_dirty(n)
c.wait_for_evict(c.evict(names), timeout_seconds=30)
c.prefetch(names)
print("PREFETCHING", flush=True)
import time; time.sleep(60)
from tests import child_pythonpath
"""


def _client(d, job, rank=0) -> TierClient:
    return TierClient(TierClientConfig(socket_path=d.socket_path, job_id=job, rank=rank, timeout_seconds=30))


def _wait_for(predicate, timeout_seconds: float) -> bool:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_client_killed_mid_prefetch(daemon_factory):
    d = daemon_factory(slow=True, sessions={"reattach_grace_seconds": 4.0})
    other = _client(d, "bystander")
    base = d.status()["pool"]["used_bytes"]
    swap_base = other.space.used_bytes
    victim = subprocess.Popen([sys.executable, "-c", VICTIM, d.socket_path], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": child_pythonpath(REPO)})
    try:
        line = victim.stdout.readline()
        assert line.strip() == b"PREFETCHING", victim.stderr.read().decode()
        assert d.status()["inflight"] + d.status()["queued"] >= 1  # the prefetch really is under way
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait(10)
    # The others are served meanwhile.
    other.allocate("o", 4096)
    np.frombuffer(other.host_view("o"), np.uint8)[:] = 9
    other.mark_dirty("o")
    other.wait_for_evict(other.evict(["o"]), timeout_seconds=20)
    other.wait_for_prefetch(other.prefetch(["o"]), timeout_seconds=20)
    assert (np.frombuffer(other.host_view("o"), np.uint8) == 9).all()
    # A restarted rank reattaches within the grace period and finds its data intact.
    assert _wait_for(lambda: any(s["state"] == "detached" for s in d.status()["sessions"]), 5)
    back = _client(d, "victim")
    assert back.reattached
    names = [f"r{i}" for i in range(4)]
    back.wait_for_prefetch(back.prefetch(names), timeout_seconds=20)
    for i, n in enumerate(names):
        expect = np.arange(4 << 20, dtype=np.uint64).astype(np.uint8) + i
        np.testing.assert_array_equal(np.frombuffer(back.host_view(n), np.uint8), expect)
    back.detach()
    # After the grace period the session is reclaimed and pool use returns to where it was.
    def reclaimed() -> bool:
        st = d.status()
        return [s["job_id"] for s in st["sessions"]] == ["bystander"] and st["pool"]["used_bytes"] == base
    assert _wait_for(reclaimed, 15), d.status()
    other.free("o")
    assert other.space.used_bytes == swap_base  # its extents went back too
    other.close()


def _bad_messages(rng: random.Random, n: int):
    """n malformed-but-framed requests: (bytes, request_id)."""
    out = []
    for i in range(n):
        rid = 1000 + i
        choice = i % 6
        if choice == 0:
            body = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 40)))
            out.append((HEADER.pack(len(body), Kind.ALLOCATE, 0, rid) + body, rid))
        elif choice == 1:
            out.append((encode_frame(rng.choice([0, 16, 999, 65535]), rid, {}), rid))
        elif choice == 2:
            out.append((encode_frame(Kind.ALLOCATE, rid, {"name": 5, "nbytes": "x"}), rid))
        elif choice == 3:
            out.append((encode_frame(Kind.PREFETCH, rid, {"names": [1, 2], "extra": True}), rid))
        elif choice == 4:
            out.append((encode_frame(Kind.STATS, rid, None), rid))  # no session on this connection
        else:
            body = b"[1,2,3]"
            out.append((HEADER.pack(len(body), Kind.PING, 0, rid) + body, rid))
    return out


def _read_replies(sock: socket.socket, count: int) -> list[tuple[int, int]]:
    buf, replies = b"", []
    while len(replies) < count:
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
        while len(buf) >= HEADER.size:
            nbytes, kind, flags, rid = HEADER.unpack_from(buf)
            if len(buf) < HEADER.size + nbytes:
                break
            replies.append((rid, flags))
            buf = buf[HEADER.size + nbytes:]
    return replies


def test_a_thousand_bad_messages_leave_the_daemon_and_others_alone(shared_daemon):
    d = shared_daemon
    good = _client(d, "good")
    good.allocate("g", 8192)
    np.frombuffer(good.host_view("g"), np.uint8)[:] = 77
    rng = random.Random(4)
    framed = _bad_messages(rng, 800)
    for start in range(0, len(framed), 100):  # 8 connections, 100 pipelined bad requests each
        batch = framed[start:start + 100]
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(d.socket_path)
        s.sendall(b"".join(m for m, _ in batch))
        replies = _read_replies(s, len(batch))
        s.close()
        assert [r for r, _ in replies] == [rid for _, rid in batch]  # exactly one reply each, in order
        assert all(f == Flag.REPLY | Flag.ERROR for _, f in replies)
        good.ping()
        assert (np.frombuffer(good.host_view("g"), np.uint8) == 77).all()
    for i in range(200):  # truncated frames and oversized headers, a connection each
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(d.socket_path)
        if i % 2:
            frame = encode_frame(Kind.ALLOCATE, i, {"name": "t", "nbytes": 1})
            s.sendall(frame[: rng.randint(1, len(frame) - 1)])
            s.shutdown(socket.SHUT_WR)
            assert s.recv(100) == b""  # nothing to answer: the request never arrived whole
        else:
            s.sendall(HEADER.pack(1 << 30, Kind.ALLOCATE, 0, i))
            replies = _read_replies(s, 1)
            assert replies == [(i, Flag.REPLY | Flag.ERROR)] and s.recv(100) == b""  # answered, then closed
        s.close()
    good.wait_for_evict(good.evict(["g"]), timeout_seconds=20)
    good.wait_for_prefetch(good.prefetch(["g"]), timeout_seconds=20)
    assert (np.frombuffer(good.host_view("g"), np.uint8) == 77).all()
    assert d.proc.poll() is None and d.status()["version"] == PROTOCOL_VERSION
    good.close()


def test_sigterm_drains_in_flight_io_and_exits_cleanly(daemon_factory):
    d = daemon_factory(slow=True, pool={"segment_bytes": 32 << 20})
    c = TierClient(TierClientConfig(socket_path=d.socket_path, job_id="draining", quota_bytes=32 << 20))
    c.allocate("x", 32 << 20)
    c.wait_for_evict(c.evict(["x"]), timeout_seconds=60)
    c.prefetch(["x"])
    st = d.status()
    assert st["inflight"] == 1 and st["bytes_moved"]["read"] == 0, st  # the read is under way
    assert d.stop(timeout_seconds=30) == 0
    log = d.log()
    assert "draining in-flight I/O" in log and "stopped (drained)" in log and "Traceback" not in log
    assert not os.path.exists(d.socket_path)
    c.detach()


@pytest.mark.skipif(STORE != "swap", reason="a full disk needs the real swap layer")
def test_full_disk_on_evict_is_a_clear_error_and_keeps_the_data(daemon_factory, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root here")
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(tiny)],
                           capture_output=True, text=True)
    if mount.returncode:
        pytest.skip(f"mount -t tmpfs refused: {mount.stderr.strip()}")
    try:
        d = daemon_factory(swap={"paths": [str(tiny)], "capacity_bytes": 32 << 20, "preallocate": False},
                           pool={"segment_bytes": 16 << 20})
        c = TierClient(TierClientConfig(socket_path=d.socket_path, job_id="full", quota_bytes=16 << 20))
        payload = os.urandom(12 << 20)
        c.allocate("big", len(payload))
        c.host_view("big")[:] = payload
        with pytest.raises(TierFullError) as err:
            c.wait_for_evict(c.evict(["big"]), timeout_seconds=60)
        assert "big" in str(err.value)  # names the region
        assert c.info("big").tier.name == "HOST"  # the host copy stays, still dirty
        assert bytes(c.host_view("big")) == payload
        c.free("big")
        c.ping()
        assert d.status()["sessions"][0]["stats"]["errors_total"] >= 1
        c.close()
        d.stop()
    finally:
        subprocess.run(["umount", "-l", str(tiny)], check=False)


def test_a_client_that_never_reads_its_replies_is_paused_not_buffered(shared_daemon):
    d = shared_daemon
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(d.socket_path)
    s.setblocking(False)
    frame = encode_frame(Kind.PING, 1)
    sent = 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # send until the daemon stops reading us
        try:
            sent += s.send(frame * 256)
        except BlockingIOError:
            break
    assert time.monotonic() < deadline and sent < 64 << 20  # pushed back, not swallowed without end
    good = _client(d, "meanwhile")
    good.ping()  # everyone else is served meanwhile
    good.close()
    s.close()
