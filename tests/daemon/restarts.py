"""A daemon that can be stopped or killed and started again as systemd restarts a service with an fd store:
``RestartableDaemon`` runs the real daemon (``offload daemon``) through ``FdStore`` (``fd_store.py``), which
plays systemd's fd store, so each start gets what the one before kept (LISTEN_FDS)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from csrc.errors import DaemonNotRunningError
from tests import child_pythonpath
from tests.daemon.conftest import REPO, DaemonProcess, write_config
from tests.daemon.fd_store import FdStore


class RestartableDaemon(DaemonProcess):
    """One daemon config, started again and again; ``proc`` is the running one (``status``, ``metrics_port``
    and ``log`` are ``DaemonProcess``'s)."""

    def __init__(self, fd_store: bool = True, keep: str | None = None, **tables: dict) -> None:
        """``keep``: ``[server] keep_state`` ("fd_store", "state_dir": in the work directory, "off"); None:
        "fd_store" or "off" as ``fd_store`` says."""
        self.workdir = tempfile.mkdtemp(prefix="ofl-r-", dir="/tmp")  # short: AF_UNIX paths are <= 107 bytes
        keep = keep or ("fd_store" if fd_store else "off")
        server = {"keep_state": keep, **tables.pop("server", {})}
        if keep == "state_dir":
            server.setdefault("state_dir", os.path.join(self.workdir, "state"))
        self.config = write_config(self.workdir, server=server, **tables)
        self.socket_path = os.path.join(self.workdir, "d.sock")
        self.log_path = os.path.join(self.workdir, "daemon.log")
        self.store = FdStore(self.workdir)
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_seconds: float = 60.0) -> "RestartableDaemon":
        env = {**os.environ, "PYTHONPATH": child_pythonpath(REPO), **self.store.env()}
        with open(self.log_path, "ab") as log:
            self.proc = self.store.spawn([sys.executable, "-m", "offload.cli", "daemon", "--config", self.config],
                                         env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        deadline = time.monotonic() + timeout_seconds
        while True:
            try:
                self.status()
                return self
            except (DaemonNotRunningError, OSError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"daemon did not start:\n{self.log()}") from None
                time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL: the daemon dies wherever it is."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def term(self, timeout_seconds: float = 60.0) -> int:
        """SIGTERM, as ``systemctl restart`` stops it: drained, journaled, exits."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_seconds)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.store.close()
        shutil.rmtree(self.workdir, ignore_errors=True)
