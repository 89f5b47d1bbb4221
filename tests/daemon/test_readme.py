"""The README's daemon commands, run verbatim in bash after the set-up's `source .venv/bin/activate` (the
venv that runs these tests), on a node.toml for this machine; and the README's own node.toml loads."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemon.config import load_config
from tests import child_pythonpath
from tests.daemon.conftest import REPO, write_config

README = (REPO / "README.md").read_text()


def _blocks(text: str, lang: str = "") -> list[str]:
    """The fenced blocks of ``text`` tagged ``lang`` ("" for untagged), fences paired in order."""
    blocks, current, tag = [], None, ""
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current, tag = [], line[3:].strip()
            else:
                if tag == lang:
                    blocks.append("\n".join(current) + "\n")
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def _daemon_block() -> list[str]:
    block = next(b for b in _blocks(README) if "offload daemon --config node.toml" in b)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def test_the_readme_says_how_offload_gets_on_path_before_using_it():
    activate = README.index("source .venv/bin/activate")
    first_use = min(m.start() for m in re.finditer(r"^offload \w", README, flags=re.M))
    assert activate < first_use
    assert _daemon_block()[0] == "source .venv/bin/activate"


def test_the_readmes_node_toml_loads(tmp_path):
    toml = next(b for b in _blocks(README, "toml") if "[server]" in b)
    (tmp_path / "node.toml").write_text(toml)
    config = load_config(tmp_path / "node.toml")
    assert config.server.socket_path == "/run/offload/daemon.sock" and config.pool.capacity_bytes == 16 << 30


def test_the_readmes_daemon_commands_run_verbatim(tmp_path):
    activate = Path(sys.prefix) / "bin" / "activate"
    if not (Path(sys.prefix) / "bin" / "offload").exists():
        pytest.skip(f"no offload command in {sys.prefix} (pip install -e .)")
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"ofl-readme-{os.getpid()}"  # a short AF_UNIX path
    workdir.mkdir()
    write_config(str(workdir))
    env = {**os.environ, "PYTHONPATH": child_pythonpath(REPO)}
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = ":".join(p for p in env["PATH"].split(":") if not p.startswith(sys.prefix))  # not on PATH yet
    setup, start, *rest = _daemon_block()
    assert subprocess.run(["bash", "-c", "command -v offload"], env=env, capture_output=True).returncode != 0

    def shell(line: str, **kw) -> subprocess.CompletedProcess | subprocess.Popen:
        script = f"{setup.replace('.venv/bin/activate', str(activate))} && {line}"
        return subprocess.run(["bash", "-c", script], cwd=workdir, env=env, capture_output=True, text=True,
                              timeout=60, **kw)

    assert start.endswith("&")
    daemon = subprocess.Popen(["bash", "-c", f"source {activate} && exec {start.rstrip('&').strip()}"],
                              cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while (out := shell(rest[0])).returncode != 0:  # offload status --config node.toml
            assert daemon.poll() is None and time.monotonic() < deadline, (out.stderr, daemon.stdout.read())
            time.sleep(0.2)
        assert "engine" in out.stdout and "pool" in out.stdout, out.stdout
        for line in rest[1:]:
            out = shell(line)
            assert out.returncode == 0, (line, out.stderr)
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(60) == 0
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait(10)
        subprocess.run(["rm", "-rf", str(workdir)])
