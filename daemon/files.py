"""The daemon's files in the swap paths: a directory of its own per path, under a lock, and a sweep.

[Note: swap file ownership] Each daemon claims, in every swap path, the lowest free slot
``n``: it holds an exclusive ``flock`` on ``<path>/ofl-daemon-<n>.lock`` for its whole
life and keeps its swap file in ``<path>/ofl-daemon-<n>/`` (mode 0700). The kernel drops
the lock when the process dies, however it dies, so at start a lock file that can be
locked belongs to a dead daemon: its directory and whatever is in it are removed (the
*sweep*), along with swap files of the old naming (``ofl-swap-<pid>-<hex>.bin`` directly
in the path) whose process is gone. Claims and sweeps of one path are serialised by a
short ``flock`` on ``<path>/.ofl-daemon.lock``, so two daemons starting at once neither
take the same slot nor sweep each other. ``close`` removes this daemon's directories
(after the swap space has unlinked its files) and its lock files.

The claim and the sweep run on the daemon's event loop at start (``await SwapClaim.open(paths)``), each
file operation through ``aiofiles.os`` (a thread per call), so a sweep of a large tree left by a killed
daemon, or a wait for another daemon's guard lock, never stops the loop.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import stat

import aiofiles.os
import aiofiles.ospath

from csrc.errors import SwapIOError
from swap.space import swap_file_owner_alive

logger = logging.getLogger(__name__)

__all__ = ["SwapClaim"]

_LOCK = re.compile(r"ofl-daemon-(\d+)\.lock$")


_flock = aiofiles.os.wrap(fcntl.flock)  # the guard may wait for another daemon's claim
_open = aiofiles.os.wrap(os.open)


async def _remove_tree(path: str) -> int:
    """Remove ``path`` and everything under it, skipping what cannot be removed; returns the bytes freed."""
    freed = 0
    try:
        names = await aiofiles.os.listdir(path)
    except OSError:
        return 0
    for name in names:
        full = os.path.join(path, name)
        try:
            st = await aiofiles.os.stat(full, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                freed += await _remove_tree(full)
                continue
            await aiofiles.os.unlink(full)
            freed += st.st_blocks * 512
        except OSError as exc:
            logger.warning("could not remove %s: %s", full, exc.strerror)
    try:
        await aiofiles.os.rmdir(path)
    except OSError as exc:
        logger.warning("could not remove %s: %s", path, exc.strerror)
    return freed


async def _lock_is_free(path: str) -> bool | None:
    """Whether no live daemon holds the lock file ``path`` (None: it is gone)."""
    try:
        fd = await _open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # never blocks
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


class SwapClaim:
    """This daemon's directory in each swap path; see [Note: swap file ownership]."""

    def __init__(self) -> None:
        self.dirs: list[str] = []
        self._locks: list[tuple[int, str]] = []

    @classmethod
    async def open(cls, paths: list[str], adopt: list[str] | None = None) -> "SwapClaim":
        """Sweep each path and claim a slot in it; on failure nothing claimed is kept. ``adopt``: the
        directories a predecessor held, one per path, taken over with what is in them (a live daemon
        holding one is an error)."""
        claim = cls()
        adopt = adopt or []
        if adopt and len(adopt) != len(paths):
            raise SwapIOError(errno.EINVAL, f"the previous daemon had {len(adopt)} swap path(s); [swap] paths "
                                            f"names {len(paths)}")
        try:
            for i, path in enumerate(paths):
                await claim._claim(os.path.abspath(path), adopt[i] if adopt else None)
        except BaseException:
            claim.close()
            raise
        return claim

    async def _claim(self, path: str, adopt: str | None = None) -> None:
        if not await aiofiles.ospath.isdir(path):
            raise SwapIOError(errno.ENOENT, f"swap path {path} does not exist or is not a directory: make it first "
                                            f"(mkdir -p {path}, writable by the daemon's user) or name an existing "
                                            f"directory on an NVMe drive in [swap] paths")
        try:
            guard = await _open(os.path.join(path, ".ofl-daemon.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise SwapIOError(exc.errno, f"swap path {path} is not writable: {exc.strerror}") from exc
        try:
            await _flock(guard, fcntl.LOCK_EX)
            if adopt is not None:
                await self._adopt(path, adopt)
                return
            taken = await self._sweep(path)
            slot = next(n for n in range(len(taken) + 1) if n not in taken)
            lock_path = os.path.join(path, f"ofl-daemon-{slot}.lock")
            fd = await _open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: the sweep just saw it so, under the guard
            self._locks.append((fd, lock_path))
            directory = os.path.join(path, f"ofl-daemon-{slot}")
            await aiofiles.os.mkdir(directory, 0o700)
            self.dirs.append(directory)
        finally:
            os.close(guard)  # releases the guard
        logger.info("swap path %s: this daemon's files go in %s", path, directory)

    async def _adopt(self, path: str, directory: str) -> None:
        """Take over ``directory`` (a predecessor's slot in ``path``), under the guard: its lock, then it."""
        if os.path.dirname(directory) != path or not _LOCK.match(os.path.basename(directory) + ".lock"):
            raise SwapIOError(errno.EINVAL, f"{directory} is not a daemon's directory in swap path {path}")
        if not await aiofiles.ospath.isdir(directory):
            raise SwapIOError(errno.ENOENT, f"the previous daemon's swap directory {directory} is gone")
        lock_path = directory + ".lock"
        fd = await _open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SwapIOError(errno.EBUSY, f"{directory} is held by a live daemon: not taken over") from None
        self._locks.append((fd, lock_path))
        self.dirs.append(directory)
        logger.info("swap path %s: took over %s from the previous daemon", path, directory)

    @staticmethod
    async def _sweep(path: str) -> set[int]:
        """Remove what dead daemons left in ``path``; returns the slots live daemons hold."""
        taken: set[int] = set()
        for name in await aiofiles.os.listdir(path):
            full = os.path.join(path, name)
            lock = _LOCK.match(name)
            if lock:
                free = await _lock_is_free(full)
                if free is False:
                    taken.add(int(lock.group(1)))  # a live daemon holds it
                if not free:
                    continue
                stale = full[: -len(".lock")]
                if await aiofiles.ospath.isdir(stale):
                    freed = await _remove_tree(stale)
                    logger.warning("swept %s, left by a daemon that is gone (%d bytes)", stale, freed)
                await aiofiles.os.unlink(full)
            elif swap_file_owner_alive(name) is False:
                await aiofiles.os.unlink(full)
                logger.warning("swept %s, left by a process that is gone", full)
        for name in await aiofiles.os.listdir(path):  # a directory whose lock file is gone: left by a crash mid-claim
            m = re.match(r"ofl-daemon-(\d+)$", name)
            if m and int(m.group(1)) not in taken and await aiofiles.ospath.isdir(os.path.join(path, name)):
                await _remove_tree(os.path.join(path, name))
        return taken

    def close(self, keep: bool = False) -> None:
        """Remove this daemon's directories and lock files (the swap space must be closed first). Idempotent.
        ``keep``: only let go of the locks, leaving both for a successor to take over."""
        for directory in self.dirs:
            if not keep:
                shutil.rmtree(directory, ignore_errors=True)
        self.dirs = []
        for fd, lock_path in self._locks:
            try:
                if not keep:
                    os.unlink(lock_path)
            except FileNotFoundError:
                pass
            os.close(fd)
        self._locks = []
