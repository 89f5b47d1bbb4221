"""How a script's end ends its job (issue 41): a normal end without close() finishes it (the swap files go,
the daemon session is dropped, and the next run starts fresh: [Note: close at exit] in offload.engine); a
kill leaves the session to resume from, unless the next start asks for a fresh one (offload.resume); the swap
directories of dead engines are swept by the next engine on that path, never a live one's ([Note: engine swap
directories] in offload.runtime.swap_dirs)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests import child_pythonpath
from tests.daemon.conftest import STORE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "offload", "exit_worker.py")


def _env(socket=None, **extra):
    env = dict(os.environ, PYTHONPATH=child_pythonpath(ROOT), OMP_NUM_THREADS="1", **extra)
    env.pop("OFFLOAD_DAEMON_SOCKET", None)
    env.pop("OFFLOAD_RESUME", None)
    if socket:
        env["OFFLOAD_DAEMON_SOCKET"] = socket
    return {**env, **extra}


def _run(workdir, device, end, *, steps=3, socket=None, **extra):
    return subprocess.run([sys.executable, WORKER, device, str(workdir), str(steps), end],
                          env=_env(socket, **extra), capture_output=True, text=True, timeout=180)


def _started(workdir) -> list[int]:
    return [int(line) for line in (workdir / "started.txt").read_text().split()]


def _swap_dirs(workdir) -> list[str]:
    return sorted(n for n in os.listdir(workdir) if n.startswith("offload-rank"))


@pytest.mark.parametrize("end", ["normal", "raise"])
def test_a_script_that_ends_without_close_leaves_no_swap_files(tmp_path, end):
    proc = _run(tmp_path, "nvme", end)
    assert proc.returncode == (0 if end == "normal" else 1), proc.stderr[-3000:]
    assert "swap " + str(tmp_path) in proc.stdout  # it had a swap directory there
    assert _swap_dirs(tmp_path) == []


def test_a_killed_engines_swap_files_are_swept_by_the_next_one_and_a_live_ones_are_not(tmp_path):
    live = subprocess.Popen([sys.executable, WORKER, "nvme", str(tmp_path), "1", "hold"], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert live.stdout.readline().startswith("swap ")
        assert live.stdout.readline().strip() == "held"
        held = _swap_dirs(tmp_path)
        killed = _run(tmp_path, "nvme", "kill")
        assert killed.returncode == -signal.SIGKILL
        dead = [n for n in _swap_dirs(tmp_path) if n not in held]
        assert len(dead) == 1 and any(n.endswith(".bin") for n in os.listdir(tmp_path / dead[0]))
        proc = _run(tmp_path, "nvme", "normal")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"removed {tmp_path / dead[0]}" in proc.stderr
        assert _swap_dirs(tmp_path) == held  # the dead one swept, the live one kept with its swap file
        assert any(n.endswith(".bin") for n in os.listdir(tmp_path / held[0]))
    finally:
        live.kill()
        live.wait(30)
    assert _run(tmp_path, "nvme", "normal").returncode == 0
    assert _swap_dirs(tmp_path) == []  # now dead, it is swept too


@pytest.mark.skipif(STORE != "swap", reason="needs the real swap layer in the daemon")
@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_a_script_run_twice_through_the_daemon_starts_fresh_the_second_time(tmp_path, daemon, device):
    for _ in range(2):
        proc = _run(tmp_path, device, "normal", socket=daemon.socket_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "resumed" not in proc.stderr
        assert daemon.status()["sessions"] == []  # its end finished the job
    assert _started(tmp_path) == [0, 0]


@pytest.mark.skipif(STORE != "swap", reason="needs the real swap layer in the daemon")
@pytest.mark.parametrize("end", ["kill", "raise"])
def test_a_killed_or_crashed_script_resumes_and_one_asked_to_start_fresh_does(tmp_path, daemon, end):
    first = _run(tmp_path, "nvme", end, socket=daemon.socket_path)
    assert first.returncode != 0
    assert [s["job_id"] for s in daemon.status()["sessions"]] == ["exit-test"]  # kept for a restart
    second = _run(tmp_path, "nvme", "normal", socket=daemon.socket_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from the daemon at step 3" in second.stderr and "OFFLOAD_RESUME=never" in second.stderr
    third = _run(tmp_path, "nvme", "kill", socket=daemon.socket_path)
    assert third.returncode == -signal.SIGKILL
    fresh = _run(tmp_path, "nvme", "normal", socket=daemon.socket_path, OFFLOAD_RESUME="never")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert "dropped (offload.resume \"never\"): starting fresh" in fresh.stderr
    assert _started(tmp_path) == [0, 3, 0, 0]  # the second ended normally: the third began afresh
    assert daemon.status()["sessions"] == []
