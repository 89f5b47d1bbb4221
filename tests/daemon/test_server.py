"""The daemon in its own process (TEST DOUBLE store): verbs, errors, sessions, isolation."""
from __future__ import annotations

import os
import socket
import stat
import threading
import time
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import csrc.errors
from csrc.errors import ConfigError, DaemonNotRunningError, ProtocolError, QuotaExceededError, SessionError
from daemon.client import DaemonConnection, TierClient, TierClientConfig
from daemon.protocol import PROTOCOL_VERSION, Kind
from offload.cli import main as offload_main


TIER_FULL = getattr(csrc.errors, "TierFullError", MemoryError)  # the swap layer's, where it is installed


def u8(view) -> np.ndarray:
    return np.frombuffer(view, dtype=np.uint8)


def tier(info) -> str:
    return info.tier if isinstance(info.tier, str) else info.tier.name


def stat_of(stats, name):
    return stats[name] if isinstance(stats, dict) else getattr(stats, name)


def client(d, job="job", rank=0, **kw) -> TierClient:
    return TierClient(TierClientConfig(socket_path=d.socket_path, job_id=job, rank=rank, timeout_seconds=20, **kw))


def test_verbs_move_bytes_through_shared_memory(shared_daemon):
    with client(shared_daemon, "verbs") as c:
        sizes = {"a": 1, "b": 4095, "c": 4097, "d": (1 << 20) + 3}
        data = {n: np.random.default_rng(i).integers(0, 256, s, dtype=np.uint8) for i, (n, s) in enumerate(sizes.items())}
        for n, s in sizes.items():
            info = c.allocate(n, s)
            assert info.nbytes == s and info.offset % 4096 == 0
            c.host_view(n)[:] = data[n]
            assert tier(c.info(n)) == "HOST"
            c.mark_dirty(n)
        c.wait_for_evict(c.evict(list(sizes)), timeout_seconds=10)
        c.wait_for_prefetch(c.prefetch(list(sizes)), timeout_seconds=10)
        for n in sizes:
            np.testing.assert_array_equal(u8(c.host_view(n)), data[n])
            assert tier(c.info(n)) == "HOST_AND_NVME"
        assert stat_of(c.stats(), "nvme_bytes") == sum(sizes.values())
        assert len(c.placements("d")) >= 1 and c.space.files[0].path
        c.free("a")
        with pytest.raises(ConfigError, match="no region named 'a'"):
            c.host_view("a")


def test_errors_are_raised_as_the_store_raises_them(shared_daemon):
    with client(shared_daemon, "errors") as c:
        c.allocate("x", 100)
        with pytest.raises(ConfigError, match="already exists"):
            c.allocate("x", 100)
        with pytest.raises(ConfigError, match="no region named 'nope'"):
            c.prefetch(["x", "nope"])
        with pytest.raises(ConfigError, match="no region named 'nope'"):
            c.free("nope")
        with pytest.raises(ConfigError, match="expected a handle from prefetch"):
            c.wait_for_prefetch(999, timeout_seconds=1)
        h = c.evict(["x"])
        assert tier(c.info("x")) == "IN_FLIGHT"  # until this client waits, as on a local store
        with pytest.raises(ConfigError, match="in_flight"):
            c.host_view("x")
        with pytest.raises(ConfigError, match="expected a handle from prefetch, got a evict handle"):
            c.wait_for_prefetch(h)
        c.wait_for_evict(h, timeout_seconds=10)
        assert tier(c.info("x")) == "NVME"
        with pytest.raises(ConfigError, match="prefetch it"):
            c.host_view("x")
        with pytest.raises(ValueError):
            c.report_step(-1.0)
        c.report_step(0.25)
        c.ping()


def test_no_daemon_is_a_clear_error(tmp_path):
    with pytest.raises(DaemonNotRunningError, match="no offload daemon"):
        TierClient(TierClientConfig(socket_path=str(tmp_path / "absent.sock"), job_id="j"))


