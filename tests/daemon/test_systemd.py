"""The daemon under systemd: READY=1 over NOTIFY_SOCKET once it serves (a fake notify socket stands in for
systemd), STOPPING=1 at SIGTERM, and the checks that fail in a moment made before the pool is faulted."""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import time

import pytest

from csrc.errors import ConfigError
from daemon import server as server_module
from daemon.client import daemon_status
from daemon.config import DaemonConfig, MetricsConfig, PoolConfig, ServerConfig
from daemon.notify import notify
from daemon.server import DaemonServer
from tests.daemon.conftest import start_daemon


class FakeSystemd:
    """The datagram socket systemd names in NOTIFY_SOCKET, bound at ``address`` (a path or '@abstract')."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(b"\0" + address[1:].encode() if address.startswith("@") else address)

    def next(self, timeout_seconds: float) -> dict[str, str]:
        """The next state message (fd store messages, which keep the daemon's state over a restart, are
        tests/daemon/fd_store.py's to play: their fds are closed here)."""
        self.sock.settimeout(timeout_seconds)
        while True:
            data, fds, _, _ = socket.recv_fds(self.sock, 4096, 16)
            for fd in fds:
                os.close(fd)
            fields = dict(line.split("=", 1) for line in data.decode().splitlines())
            if "FDSTORE" not in fields and "FDSTOREREMOVE" not in fields:
                return fields

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def systemd(tmp_path):
    fake = FakeSystemd(str(tmp_path / "notify"))
    yield fake
    fake.close()


def test_ready_comes_once_the_socket_serves_and_stopping_at_sigterm(systemd):
    d = start_daemon(env={"NOTIFY_SOCKET": systemd.address}, wait=False)
    try:
        ready = systemd.next(timeout_seconds=60)
        # Sent only after the pool and swap are ready and the socket is bound: STATUS answers at once, no retry.
        status = daemon_status(d.socket_path, timeout_seconds=10)
        assert ready["READY"] == "1" and d.socket_path in ready["STATUS"], ready
        assert status["pool"]["capacity_bytes"] == 64 << 20
        d.proc.send_signal(signal.SIGTERM)
        assert systemd.next(timeout_seconds=30)["STOPPING"] == "1"
        assert d.proc.wait(30) == 0
    finally:
        d.stop()
        shutil.rmtree(d.workdir, ignore_errors=True)


def test_notify_reaches_an_abstract_socket_and_is_a_no_op_without_systemd(monkeypatch):
    fake = FakeSystemd(f"@ofl-test-notify-{os.getpid()}-{time.monotonic_ns()}")
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", fake.address)
        assert notify(READY=1, STATUS="x y") is True
        assert fake.next(timeout_seconds=5) == {"READY": "1", "STATUS": "x y"}
        monkeypatch.setenv("NOTIFY_SOCKET", "/nonexistent/notify")  # logged, never raised
        assert notify(READY=1) is False
        monkeypatch.delenv("NOTIFY_SOCKET")
        assert notify(READY=1) is False
    finally:
        fake.close()


def _start_refused(tmp_path, monkeypatch, **server: object) -> tuple[str, list]:
    """Start a DaemonServer whose backend constructor only records that it was called; the start's error."""
    built: list = []
    async def fault(*args):
        built.append(args)
        pytest.fail("pool faulted")

    monkeypatch.setattr(server_module, "open_swap_backend", fault)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    metrics = server.pop("metrics_address", f"127.0.0.1:{busy.getsockname()[1]}")
    config = DaemonConfig(server=ServerConfig(socket_path=str(tmp_path / "d.sock"), **server),
                          pool=PoolConfig(capacity_bytes=64 << 20, segment_bytes=4 << 20),
                          metrics=MetricsConfig(address=metrics))
    try:
        with pytest.raises(ConfigError) as caught:
            asyncio.run(DaemonServer(config).start())
    finally:
        busy.close()
    return str(caught.value), built


def test_a_busy_metrics_port_is_reported_before_the_pool_is_faulted(tmp_path, monkeypatch):
    message, built = _start_refused(tmp_path, monkeypatch)
    assert "[metrics] address 127.0.0.1:" in message and "in use" in message, message
    assert built == []
    assert not os.path.exists(tmp_path / "d.sock")


def test_an_unknown_socket_group_is_reported_before_the_pool_is_faulted(tmp_path, monkeypatch):
    message, built = _start_refused(tmp_path, monkeypatch, socket_group="no-such-group-ofl", metrics_address="")
    assert "[server] socket_group = 'no-such-group-ofl': no such group" in message, message
    assert built == []
