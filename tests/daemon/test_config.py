"""daemon.config: TOML tables to dataclasses, unknown keys named, flags winning."""
from __future__ import annotations

import pytest

from csrc.errors import ConfigError
from daemon.config import DaemonConfig, load_config

TOML = """
[server]
socket_path = "/tmp/x.sock"
socket_mode = 0o660

[pool]
capacity_bytes = 1073741824
segment_bytes = 67108864

[sessions]
reattach_grace_seconds = 5.0

[swap]
paths = ["/tmp/a", "/tmp/b"]

[io]
queue_depth = 32

[metrics]
address = "127.0.0.1:9500"
"""


def test_file_is_read_into_each_component(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text(TOML)
    c = load_config(path)
    assert c.server.socket_path == "/tmp/x.sock" and c.server.socket_mode == 0o660
    assert c.pool.capacity_bytes == 1 << 30 and c.pool.segment_bytes == 64 << 20
    assert c.sessions.reattach_grace_seconds == 5.0
    assert c.swap == {"paths": ["/tmp/a", "/tmp/b"]}
    assert c.io == {"queue_depth": 32} and c.store == {}
    assert c.metrics.host_port == ("127.0.0.1", 9500)


def test_flags_override_the_file(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text(TOML)
    c = load_config(path, {"pool.capacity_bytes": 4096 * 10, "swap.paths": ["/tmp/c"], "metrics.address": None})
    assert c.pool.capacity_bytes == 40960 and c.swap["paths"] == ["/tmp/c"]
    assert c.metrics.address == "127.0.0.1:9500"  # None means the flag was not given


def test_defaults_without_a_file():
    assert load_config(None) == DaemonConfig()


@pytest.mark.parametrize("text, match", [
    ("[pool]\ncapacty_bytes = 1\n", r"unknown key \[pool\] capacty_bytes"),
    ("[pools]\ncapacity_bytes = 1\n", r"unknown table \[pools\]"),
    ("[pool]\nsegment_bytes = 1000\n", "segment_bytes must be a multiple of 4096"),
    ("[pool]\ncapacity_bytes = -1\n", "capacity_bytes must be a positive number"),
    ("[metrics]\naddress = \"nowhere\"\n", "address must be host:port"),
    ("[server]\nsocket_mode = 0o7777\n", "socket_mode"),
    ("pool = 3\n", r"\[pool\] must be a table"),
    ("[pool\n", "node.toml"),
])
def test_bad_files_name_the_problem(tmp_path, text, match):
    path = tmp_path / "node.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "absent.toml")


def test_swap_tables_are_checked_against_the_swap_configs(tmp_path):
    swap = pytest.importorskip("swap")
    if not hasattr(swap, "IoEngineConfig"):
        pytest.skip("the swap layer is not installed")
    path = tmp_path / "node.toml"
    path.write_text("[io]\nqueue_dept = 3\n")
    with pytest.raises(ConfigError, match=r"unknown key \[io\] queue_dept"):
        load_config(path)


@pytest.mark.parametrize("value, expected", [('"offload"', "offload"), ("4242", "4242"), ('""', "")])
def test_socket_group_is_a_name_or_a_number(tmp_path, value, expected):
    path = tmp_path / "node.toml"
    path.write_text(f'[server]\nsocket_path = "/tmp/x.sock"\nsocket_group = {value}\n')
    assert load_config(path).server.socket_group == expected
    assert DaemonConfig().server.socket_group == ""  # by default nobody is let in for a group
