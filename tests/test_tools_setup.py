"""tools/setup.sh: waits for the apt lock instead of failing, and --if-changed skips when nothing changed."""
from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _hold(path: str, seconds: float, ready) -> None:
    fd = os.open(path, os.O_RDWR)
    fcntl.lockf(fd, fcntl.LOCK_EX)  # a POSIX lock, as apt takes it
    ready.set()
    time.sleep(seconds)


def held(lock: Path, seconds: float) -> mp.Process:
    """A process holding a POSIX lock on ``lock`` for ``seconds`` (started, lock taken)."""
    lock.write_text("")
    ready = mp.Event()
    holder = mp.Process(target=_hold, args=(str(lock), seconds, ready))
    holder.start()
    assert ready.wait(10)
    return holder


def test_apt_wait_waits_for_a_held_lock_and_says_who_holds_it(tmp_path):
    lock = tmp_path / "lock-frontend"
    holder = held(lock, 2.0)
    t0 = time.monotonic()
    out = subprocess.run(["bash", str(REPO / "tools/apt-wait.sh")], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "OFL_APT_LOCKS": f"{tmp_path}/absent {lock}"})
    took = time.monotonic() - t0
    holder.join()
    assert out.returncode == 0, out.stderr
    assert f"waiting for the apt lock, held by {lock} (pid {holder.pid}" in out.stdout, out.stdout
    assert 1.0 < took < 30, took  # it waited for the holder, then went on
    free = subprocess.run(["bash", str(REPO / "tools/apt-wait.sh")], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OFL_APT_LOCKS": str(lock)})
    assert free.returncode == 0 and free.stdout == ""


def test_apt_wait_gives_up_after_its_timeout_naming_the_lock(tmp_path):
    lock = tmp_path / "lock"
    holder = held(lock, 10.0)
    out = subprocess.run(["bash", str(REPO / "tools/apt-wait.sh")], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "OFL_APT_LOCKS": str(lock), "OFL_APT_LOCK_TIMEOUT": "1"})
    holder.kill()
    holder.join()
    assert out.returncode == 1 and f"still held after 1 s: {lock}" in out.stderr, out.stderr


def test_the_setup_stamp_follows_what_setup_depends_on(tmp_path):
    for rel in ("tools/setup.sh", "pyproject.toml"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, tmp_path / rel)
    shutil.copytree(REPO / "csrc", tmp_path / "csrc", ignore=shutil.ignore_patterns("*.so", "__pycache__"))

    def stamp() -> str:
        return subprocess.run(["bash", str(tmp_path / "tools/setup.sh"), "--print-stamp"], capture_output=True,
                              text=True, check=True, timeout=60).stdout.strip()

    first = stamp()
    assert first == stamp() and len(first) == 64
    (tmp_path / "csrc" / "ofl_aio.h").write_text((tmp_path / "csrc" / "ofl_aio.h").read_text() + "\n/* x */\n")
    assert stamp() != first  # a change to the C means set-up runs again
    (tmp_path / "README.md").write_text("not a dependency")
    changed = stamp()
    assert stamp() == changed


def test_if_changed_skips_a_set_up_that_is_current():
    if not (REPO / ".venv/.setup-stamp").exists():
        pytest.skip("this checkout was not set up by tools/setup.sh")
    current = subprocess.run(["bash", str(REPO / "tools/setup.sh"), "--print-stamp"], capture_output=True, text=True,
                             timeout=60).stdout.strip()
    if (REPO / ".venv/.setup-stamp").read_text().strip() != current:
        pytest.skip("sources changed since the last set-up")
    t0 = time.monotonic()
    out = subprocess.run(["bash", str(REPO / "tools/setup.sh"), "--if-changed"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "up to date" in out.stdout and time.monotonic() - t0 < 5
