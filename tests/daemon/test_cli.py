"""``offload daemon`` and ``offload status`` from the command line."""
from __future__ import annotations

import asyncio
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from csrc.errors import ConfigError
from daemon.config import load_config
from daemon.metrics import DaemonMetrics
from daemon.server import DaemonServer
from offload.cli import format_status, main
from tests.daemon.fake_store import FakeBackend

REPO = Path(__file__).resolve().parents[2]


def test_daemon_refuses_an_unknown_key_naming_it(tmp_path, capsys):
    config = tmp_path / "node.toml"
    config.write_text("[sessions]\nreattach_grace = 5\n")
    assert main(["daemon", "--config", str(config)]) == 2
    assert "unknown key [sessions] reattach_grace" in capsys.readouterr().err


def test_status_without_a_daemon_says_so(tmp_path, capsys):
    assert main(["status", "--socket", str(tmp_path / "none.sock")]) == 2
    assert "no offload daemon on" in capsys.readouterr().err


def test_status_table_lists_pool_swap_and_sessions():
    status = {"engine": "linux_aio", "uptime_seconds": 12.0, "metrics_address": "127.0.0.1:9464",
              "pool": {"capacity_bytes": 1 << 30, "used_bytes": 256 << 20, "held_bytes": 1 << 20},
              "swap": {"used_bytes": 5 << 20, "capacity_bytes": 20 << 20},
              "bytes_moved": {"read": 3 << 30, "write": 1 << 30}, "bytes_per_second": {"read": 2e9, "write": 2.5e9},
              "queued": 2, "inflight": 1,
              "sessions": [{"job_id": "llama", "rank": 3, "uid": 1000, "state": "detached", "quota_bytes": 256 << 20,
                            "stats": {"regions": 7, "host_bytes": 1 << 20, "nvme_bytes": 5 << 20,
                                      "in_flight_bytes": 0, "dirty_bytes": 4096, "host_pool_used_bytes": 1 << 20},
                            "regions_by_tier": {"NVME": 5, "HOST": 1, "HOST_AND_NVME": 1}}]}
    text = format_status(status)
    assert "256.0 MiB reserved by quotas of 1.0 GiB, 1.0 MiB held by regions" in text
    assert "swap        5.0 MiB used of 20.0 MiB (25%)" in text and "read 3.0 GiB (1.9 GiB/s)" in text
    row = next(line for line in text.splitlines() if line.startswith("llama"))
    assert row.split() == ["llama", "3", "1000", "detached", "256.0", "MiB", "1.0", "MiB", "7", "1.0", "MiB", "5.0",
                           "MiB", "0", "B", "4.0", "KiB", "host=1", "host_and_nvme=1", "nvme=5"]


def test_help_lists_the_subcommands():
    out = subprocess.run([sys.executable, "-m", "offload.cli", "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=60).stdout
    assert "daemon" in out and "status" in out


def test_daemon_makes_a_missing_socket_directory_and_refuses_an_unsafe_one(tmp_path):
    config = tmp_path / "node.toml"
    config.write_text(f'[server]\nsocket_path = "{tmp_path}/absent/d.sock"\n[metrics]\naddress = ""\n')
    server = DaemonServer(load_config(config), FakeBackend(str(tmp_path), 1 << 20, 1 << 20))

    async def up_and_down() -> None:
        await server.start()
        assert stat.S_IMODE(os.stat(tmp_path / "absent").st_mode) == 0o755
        assert stat.S_ISSOCK(os.stat(tmp_path / "absent" / "d.sock").st_mode)
        await server.stop()
    asyncio.run(up_and_down())
    assert not (tmp_path / "absent" / "d.sock").exists()

    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)  # anyone could put their own socket here
    config.write_text(f'[server]\nsocket_path = "{open_dir}/d.sock"\n[metrics]\naddress = ""\n')
    server = DaemonServer(load_config(config), FakeBackend(str(tmp_path), 1 << 20, 1 << 20))
    with pytest.raises(ConfigError, match="writable by every user without the sticky bit"):
        asyncio.run(server.start())


def test_a_taken_metrics_port_is_a_config_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"\[metrics\] address 127.0.0.1:{port}"):
            DaemonMetrics().serve("127.0.0.1", port)