def test_hello_rules(shared_daemon):
    conn = DaemonConnection(shared_daemon.socket_path, 10)
    with pytest.raises(ProtocolError, match="before HELLO"):
        conn.request(Kind.STATS)
    with pytest.raises(ProtocolError, match="version 99"):
        conn.request(Kind.HELLO, {"version": 99, "job_id": "v", "rank": 0, "quota_bytes": 0})
    conn.close()
    with client(shared_daemon, "dup") as first:
        with pytest.raises(SessionError, match="already has a session attached"):
            client(shared_daemon, "dup")
        first.ping()
    conn = DaemonConnection(shared_daemon.socket_path, 10)
    reply, fds = conn.request(Kind.HELLO, {"version": PROTOCOL_VERSION, "job_id": "h", "rank": 1, "quota_bytes": 0})
    for fd in fds:
        os.close(fd)
    with pytest.raises(SessionError, match="already has a session"):
        conn.request(Kind.HELLO, {"version": PROTOCOL_VERSION, "job_id": "h2", "rank": 1, "quota_bytes": 0})
    conn.request(Kind.BYE)
    conn.close()


def test_quotas_come_out_of_the_node_pool(shared_daemon):
    used = shared_daemon.status()["pool"]["used_bytes"]
    with pytest.raises(QuotaExceededError, match="per-session limit"):
        client(shared_daemon, "q", quota_bytes=(64 << 20) + 4096)
    with client(shared_daemon, "q", quota_bytes=8 << 20) as c:
        with pytest.raises(QuotaExceededError, match="node pool has left"):
            client(shared_daemon, "q2", quota_bytes=(64 << 20) - used - (8 << 20) + 4096)
        assert c.quota_bytes == 8 << 20
        assert shared_daemon.status()["pool"]["used_bytes"] == used + (8 << 20)
        with pytest.raises(TIER_FULL):
            c.allocate("too-big", 9 << 20)
    assert shared_daemon.status()["pool"]["used_bytes"] == used


def test_a_session_cannot_reach_another_sessions_region(shared_daemon):
    with client(shared_daemon, "owner") as a, client(shared_daemon, "intruder") as b:
        info = a.allocate("secret", 8192)
        u8(a.host_view("secret"))[:] = 0xAB
        with pytest.raises(ConfigError, match="no region named"):  # by name: names are scoped to the session
            b.host_view("secret")
        for verb in (b.prefetch, b.evict):
            with pytest.raises(ConfigError, match="no region named"):
                verb(["secret"])
        with pytest.raises(ConfigError, match="no region named"):
            b.free("secret")
        # By offset: b maps only its own segments; the same placement there is b's memory.
        b.allocate("mine", 8192)
        assert b._segments.view(info.segment_index, info.offset, 8192).tobytes() == bytes(8192)
        with pytest.raises(ProtocolError, match="not one of this session's"):
            b._segments.view(len(b._segments), 0, 1)
        # And the protocol takes no offsets or segment numbers from a client at all.
        with pytest.raises(ProtocolError, match="unknown field 'offset'"):
            b._conn.request(Kind.REGION, {"name": "secret", "view": True, "offset": info.offset})
        with pytest.raises(ProtocolError, match="unknown field 'segment_index'"):
            b._conn.request(Kind.ALLOCATE, {"name": "x", "nbytes": 1, "segment_index": 0})
        assert (u8(a.host_view("secret")) == 0xAB).all()


