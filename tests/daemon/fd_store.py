"""TEST PLAYER of systemd's file-descriptor store, so tests can restart the daemon as
``systemctl restart`` does for a unit with ``FileDescriptorStoreMax=`` set, without systemd.

What it plays, and how:

* The notify socket (``sd_notify``). ``FdStore`` binds an AF_UNIX datagram socket at
  ``<directory>/notify.sock`` (named by ``env()`` as ``NOTIFY_SOCKET``; a path, not the
  ``@abstract`` form) and a thread reads each datagram: newline-separated ``KEY=VALUE``
  lines, plus the fds sent with it as SCM_RIGHTS.
  - ``FDSTORE=1``: the datagram's fds are kept under ``FDNAME=`` (``"stored"`` when the
    name is missing or not one systemd accepts: printable ASCII, no ``:``, at most 255
    chars). Names may repeat; fds keep arrival order. An fd whose open file is already
    kept is closed and counted in ``duplicates`` (systemd suppresses it too). Past
    ``max_fds`` kept fds, the rest are closed and counted in ``refused``.
  - ``FDSTOREREMOVE=1`` with ``FDNAME=x``: every fd kept under ``x`` is closed and
    forgotten. As in systemd it is applied before ``FDSTORE=1`` when a datagram has both.
  - fds of a datagram without ``FDSTORE=1`` are closed, never kept.
  - ``READY=1`` sets ``ready``; every datagram's dict (first value of a repeated key wins,
    as systemd's lookups do) goes to ``messages``, ``STATUS=`` included. Datagrams systemd
    would ignore (truncated data or fds, not UTF-8) close their fds and are listed in
    ``ignored`` with the reason.
  Not played: NotifyAccess= (any sender counts), FDPOLL= (a kept fd is not dropped when
  its peer hangs up), the service-state machine.
* The restart (``sd_listen_fds``). ``spawn`` starts a command the way systemd starts a
  service whose store is not empty: the kept fds at 3, 4, ... in store order, and
  ``LISTEN_FDS=<count>``, ``LISTEN_FDNAMES=<name>:<name>:...``, ``LISTEN_PID=<its pid>``
  in its environment. Only the child itself knows its pid before it execs, so ``spawn``
  runs this file (``python fd_store.py exec --fds 7,9 --names a:b -- cmd...``), which
  moves the fds into place, sets the variables and execs the command in the same process.
"""
from __future__ import annotations

import argparse
import array
import ctypes
import errno
import fcntl
import functools
import os
import platform
import select
import socket
import stat
import subprocess
import sys
import threading
import time
from typing import Callable

__all__ = ["FdStore"]

SOCKET_NAME = "notify.sock"
DEFAULT_NAME = "stored"
DATAGRAM_BYTES = 64 * 1024
MAX_FDS_PER_DATAGRAM = 253  # SCM_MAX_FD
FIRST_LISTEN_FD = 3  # SD_LISTEN_FDS_START
LISTEN_VARIABLES = ("LISTEN_FDS", "LISTEN_FDNAMES", "LISTEN_PID")
_INT = array.array("i").itemsize
_KCMP_SYSCALL = {"x86_64": 312, "aarch64": 272}
_KCMP_FILE = 0


def parse_notify(text: str) -> dict[str, str]:
    """``KEY=VALUE`` lines as a dict; the first value of a repeated key wins, lines without ``=`` are not fields."""
    fields: dict[str, str] = {}
    for line in text.split("\n"):
        key, sep, value = line.partition("=")
        if sep and key not in fields:
            fields[key] = value
    return fields


def valid_fdname(name: str) -> bool:
    """systemd's fdname_is_valid: 1..255 printable ASCII characters, no ':'."""
    return 0 < len(name) <= 255 and all(" " <= ch <= "~" and ch != ":" for ch in name)


def store_name(fields: dict[str, str]) -> str:
    name = fields.get("FDNAME")
    return name if name is not None and valid_fdname(name) else DEFAULT_NAME


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _kcmp_same(a: int, b: int) -> bool | None:
    """kcmp(KCMP_FILE): whether two fds share one open file description; None where kcmp is not usable."""
    number = _KCMP_SYSCALL.get(platform.machine())
    if number is None:
        return None
    libc = _libc()
    pid = os.getpid()
    result = libc.syscall(number, pid, pid, _KCMP_FILE, a, b)
    if result >= 0:
        return result == 0
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EPERM, errno.EACCES, errno.EOPNOTSUPP):
        return None
    raise OSError(code, f"kcmp({a}, {b}): {os.strerror(code)}")


def _position(fd: int) -> int | None:
    try:
        return os.lseek(fd, 0, os.SEEK_CUR)
    except OSError as exc:
        if exc.errno == errno.ESPIPE:
            return None
        raise


