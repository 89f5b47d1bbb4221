"""The shared-memory boundary: what a client does to its own fds or mappings cannot fault the daemon."""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from daemon.client import TierClient, TierClientConfig
from tests import child_pythonpath

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

REPO = Path(__file__).resolve().parents[2]

# A hostile client in its own process: it keeps the segment fds the HELLO reply carried,
# shrinks them, asks for an evict and a flush of what it wrote there, then tries to grow and unseal them.
HOSTILE = r"""
import errno, mmap, os, sys
from daemon.client import DaemonConnection
from daemon.protocol import PROTOCOL_VERSION, Kind
conn = DaemonConnection(sys.argv[1], 30)
reply, fds = conn.request(Kind.HELLO, {"version": PROTOCOL_VERSION, "job_id": "hostile", "rank": 0,
                                       "quota_bytes": 0})
import fcntl
print("SEALS", fcntl.fcntl(fds[0], fcntl.F_GET_SEALS), flush=True)
region = conn.request(Kind.ALLOCATE, {"name": "r", "nbytes": 1 << 20})[0]["region"]
m = mmap.mmap(fds[region["segment_index"]], reply["segments"][region["segment_index"]]["nbytes"])
m[region["offset"]:region["offset"] + (1 << 20)] = b"\x5a" * (1 << 20)
conn.request(Kind.MARK_DIRTY, {"name": "r"})
def attempt(what, call):
    for fd in fds:
        try:
            call(fd)
            print(what, "ALLOWED", flush=True)
        except OSError as exc:
            print(what, errno.errorcode[exc.errno], flush=True)
attempt("shrink", lambda fd: os.ftruncate(fd, 0))
try:
    h = conn.request(Kind.EVICT, {"names": ["r"]})[0]["handle"]
    conn.request(Kind.WAIT_EVICT, {"handle": h, "timeout_seconds": 30}, wait_seconds=30)
    conn.request(Kind.FLUSH, wait_seconds=None)
    h = conn.request(Kind.PREFETCH, {"names": ["r"]})[0]["handle"]
    conn.request(Kind.WAIT_PREFETCH, {"handle": h, "timeout_seconds": 30}, wait_seconds=30)
    print("IO OK", flush=True)
except Exception as exc:
    print("IO FAILED", type(exc).__name__, exc, flush=True)
attempt("grow", lambda fd: os.ftruncate(fd, 1 << 30))
attempt("unseal", lambda fd: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, 0))
"""


def test_a_client_cannot_truncate_its_segments_under_the_daemon(daemon_factory):
    d = daemon_factory()
    bystander = TierClient(TierClientConfig(socket_path=d.socket_path, job_id="bystander", timeout_seconds=30))
    bystander.allocate("b", 4096)
    np.frombuffer(bystander.host_view("b"), np.uint8)[:] = 7
    out = subprocess.run([sys.executable, "-c", HOSTILE, d.socket_path], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": child_pythonpath(REPO)})
    lines = out.stdout.splitlines()
    assert d.proc.poll() is None, f"daemon died with {d.proc.returncode}:\n{d.log()[-3000:]}"
    assert "IO OK" in lines, out.stdout + out.stderr
    assert f"SEALS {SEALS}" in lines, out.stdout + out.stderr
    assert "shrink EPERM" in lines and "grow EPERM" in lines and "unseal EPERM" in lines, out.stdout
    # The bystander is served as before, its bytes intact.
    bystander.wait_for_evict(bystander.evict(["b"]), timeout_seconds=30)
    bystander.wait_for_prefetch(bystander.prefetch(["b"]), timeout_seconds=30)
    assert (np.frombuffer(bystander.host_view("b"), np.uint8) == 7).all()
    bystander.close()


def test_host_pool_segments_are_sealed_before_anyone_sees_them():
    from swap import HostPool, HostPoolConfig

    with HostPool(HostPoolConfig(capacity_bytes=2 << 20, segment_bytes=1 << 20)) as pool:
        for seg in pool.segments:
            assert fcntl.fcntl(seg.fd, fcntl.F_GET_SEALS) == SEALS
            try:
                os.ftruncate(seg.fd, 0)
            except PermissionError:
                pass
            else:
                raise AssertionError("a sealed segment was truncated")
            assert os.fstat(seg.fd).st_size == 1 << 20
