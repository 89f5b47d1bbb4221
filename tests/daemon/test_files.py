"""The daemon owns its files and memory end to end: nothing left behind by a failed start or a killed
daemon, a replaced daemon's socket left alone, the pool checked against memory, made once, recycled
zeroed."""
from __future__ import annotations

import mmap
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from daemon.client import DaemonConnection, TierClient, TierClientConfig
from daemon.protocol import PROTOCOL_VERSION, Kind
from tests.daemon.conftest import REPO, STORE, write_config
from tests import child_pythonpath

MiB = 1 << 20


def files_under(directory: str) -> list[str]:
    """Every file under ``directory`` but the empty guard that serialises claims (it stays, by design)."""
    return sorted(os.path.relpath(os.path.join(root, f), directory)
                  for root, _, names in os.walk(directory) for f in names if f != ".ofl-daemon.lock")


def run_cli(config: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "offload.cli", "daemon", "--config", config], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": child_pythonpath(REPO)})


@pytest.fixture
def swap_dir():
    d = tempfile.mkdtemp(prefix="ofl-swap-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_killed_daemons_swap_file_is_swept_by_the_next_start(daemon_factory, swap_dir):
    first = daemon_factory(swap={"paths": [swap_dir]})
    c = TierClient(TierClientConfig(socket_path=first.socket_path, job_id="k", timeout_seconds=20))
    c.allocate("x", MiB)
    c.wait_for_evict(c.evict(["x"]), timeout_seconds=20)
    left = files_under(swap_dir)
    assert any(f.endswith(".bin") for f in left), left
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(10)
    assert files_under(swap_dir) == left  # a killed process removes nothing
    second = daemon_factory(swap={"paths": [swap_dir]})
    now = [f for f in files_under(swap_dir) if f.endswith(".bin")]
    assert len(now) == 1 and now[0] not in left, (left, now)  # the old file swept, the new one its own
    assert "swept" in second.log()
    second.stop()
    assert [f for f in files_under(swap_dir) if f.endswith(".bin")] == []
    c.detach()


@pytest.mark.parametrize("failure", ["metrics port taken", "socket busy", "socket directory unusable",
                                     "pool above available memory"])
def test_a_failed_start_leaves_nothing_behind(daemon_factory, swap_dir, tmp_path, failure):
    live = daemon_factory()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    tables: dict = {"swap": {"paths": [swap_dir], "capacity_bytes": 256 * MiB},
                    "server": {"socket_path": str(tmp_path / "d.sock")}}
    if failure == "metrics port taken":
        tables["metrics"] = {"address": f"127.0.0.1:{taken.getsockname()[1]}"}
    elif failure == "socket busy":
        tables["server"] = {"socket_path": live.socket_path}
    elif failure == "socket directory unusable":
        (tmp_path / "file").write_text("")
        tables["server"] = {"socket_path": str(tmp_path / "file" / "d.sock")}
    else:
        avail = int(next(line for line in Path("/proc/meminfo").read_text().splitlines()
                         if line.startswith("MemAvailable")).split()[1]) * 1024
        tables["pool"] = {"capacity_bytes": (avail * 4 // (64 * MiB) + 1) * 64 * MiB, "segment_bytes": 64 * MiB}
    workdir = tmp_path / "w"
    workdir.mkdir()
    out = run_cli(write_config(str(workdir), **tables))
    taken.close()
    assert out.returncode == 2, out.stdout + out.stderr
    assert files_under(swap_dir) == [], files_under(swap_dir)  # no swap file, lock or directory left
    if failure == "pool above available memory":
        assert "more than the memory available" in out.stderr and "MemAvailable" in out.stderr, out.stderr
    assert live.status()["version"] == PROTOCOL_VERSION  # the live daemon is untouched


def test_a_stopping_daemon_leaves_its_successors_socket_alone(daemon_factory):
    old = daemon_factory(slow=True, pool={"segment_bytes": 8 * MiB})
    c = TierClient(TierClientConfig(socket_path=old.socket_path, job_id="draining", quota_bytes=8 * MiB))
    c.allocate("x", 8 * MiB)
    c.wait_for_evict(c.evict(["x"]), timeout_seconds=60)
    c.prefetch(["x"])  # slow: the old daemon drains for a while
    old.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 20
    while True:  # once the old daemon stops listening, a new one may take the path
        try:
            DaemonConnection(old.socket_path, 1).request(Kind.PING)
        except OSError:
            break
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert old.proc.poll() is None, "the old daemon should still be draining"
    workdir = tempfile.mkdtemp(prefix="ofl-d2-", dir="/tmp")
    config = write_config(workdir, server={"socket_path": old.socket_path})
    new = subprocess.Popen([sys.executable, "-m", "offload.cli", "daemon", "--config", config], cwd=REPO,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env={**os.environ, "PYTHONPATH": child_pythonpath(REPO)})
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                DaemonConnection(old.socket_path, 1).request(Kind.PING)
                break
            except OSError:
                assert new.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
        assert old.proc.wait(60) == 0
        DaemonConnection(old.socket_path, 5).request(Kind.PING)  # the new daemon's socket is still there
    finally:
        new.terminate()
        new.wait(30)
        shutil.rmtree(workdir, ignore_errors=True)
        c.detach()


def test_the_pool_is_made_once_and_recycled_zeroed(daemon_factory):
    d = daemon_factory(pool={"capacity_bytes": 16 * MiB, "segment_bytes": 4 * MiB})
    assert "pool: 0.0 GiB ready in" in d.log() or "GiB ready in" in d.log()

    def hello() -> tuple[DaemonConnection, list[int], list[mmap.mmap]]:
        conn = DaemonConnection(d.socket_path, 20)
        reply, fds = conn.request(Kind.HELLO, {"version": PROTOCOL_VERSION, "job_id": "z", "rank": 0,
                                               "quota_bytes": 16 * MiB})
        return conn, fds, [mmap.mmap(fd, s["nbytes"]) for fd, s in zip(fds, reply["segments"])]

    conn, fds, maps = hello()
    first = {os.fstat(fd).st_ino for fd in fds}
    for m in maps:  # dirty every byte of the whole pool
        np.frombuffer(m, np.uint8)[:] = 0xEE
    conn.request(Kind.BYE)
    conn.close()
    conn, fds2, maps2 = hello()
    assert {os.fstat(fd).st_ino for fd in fds2} == first  # the same memory, not new memfds
    for m in maps2:
        assert not np.frombuffer(m, np.uint8).any()  # zeroed before reuse
    assert all(np.frombuffer(m, np.uint8).min() == 0 for m in maps)  # the old mapping sees the zeros too
    conn.request(Kind.BYE)
    for m in maps + maps2:
        m.close()
    for fd in fds + fds2:
        os.close(fd)
    conn.close()


def _free_huge_bytes() -> int:
    info = {line.split(":")[0]: line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()}
    return int(info.get("HugePages_Free", 0)) * int(info.get("Hugepagesize", 2048)) * 1024


def test_the_pool_says_which_pages_it_is_on(daemon_factory):
    d = daemon_factory()
    line = next(line for line in d.log().splitlines() if "pool: making" in line)
    assert "huge pages " in line and "(" in line  # the choice and why, e.g. "huge pages off (0 MiB ... free ...)"


@pytest.mark.skipif(_free_huge_bytes() < 64 * MiB, reason="fewer than 64 MiB of huge pages reserved (vm.nr_hugepages)")
def test_the_pool_on_reserved_huge_pages_serves_sessions(daemon_factory):
    d = daemon_factory(pool={"capacity_bytes": 64 * MiB, "segment_bytes": 4 * MiB, "huge_pages": "hugetlb"})
    assert "huge pages hugetlb" in d.log()
    c = TierClient(TierClientConfig(socket_path=d.socket_path, job_id="huge", timeout_seconds=20))
    c.allocate("x", 3 * MiB)
    payload = os.urandom(3 * MiB)
    c.host_view("x")[:] = payload
    c.wait_for_evict(c.evict(["x"]), timeout_seconds=20)
    c.wait_for_prefetch(c.prefetch(["x"]), timeout_seconds=20)
    assert bytes(c.host_view("x")) == payload
    c.close()


_FILE_EVENTS = {"os.remove", "os.rmdir", "os.listdir", "os.scandir", "open", "os.mkdir"}
_watched: list[tuple[str, str, bool]] = []  # (event, path, on the main thread) while a test watches
_watch_root: list[str] = []


def _audit(event: str, args: tuple) -> None:
    if _watch_root and event in _FILE_EVENTS and args and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.fsdecode(args[0])
        if path.startswith(_watch_root[0]):
            import threading
            _watched.append((event, path, threading.current_thread() is threading.main_thread()))


sys.addaudithook(_audit)  # audit hooks cannot be removed: it does nothing unless a test sets _watch_root


def test_the_sweep_runs_off_the_event_loop_through_aiofiles(swap_dir):
    """A killed daemon's tree is swept by SwapClaim.open on the event loop, every file operation of the sweep
    and the claim in aiofiles' worker threads (seen by an audit hook), none on the loop's thread."""
    import asyncio

    from daemon.files import SwapClaim

    stale = Path(swap_dir, "ofl-daemon-0")
    (stale / "deeper").mkdir(parents=True)
    for i in range(50):
        (stale / f"part{i}.bin").write_bytes(b"x" * 8192)
    (stale / "deeper" / "swap.bin").write_bytes(b"y" * 8192)
    Path(swap_dir, "ofl-daemon-0.lock").write_text("")  # its holder is gone: nobody holds the lock
    _watched.clear()
    _watch_root.append(swap_dir)
    try:
        claim = asyncio.run(SwapClaim.open([swap_dir]))
    finally:
        _watch_root.clear()
    removed = [path for event, path, _ in _watched if event == "os.remove"]
    assert len([p for p in removed if p.startswith(str(stale) + os.sep)]) == 51, removed
    on_loop = [(event, path) for event, path, main in _watched if main]
    assert on_loop == [], on_loop
    assert claim.dirs == [str(stale)] and os.listdir(stale) == []  # slot 0 again, its old files gone
    assert files_under(swap_dir) == ["ofl-daemon-0.lock"]
    claim.close()
    assert files_under(swap_dir) == [] and os.listdir(swap_dir) == [".ofl-daemon.lock"]


@pytest.mark.skipif(STORE != "swap", reason="needs the real swap layer in the daemon")
def test_a_missing_swap_path_is_named_with_how_to_make_it(tmp_path):
    """The README's node.toml names /nvme0/offload: where it does not exist the daemon stops at start,
    saying which path and what to do."""
    missing = tmp_path / "nvme0" / "offload"
    workdir = tmp_path / "w"
    workdir.mkdir()
    config = write_config(str(workdir))
    text = Path(config).read_text()
    start = text.index("paths = ")
    Path(config).write_text(text[:start] + f'paths = ["{missing}"]' + text[text.index("\n", start):])
    out = run_cli(config)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"swap path {missing} does not exist" in out.stderr and f"mkdir -p {missing}" in out.stderr, out.stderr
