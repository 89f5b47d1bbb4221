"""The embedded store's swap directories under an ``nvme_path``: one per engine, held by a lock, and a sweep.

[Note: engine swap directories] An engine that offloads to NVMe without a daemon keeps its swap file in
``<nvme_path>/offload-rank<r>-<random>/``, and holds an exclusive ``flock`` on ``owner.lock`` inside it for
its whole life (taken before the directory gets that name: it is made as ``.offload-claim-<random>`` and
renamed once locked, so a sweep never sees it unlocked). ``Engine.close`` (or the interpreter's exit: [Note: close at exit] in offload.engine) removes
the directory; a process that is killed cannot, so each engine that opens an ``nvme_path`` first sweeps it:
a directory whose lock can be taken belongs to a dead process (the kernel drops a lock when its holder dies,
however it dies) and is removed with what it holds. A directory without a lock file is one of an older
version, removed when no process named by its swap files (``ofl-swap-<pid>-<hex>.bin``) is alive, or one
that is being created now: left alone while younger than a minute. A live process's directory is never
touched: its lock cannot be taken.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import tempfile
import time
import weakref

from swap.space import swap_file_owner_alive

__all__ = ["LOCK_NAME", "SwapDir", "claim_swap_dir", "sweep_dead_swap_dirs"]

logger = logging.getLogger(__name__)

LOCK_NAME = "owner.lock"
_DIR = re.compile(r"offload-rank\d+-[A-Za-z0-9_]+$")
_CLAIMING = ".offload-claim-"
_YOUNG_SECONDS = 60.0


def _remove(path: str, lock_fd: int) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.close(lock_fd)


class SwapDir:
    """A claimed swap directory: its path, held by a locked ``owner.lock``. Released by ``release()``, or
    when it is garbage collected or the interpreter exits (an engine nobody closed)."""

    def __init__(self, path: str, lock_fd: int) -> None:
        self.path = path
        self._finalizer = weakref.finalize(self, _remove, path, lock_fd)

    def release(self) -> None:
        """Remove the directory and drop the lock. Idempotent."""
        self._finalizer()


def claim_swap_dir(nvme_path: str, rank: int) -> SwapDir:
    """Sweep ``nvme_path`` of dead engines' directories, then make and lock one for this engine.

    The directory is made under a name the sweep passes over (``.offload-claim-*``) and renamed to its own
    once its lock is held, so no sweep sees it unlocked."""
    sweep_dead_swap_dirs(nvme_path)
    staging = tempfile.mkdtemp(prefix=_CLAIMING, dir=nvme_path)
    try:
        fd = os.open(os.path.join(staging, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path = os.path.join(nvme_path, f"offload-rank{rank}-{os.path.basename(staging)[len(_CLAIMING):]}")
            os.rename(staging, path)
        except BaseException:
            os.close(fd)
            raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return SwapDir(path, fd)


def _dead(path: str) -> bool:
    """Whether the engine that made ``path`` is gone ([Note: engine swap directories])."""
    lock = os.path.join(path, LOCK_NAME)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        try:
            names = os.listdir(path)
            age = time.time() - os.stat(path).st_mtime
        except OSError:
            return False
        owners = [alive for alive in map(swap_file_owner_alive, names) if alive is not None]
        if owners:
            return not any(owners)
        return age > _YOUNG_SECONDS
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    finally:
        os.close(fd)


def sweep_dead_swap_dirs(nvme_path: str) -> list[str]:
    """Remove the swap directories of dead engines under ``nvme_path``; returns the paths removed."""
    try:
        names = os.listdir(nvme_path)
    except OSError:
        return []
    removed = []
    for name in names:
        path = os.path.join(nvme_path, name)
        claiming = name.startswith(_CLAIMING) and _older_than(path, _YOUNG_SECONDS)  # a claim that died half-way
        if (_DIR.match(name) or claiming) and os.path.isdir(path) and not os.path.islink(path) and _dead(path):
            size = sum(os.path.getsize(os.path.join(path, f)) for f in _listdir(path))
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            logger.warning("removed %s (%.1f MiB): the swap files of an engine that ended without closing",
                           path, size / 2**20)
    return removed


def _older_than(path: str, seconds: float) -> bool:
    try:
        return time.time() - os.stat(path).st_mtime > seconds
    except OSError:
        return False


def _listdir(path: str) -> list[str]:
    try:
        return [f for f in os.listdir(path) if os.path.isfile(os.path.join(path, f))]
    except OSError:
        return []