def _stat_same(a: int, b: int) -> bool:
    """systemd's same_fd without kcmp: same inode, not a device, same flags, same file position."""
    sa, sb = os.fstat(a), os.fstat(b)
    if (sa.st_dev, sa.st_ino) != (sb.st_dev, sb.st_ino):
        return False
    if stat.S_ISCHR(sa.st_mode) or stat.S_ISBLK(sa.st_mode):
        return False
    if fcntl.fcntl(a, fcntl.F_GETFL) != fcntl.fcntl(b, fcntl.F_GETFL):
        return False
    return _position(a) == _position(b)


def same_open_file(a: int, b: int) -> bool:
    """Whether fds ``a`` and ``b`` (of this process) refer to one open file description, as systemd's same_fd."""
    if a == b:
        return True
    same = _kcmp_same(a, b)
    return _stat_same(a, b) if same is None else same


def received_fds(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    """The fds of every SCM_RIGHTS message in ``recvmsg``'s ancillary data."""
    fds = array.array("i")
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % _INT])
    return list(fds)


def close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


class FdStore:
    """systemd's notify socket and fd store for one service, at ``<directory>/notify.sock``.

    Public state, written by the reader thread under its lock (a datagram's effects are all in
    place before its READY=1 sets ``ready``): ``ready`` (threading.Event, set by READY=1),
    ``messages`` (one dict per datagram), ``refused`` (fds closed past ``max_fds``),
    ``duplicates`` (fds closed as already kept), ``ignored`` (why datagrams systemd would
    ignore were dropped); and ``socket_path``, ``max_fds``.
    """

    def __init__(self, directory: str, max_fds: int = 4096) -> None:
        if max_fds < 0:
            raise ValueError(f"max_fds must be >= 0, not {max_fds}")
        self.socket_path = os.path.join(directory, SOCKET_NAME)
        self.max_fds = max_fds
        self.ready = threading.Event()
        self.messages: list[dict[str, str]] = []
        self.refused = 0
        self.duplicates = 0
        self.ignored: list[str] = []
        self._kept: list[tuple[str, int]] = []
        self._lock = threading.Lock()
        self._failure: BaseException | None = None
        self._closed = False
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            self._sock.bind(self.socket_path)
        except BaseException:
            self._sock.close()
            raise
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._serve, name=f"fd-store {self.socket_path}", daemon=True)
        self._thread.start()

    # -- what tests use -------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        return {"NOTIFY_SOCKET": self.socket_path}

    def names(self) -> list[str]:
        """The names kept, one entry per fd, in store order."""
        with self._lock:
            return [name for name, _ in self._kept]

    def fds(self) -> list[tuple[str, int]]:
        """(name, fd) pairs in store order; the fds are this process's, owned by the store."""
        with self._lock:
            return list(self._kept)

    def wait_for(self, predicate: Callable[[FdStore], bool], timeout_seconds: float) -> None:
        """Poll ``predicate(self)`` until true; TimeoutError (with what came so far) past the timeout."""
        deadline = time.monotonic() + timeout_seconds
        while True:
            self._raise_failure()
            if predicate(self):
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"fd store at {self.socket_path}: condition not met in {timeout_seconds} s; "
                                   f"{self._summary()}")
            time.sleep(0.01)

    def spawn(self, cmd: list[str], *, env: dict[str, str], stdout=None, stderr=None,
              cwd=None) -> subprocess.Popen:
        """Start ``cmd`` as systemd starts the service: kept fds at 3, 4, ... and LISTEN_FDS/FDNAMES/PID set."""
        self._raise_failure()
        child_env = {key: value for key, value in env.items() if key not in LISTEN_VARIABLES}
        child_env.update(self.env())
        with self._lock:  # no FDSTOREREMOVE may close a kept fd while it is being passed
            if not self._kept:
                return subprocess.Popen(cmd, env=child_env, stdout=stdout, stderr=stderr, cwd=cwd)
            fds = [fd for _, fd in self._kept]
            names = [name for name, _ in self._kept]
            argv = [sys.executable, os.path.abspath(__file__), "exec",
                    "--fds", ",".join(map(str, fds)), "--names", ":".join(names), "--", *cmd]
            return subprocess.Popen(argv, env=child_env, stdout=stdout, stderr=stderr, cwd=cwd, pass_fds=fds)

    def close(self) -> None:
        """Stop the reader thread, close the socket and every kept fd, unlink the socket path."""
        if self._closed:
            return
        self._closed = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=10.0)
        if self._thread.is_alive():
            raise RuntimeError(f"fd store reader for {self.socket_path} did not stop")
        self._sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        with self._lock:
            kept, self._kept = self._kept, []
        close_all([fd for _, fd in kept])
        os.unlink(self.socket_path)
        self._raise_failure()

    def __enter__(self) -> FdStore:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- the reader thread ----------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            poller = select.poll()
            poller.register(self._sock, select.POLLIN)
            poller.register(self._wake_r, select.POLLIN)
            while True:
                ready = {fd for fd, _ in poller.poll()}
                if self._wake_r in ready:
                    return
                self._receive()
        except BaseException as exc:
            self._failure = exc  # raised again by wait_for, spawn and close, in the test's thread
            raise

    def _receive(self) -> None:
        data, ancdata, flags, _ = self._sock.recvmsg(
            DATAGRAM_BYTES, socket.CMSG_SPACE(MAX_FDS_PER_DATAGRAM * _INT), socket.MSG_CMSG_CLOEXEC)
        fds = received_fds(ancdata)
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            self._ignore(fds, f"truncated datagram (flags {flags:#x}, {len(data)} bytes, {len(fds)} fds)")
            return
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            self._ignore(fds, f"datagram not UTF-8: {exc}")
            return
        self._handle(parse_notify(text), fds)

    def _ignore(self, fds: list[int], reason: str) -> None:
        close_all(fds)
        with self._lock:
            self.ignored.append(reason)

    def _handle(self, fields: dict[str, str], fds: list[int]) -> None:
        with self._lock:
            if fields.get("FDSTOREREMOVE") == "1" and "FDNAME" in fields:
                self._remove(fields["FDNAME"])
            if fields.get("FDSTORE") == "1":
                self._store(store_name(fields), fds)
            else:
                close_all(fds)
            self.messages.append(fields)
        if fields.get("READY") == "1":
            self.ready.set()

    def _remove(self, name: str) -> None:
        """Close and forget every fd kept under ``name``; the lock is held."""
        gone = [fd for kept_name, fd in self._kept if kept_name == name]
        self._kept = [(kept_name, fd) for kept_name, fd in self._kept if kept_name != name]
        close_all(gone)

    def _store(self, name: str, fds: list[int]) -> None:
        """Keep ``fds`` under ``name`` as systemd's service_add_fd_store does; the lock is held."""
        for fd in fds:
            if len(self._kept) >= self.max_fds:
                os.close(fd)
                self.refused += 1
            elif any(same_open_file(kept, fd) for _, kept in self._kept):
                os.close(fd)
                self.duplicates += 1
            else:
                self._kept.append((name, fd))

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"fd store reader for {self.socket_path} failed") from self._failure

    def _summary(self) -> str:
        with self._lock:
            return (f"ready={self.ready.is_set()} kept={list(self._kept)} refused={self.refused} "
                    f"duplicates={self.duplicates} ignored={list(self.ignored)} messages={list(self.messages)}")


