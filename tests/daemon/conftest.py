"""Fixtures: a daemon in its own process, cleaned up after.

The daemon serves the real swap layer (``offload daemon --config``) where the swap
package is installed, else the TEST DOUBLE store (``daemon_proc.py``). ``slow=True``
makes transfers take long enough to kill a client or stop the daemon mid-prefetch:
a 1 s delay in the double, a 4 KiB-block, depth-1 thread engine on the real store.
"""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from csrc.errors import DaemonNotRunningError
from daemon.client import daemon_status
from tests import child_pythonpath

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def have_swap() -> bool:
    try:
        import swap
    except ImportError:
        return False
    return hasattr(swap, "TierStore")


STORE = "swap" if have_swap() else "test-double"


@dataclass
class DaemonProcess:
    proc: subprocess.Popen
    socket_path: str
    workdir: str
    log_path: str

    def status(self) -> dict:
        return daemon_status(self.socket_path, timeout_seconds=10.0)

    @property
    def metrics_port(self) -> int:
        return int(self.status()["metrics_address"].rpartition(":")[2])

    def log(self) -> str:
        return Path(self.log_path).read_text()

    def stop(self, timeout_seconds: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_seconds)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def write_config(workdir: str, swap_paths: int = 1, **tables: dict) -> str:
    base = {
        "server": {"socket_path": os.path.join(workdir, "d.sock"), "drain_timeout_seconds": 20.0},
        "pool": {"capacity_bytes": 64 << 20, "segment_bytes": 4 << 20},
        "sessions": {"default_quota_bytes": 8 << 20, "reattach_grace_seconds": 30.0},
        "metrics": {"address": "127.0.0.1:0"},
    }
    if STORE == "swap":
        dirs = [os.path.join(workdir, f"swap{i}") for i in range(swap_paths)]
        for d in dirs:
            os.makedirs(d, exist_ok=True)
        base["swap"] = {"paths": dirs, "capacity_bytes": 256 << 20}
    for name, values in tables.items():
        base.setdefault(name, {}).update(values)
    lines = []
    for name, values in base.items():
        lines.append(f"[{name}]")
        for key, value in values.items():
            text = ("true" if value else "false") if isinstance(value, bool) else repr(value).replace("'", '"')
            lines.append(f"{key} = {text}")
    path = os.path.join(workdir, "node.toml")
    Path(path).write_text("\n".join(lines) + "\n")
    return path


def start_daemon(slow: bool = False, swap_paths: int = 1, env: dict | None = None, wait: bool = True,
                 **tables: dict) -> DaemonProcess:
    """A daemon process on a fresh config; with ``wait``, once it answers STATUS."""
    workdir = tempfile.mkdtemp(prefix="ofl-d-", dir="/tmp")  # short: AF_UNIX paths are <= 107 bytes
    atexit.register(shutil.rmtree, workdir, True)  # after the run: tests read a stopped daemon's log
    if slow and STORE == "swap":
        tables.setdefault("io", {}).update(kind="threads", block_size_bytes=4096, queue_depth=1, num_threads=1)
    config = write_config(workdir, swap_paths, **tables)
    log_path = os.path.join(workdir, "daemon.log")
    if STORE == "swap":
        cmd = [sys.executable, "-m", "offload.cli", "daemon", "--config", config]
    else:
        cmd = [sys.executable, str(HERE / "daemon_proc.py"), "--config", config, "--swap-dir", workdir,
               "--read-delay-seconds", "1.0" if slow else "0"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": child_pythonpath(REPO), **(env or {})})
    d = DaemonProcess(proc, os.path.join(workdir, "d.sock"), workdir, log_path)
    if not wait:
        return d
    deadline = time.monotonic() + 30
    while True:
        try:
            d.status()
            return d
        except (DaemonNotRunningError, OSError):
            if proc.poll() is not None or time.monotonic() > deadline:
                d.stop()
                log_text = Path(log_path).read_text()  # before the directory holding it goes
                shutil.rmtree(workdir, ignore_errors=True)
                raise RuntimeError(f"daemon did not start:\n{log_text}")
            time.sleep(0.05)


@pytest.fixture(scope="session", autouse=True)
def token_dir():
    """TierClients of the tests keep their reattach tokens here, not in this uid's real runtime directory."""
    directory = tempfile.mkdtemp(prefix="ofl-tokens-", dir="/tmp")
    old = os.environ.get("XDG_RUNTIME_DIR")
    os.environ["XDG_RUNTIME_DIR"] = directory
    yield directory
    if old is None:
        os.environ.pop("XDG_RUNTIME_DIR", None)
    else:
        os.environ["XDG_RUNTIME_DIR"] = old
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def daemon_factory():
    started: list[DaemonProcess] = []

    def make(**kwargs) -> DaemonProcess:
        d = start_daemon(**kwargs)
        started.append(d)
        return d

    yield make
    for d in started:
        d.stop()
        shutil.rmtree(d.workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def shared_daemon():
    d = start_daemon()
    yield d
    d.stop()
    shutil.rmtree(d.workdir, ignore_errors=True)
