"""Fixtures of the swap tests: engines of each kind, and small file systems for fault tests.

The fault fixtures need a file system that really is full or read-only. Where this
process may mount (root, as in CI containers and on the dev machines), they mount a
size-limited tmpfs; elsewhere they skip and say why (a test that cannot fail is worse
than a skipped one). ``file_size_limit`` is the fault every user can make: a write
refused halfway, with no mount (see [Note: a full disk without root] in test_faults).
"""
from __future__ import annotations

import contextlib
import os
import resource
import subprocess

import pytest

from swap import IoEngineConfig, aio, open_engine

ENGINE_KINDS = ("io_uring", "linux_aio", "threads")


def make_engine(kind: str, **overrides):
    """An engine of ``kind``; skips the test where this kernel refuses that kind."""
    refused = {"io_uring": aio.io_uring_errno, "linux_aio": aio.linux_aio_errno}.get(kind, lambda: 0)()
    if refused:
        pytest.skip(f"this kernel refuses {kind}: {os.strerror(refused)}")
    config = dict(kind=kind, block_size_bytes=256 << 10, queue_depth=8, num_threads=2)
    config.update(overrides)
    return open_engine(IoEngineConfig(**config))


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """Limit this process's writes to below file offset ``nbytes`` (RLIMIT_FSIZE) while inside.

    The kernel then cuts a write that crosses the limit short and refuses one that starts
    at or past it with EFBIG (Python ignores the SIGXFSZ that comes with it). The limit is
    per process: the engines' threads and io_uring's workers obey it too."""
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    if old[1] != resource.RLIM_INFINITY and old[1] < nbytes:
        pytest.skip(f"the hard RLIMIT_FSIZE here ({old[1]} bytes) is below the {nbytes} this test needs")
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)


@pytest.fixture(params=ENGINE_KINDS)
def engine(request):
    e = make_engine(request.param)
    yield e
    e.close()


def _mount_tmpfs(target: str, options: str) -> str | None:
    """Mount a tmpfs at ``target``; None on success, else why not."""
    if os.geteuid() != 0:
        return "mounting a size-limited tmpfs needs root here"
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", target],
                          capture_output=True, text=True)
    if proc.returncode:
        return f"mount -t tmpfs refused: {proc.stderr.strip()}"
    return None


@pytest.fixture
def tiny_fs(tmp_path):
    """A directory on an 8 MiB tmpfs (the full-disk tests)."""
    target = tmp_path / "tiny"
    target.mkdir()
    why = _mount_tmpfs(str(target), "size=8m,mode=0700")
    if why:
        pytest.skip(why)
    yield target
    subprocess.run(["umount", "-l", str(target)], check=False)


@pytest.fixture
def readonly_dir(tmp_path):
    """A directory in which nothing can be created, even by root."""
    target = tmp_path / "ro"
    target.mkdir()
    mounted = _mount_tmpfs(str(target), "ro,size=1m") is None
    if not mounted:
        os.chmod(target, 0o555)
    try:
        probe = target / "probe"
        try:
            probe.write_bytes(b"x")
        except OSError:
            pass
        else:
            probe.unlink()
            pytest.skip("cannot make a read-only directory here (not root, and permissions do not bind)")
        yield target
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(target)], check=False)
        else:
            os.chmod(target, 0o755)