def test_reattach_within_grace_then_reclaim_after_it(daemon_factory):
    d = daemon_factory(sessions={"reattach_grace_seconds": 1.5})
    base = d.status()["pool"]["used_bytes"]
    c = client(d, "train", rank=3)
    c.allocate("w", 5000)
    u8(c.host_view("w"))[:] = 42
    c.mark_dirty("w")
    c.detach()
    c2 = client(d, "train", rank=3)
    assert c2.reattached and c2.session_id == c.session_id
    assert (u8(c2.host_view("w")) == 42).all()
    c2.detach()
    row = d.status()["sessions"][0]
    assert row["state"] == "detached" and row["stats"]["regions"] == 1 and row["regions_by_tier"] == {"HOST": 1}
    deadline = time.monotonic() + 10
    while d.status()["sessions"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert d.status()["sessions"] == [] and d.status()["pool"]["used_bytes"] == base
    c3 = client(d, "train", rank=3)
    assert not c3.reattached
    with pytest.raises(ConfigError, match="no region named"):
        c3.host_view("w")
    c3.close()


def test_socket_mode_status_table_and_metrics(shared_daemon, capsys):
    assert stat.S_IMODE(os.stat(shared_daemon.socket_path).st_mode) == 0o660
    with client(shared_daemon, "table", rank=5) as c:
        c.allocate("t", 4096)
        c.wait_for_evict(c.evict(["t"]), timeout_seconds=10)
        c.allocate("held", 3 << 20)  # stays in host memory
        assert offload_main(["status", "--socket", shared_daemon.socket_path]) == 0
        out = capsys.readouterr().out
        assert shared_daemon.status()["engine"] in out and "table" in out and "JOB" in out
        status = shared_daemon.status()
        text = urllib.request.urlopen(f"http://127.0.0.1:{shared_daemon.metrics_port}/metrics", timeout=10).read().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples[("offload_swap_bytes_total", (("direction", "write"), ("tier", "nvme")))] == \
        status["bytes_moved"]["write"] > 0
    assert "offload_request_seconds_bucket" in text and "offload_pinned_pool_bytes" in text
    labels = (("job", "table"), ("rank", "5"), ("uid", str(os.getuid())))
    row = next(r for r in status["sessions"] if r["job_id"] == "table")
    # The dashboard's "host memory per session" is what status shows held, beside the quota.
    assert samples[("offload_session_host_bytes", labels)] == row["stats"]["host_pool_used_bytes"] >= 3 << 20
    assert samples[("offload_session_quota_bytes", labels)] == row["quota_bytes"] == 8 << 20
    assert samples[("offload_sessions", (("state", "attached"),))] >= 1


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another uid")
def test_peer_uid_is_checked(shared_daemon):
    os.chmod(shared_daemon.workdir, 0o755)
    os.chmod(shared_daemon.socket_path, 0o666)  # let the file mode through; SO_PEERCRED must still refuse
    try:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: become nobody and try a round trip
            try:
                os.setuid(65534)
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(5)
                s.connect(shared_daemon.socket_path)
                from daemon.protocol import encode_frame
                s.sendall(encode_frame(Kind.PING, 1))
                os.write(w, b"closed" if s.recv(100) == b"" else b"answered")
            except (ConnectionResetError, BrokenPipeError):  # closed before or while we sent
                os.write(w, b"closed")
            except OSError as exc:
                os.write(w, f"error {exc}".encode())
            os._exit(0)
        os.waitpid(pid, 0)
        assert os.read(r, 100) == b"closed"
    finally:
        os.chmod(shared_daemon.socket_path, 0o660)
        os.chmod(shared_daemon.workdir, 0o700)


def test_quota_policy_wait_holds_a_hello_until_room_is_freed(daemon_factory):
    d = daemon_factory(pool={"capacity_bytes": 16 << 20}, sessions={"quota_policy": "wait", "quota_wait_seconds": 20.0})
    first = client(d, "big", quota_bytes=16 << 20)
    got = {}

    def second():
        got["client"] = client(d, "next", quota_bytes=8 << 20)
    t = threading.Thread(target=second)
    t.start()
    time.sleep(0.5)
    assert "client" not in got  # waiting for room, not refused
    first.close()
    t.join(20)
    assert got["client"].quota_bytes == 8 << 20
    got["client"].close()
