"""What an operator runs and reads: the systemd unit, the CLI, Prometheus, /healthz, the metrics server's bounds."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon.client import TierClient, TierClientConfig
from daemon.metrics import DaemonMetrics
from tests.daemon.conftest import REPO
from tests import child_pythonpath

MiB = 1 << 20


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "offload.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": child_pythonpath(REPO)})


def get(port: int, path: str, timeout: float = 10) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is absent")
def test_the_systemd_unit_verifies(tmp_path):
    unit = (REPO / "tools/systemd/offload-daemon.service").read_text()
    lines = set(unit.splitlines())
    for key in ("LimitMEMLOCK=infinity", "RuntimeDirectory=offload", "KillSignal=SIGTERM", "Type=notify",
                "User=offload", "Group=offload"):
        assert key in lines, key
    assert not any(line.startswith("PrivateTmp=") for line in lines)  # it would hide a socket under /tmp
    offload = Path(sys.executable).parent / "offload"  # the unit names /opt/offload's; verify it with ours
    if not offload.exists():
        pytest.skip(f"{offload} is not installed (pip install -e .)")
    (tmp_path / "offload-daemon.service").write_text(unit.replace("/opt/offload/.venv/bin/offload", str(offload)))
    out = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "offload-daemon.service")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "offload-daemon.service" not in out.stderr, out.stderr
    # The node.toml beside it is a valid config.
    from daemon.config import load_config
    server = load_config(REPO / "tools/systemd/node.toml").server
    assert server.socket_path == "/run/offload/daemon.sock"  # in the unit's RuntimeDirectory
    assert (server.socket_group, server.socket_mode) == ("offload", 0o660)


def test_version_and_case_insensitive_log_levels(tmp_path):
    out = cli("--version")
    assert out.returncode == 0 and out.stdout.startswith("offload "), out
    config = tmp_path / "node.toml"
    config.write_text("[pool]\ncapacty_bytes = 1\n")
    for level in ("debug", "DEBUG", "Warning"):
        out = cli("daemon", "--log-level", level, "--config", str(config))
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert "unknown key [pool] capacty_bytes" in out.stderr
    out = cli("daemon", "--log-level", "loud", "--config", str(config))
    assert out.returncode == 2 and "unknown log level 'loud'" in out.stderr and "Traceback" not in out.stderr


def test_status_from_the_config_file_with_swap_held_bytes_and_escaped_job_ids(daemon_factory):
    d = daemon_factory()
    c = TierClient(TierClientConfig(socket_path=d.socket_path, job_id="evil\x1b[2J\nFAKE ROW", timeout_seconds=20))
    c.allocate("x", 3 * MiB)
    c.wait_for_evict(c.evict(["x"]), timeout_seconds=20)
    out = cli("status", "--config", os.path.join(d.workdir, "node.toml"))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "\x1b" not in text and "\nFAKE ROW" not in text and "evil\\x1b[2J\\x0aFAKE ROW" in text, text
    status = d.status()
    assert f"swap        {status['swap']['used_bytes'] / MiB:.1f} MiB used of" in text
    assert "reserved by quotas" in text and "held by regions" in text
    row = next(line for line in text.splitlines() if line.startswith("evil"))
    assert row.split()[2:4] == ["0", str(os.getuid())]  # after "evil...FAKE ROW": rank, uid
    assert status["pool"]["held_bytes"] == 0 and status["pool"]["used_bytes"] == c.quota_bytes  # evicted: held 0
    c.close()


def test_prometheus_exports_what_operators_alert_on(daemon_factory):
    d = daemon_factory()
    c = TierClient(TierClientConfig(socket_path=d.socket_path, job_id="prom", timeout_seconds=20))
    c.allocate("x", 2 * MiB)
    c.wait_for_evict(c.evict(["x"]), timeout_seconds=20)
    code, text = get(d.metrics_port, "/metrics")
    assert code == 200
    assert "_created" not in text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    swap = d.status()["swap"]
    assert samples[("offload_swap_space_bytes", (("state", "used"),))] == swap["used_bytes"] > 0
    assert samples[("offload_swap_space_bytes", (("state", "capacity"),))] == swap["capacity_bytes"]
    assert ("offload_in_flight_bytes", ()) in samples
    build = [k for k in samples if k[0] == "offload_build_info"]
    assert len(build) == 1 and dict(build[0][1])["protocol"] == str(d.status()["version"])
    assert samples[("process_open_fds", ())] > 0 and ("process_resident_memory_bytes", ()) in samples
    assert get(d.metrics_port, "/healthz") == (200, "ok\n")
    assert get(d.metrics_port, "/nope")[0] == 404
    c.close()


def test_healthz_reports_a_stalled_loop_and_a_stopping_daemon(daemon_factory):
    m = DaemonMetrics()
    m.heartbeat()
    assert m.health(10.0) == (True, "ok")
    m._heartbeat -= 30  # as if the loop had not run for 30 s
    ok, why = m.health(10.0)
    assert not ok and "event loop stalled for 30" in why
    d = daemon_factory(slow=True, pool={"segment_bytes": 4 * MiB})
    port = d.metrics_port
    c = TierClient(TierClientConfig(socket_path=d.socket_path, job_id="drain", quota_bytes=4 * MiB))
    c.allocate("x", 4 * MiB)
    c.wait_for_evict(c.evict(["x"]), timeout_seconds=60)
    c.prefetch(["x"])  # slow: the daemon is still draining it when we ask
    d.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while get(port, "/healthz")[0] == 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert get(port, "/healthz") == (503, "stopping\n")
    assert d.proc.wait(60) == 0
    c.detach()


def test_half_sent_scrapes_cannot_exhaust_the_daemon_or_lock_out_prometheus(daemon_factory):
    d = daemon_factory(metrics={"address": "127.0.0.1:0", "timeout_seconds": 2.0})
    port = d.metrics_port
    threads_before = len(os.listdir(f"/proc/{d.proc.pid}/task"))
    half = []
    for _ in range(250):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # and never the blank line that ends it
        half.append(s)
    time.sleep(0.5)
    threads = len(os.listdir(f"/proc/{d.proc.pid}/task"))
    assert threads <= threads_before + 2 * 8 + 2, (threads_before, threads)  # a request and its timer, 8 slots
    t0 = time.monotonic()
    code, text = get(port, "/metrics", timeout=10)  # a real scrape still gets through
    assert code == 200 and "offload_swap_bytes_total" in text and time.monotonic() - t0 < 5
    time.sleep(2.5)  # past timeout_seconds: every half-sent request has been cut off
    for s in half:  # each was closed by the daemon: refused, cut to make room, or cut at its timeout
        s.settimeout(5)
        try:
            assert s.recv(100) == b""
        except ConnectionResetError:
            pass
        s.close()
    assert d.status()["version"] >= 1 and d.proc.poll() is None


def test_alert_rules_are_valid_and_use_exported_metrics():
    import re

    text = (REPO / "tools/prometheus/offload-alerts.yml").read_text()
    exported = {m.name for m in DaemonMetrics().registry.collect()}
    for name in re.findall(r"\b(?:offload|process)_[a-z_]+", text):
        assert re.sub(r"_(total|bucket|count|sum)$", "", name) in exported, name
    if shutil.which("promtool") is None:
        pytest.skip("promtool is absent")
    out = subprocess.run(["promtool", "check", "rules", str(REPO / "tools/prometheus/offload-alerts.yml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_status_imports_neither_torch_nor_the_daemons_server(shared_daemon):
    """`offload status` answers in a fraction of a second: torch's import alone takes 2-5 s on a loaded node."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "offload.cli", "status", "--socket",
                          shared_daemon.socket_path], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": child_pythonpath(REPO)})
    assert out.returncode == 0 and "engine" in out.stdout, out.stderr[-2000:]
    imported = {line.rpartition("|")[2].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    heavy = sorted(m for m in imported if m.split(".")[0] in ("torch", "numpy", "swap", "aiofiles")
                   or m in ("daemon.server", "daemon.metrics", "daemon.backend", "importlib.metadata"))
    assert heavy == [], heavy