# -- the exec entry point: runs in the spawned child, between fork and the service's exec ---------

def move_fds_into_place(fds: list[int]) -> None:
    """Put ``fds[i]`` at 3 + i (inheritable) and close the rest, without clobbering one not yet moved."""
    targets = range(FIRST_LISTEN_FD, FIRST_LISTEN_FD + len(fds))
    floor = max([*fds, targets[-1]]) + 1
    temporaries = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor) for fd in fds]
    for fd in fds:
        if fd not in targets:
            os.close(fd)
    for target, temporary in zip(targets, temporaries):
        os.dup2(temporary, target, inheritable=True)
    close_all(temporaries)


def listen_env(count: int, names: list[str]) -> dict[str, str]:
    return {"LISTEN_FDS": str(count), "LISTEN_FDNAMES": ":".join(names), "LISTEN_PID": str(os.getpid())}


def parse_args(argv: list[str]) -> tuple[list[int], list[str], list[str]]:
    """``exec --fds 7,9 --names a:b -- cmd...`` as (fds, names, cmd)."""
    parser = argparse.ArgumentParser(description="exec a command with fds at 3.. as sd_listen_fds expects")
    sub = parser.add_subparsers(dest="verb", required=True)
    run = sub.add_parser("exec")
    run.add_argument("--fds", required=True, help="comma-separated fd numbers, in store order")
    run.add_argument("--names", required=True, help="colon-separated names, one per fd")
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    fds = [int(fd) for fd in args.fds.split(",")]
    names = args.names.split(":")
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if len(fds) != len(names):
        parser.error(f"{len(fds)} fds but {len(names)} names")
    if not cmd:
        parser.error("no command after --")
    return fds, names, cmd


def main(argv: list[str]) -> None:
    fds, names, cmd = parse_args(argv)
    move_fds_into_place(fds)
    env = dict(os.environ)
    env.update(listen_env(len(fds), names))
    os.execvpe(cmd[0], cmd, env)


if __name__ == "__main__":
    main(sys.argv[1:])
