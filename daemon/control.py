"""The control connection to the daemon: one blocking socket, a request and its one reply, the daemon's
error replies raised as the classes it names; and ``daemon_status``, all that ``offload status`` needs.

Light on purpose: it imports neither the swap layer nor the server, so ``offload status`` starts in
a few hundredths of a second. ``TierClient`` (``daemon.client``) builds on it.
"""
from __future__ import annotations

import builtins
import errno as errno_mod
import itertools
import logging
import os
import socket
import struct
import threading
import time
from typing import Any

import csrc.errors as errors
from csrc.errors import DaemonNotRunningError, OffloadError, ProtocolError
from daemon.protocol import HEADER, Flag, Frame, Kind, decode_body, encode_frame
from daemon.shm import recv_with_fds, send_with_fds

logger = logging.getLogger(__name__)

__all__ = ["DaemonConnection", "daemon_status"]

_ERROR = int(Flag.ERROR)  # plain ints on the hot path: IntFlag arithmetic costs microseconds here
_BUILTIN_ERRORS = {"KeyError", "ValueError", "TypeError", "TimeoutError", "OSError", "MemoryError",
                   "PermissionError", "FileNotFoundError", "RuntimeError", "IndexError"}


def _error_from_reply(body: dict[str, Any]) -> BaseException:
    name, message = str(body.get("error", "OffloadError")), str(body.get("message", ""))
    cls = getattr(errors, name, None)
    if cls is None:
        try:
            import swap
            cls = getattr(swap, name, None)
        except ImportError:
            cls = None
    if cls is None and name in _BUILTIN_ERRORS:
        cls = getattr(builtins, name)
    if isinstance(cls, type) and issubclass(cls, BaseException):
        if issubclass(cls, OSError) and body.get("errno") is not None:
            code = int(body["errno"])
            return cls(code, message or errno_mod.errorcode.get(code, ""))
        return cls(message)
    return OffloadError(f"{name}: {message}")


class DaemonConnection:
    """One blocking connection to the daemon: send a request, read its one reply.

    [Note: client round trip] The socket stays in blocking mode and the reply timeout is
    the kernel's SO_RCVTIMEO, set only when it changes: Python's own socket timeouts put
    a poll() and two fcntl() calls around every request, which cost more here than the
    daemon's whole handling of a small request. Only the HELLO reply carries fds, so only
    it is read with recvmsg and an ancillary buffer. See [Note: client spin] for
    ``spin_seconds``.
    """

    def __init__(self, socket_path: str, timeout_seconds: float, spin_seconds: float = 0.0) -> None:
        self._timeout = timeout_seconds
        self.spin_seconds = spin_seconds
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_seconds)
        deadline = time.monotonic() + timeout_seconds
        while True:
            try:
                self._sock.connect(socket_path)
                break
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                self._sock.close()
                raise DaemonNotRunningError(f"no offload daemon on {socket_path} ({exc.strerror})") from None
            except BlockingIOError:  # the listen backlog is full: the daemon is busy accepting
                if time.monotonic() > deadline:
                    self._sock.close()
                    raise TimeoutError(f"the daemon on {socket_path} accepted no connection within "
                                       f"{timeout_seconds} s") from None
                time.sleep(0.01)
        self._sock.settimeout(None)
        self._rcvtimeo: float | None = -1.0
        self._buf = bytearray()
        self._fds: list[int] = []
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.refused = False
        """True once the daemon closed this connection at one of its caps (an error frame for request 0)."""
        self.last_used = time.monotonic()

    def _set_timeout(self, seconds: float | None) -> None:
        if seconds == self._rcvtimeo:
            return
        whole, frac = divmod(seconds or 0.0, 1.0)  # 0 means no limit to the kernel
        timeval = struct.pack("ll", int(whole), int(frac * 1e6))
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        self._rcvtimeo = seconds

    def request(self, kind: Kind, body: dict[str, Any] | None = None, wait_seconds: float | None = 0.0) -> tuple[dict[str, Any], list[int]]:
        """Send one request and return its reply body (and fds); raise its error."""
        with self._lock:
            request_id = next(self._ids)
            timeout = None if wait_seconds is None else self._timeout + wait_seconds
            try:
                self._set_timeout(timeout)
                self._sock.sendall(encode_frame(int(kind), request_id, body))
                frame = self._read_frame(kind is Kind.HELLO, wait_seconds == 0.0)
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise DaemonNotRunningError(f"the daemon closed the connection ({exc.strerror})") from None
            except (BlockingIOError, socket.timeout):
                self._sock.close()  # a late reply would be read as the next one's: this connection is done
                raise TimeoutError(f"no reply to {kind.name} within {timeout} s; connection closed") from None
            except OSError as exc:
                if exc.errno == errno_mod.EBADF:
                    raise DaemonNotRunningError("this connection to the daemon is closed") from None
                raise
            fds, self._fds = self._fds, []
            self.last_used = time.monotonic()
        if frame.request_id == 0 and frame.flags & _ERROR:  # the daemon closed the connection, and says why
            self.refused = True
            self._sock.close()
            raise _error_from_reply(decode_body(frame))
        if frame.request_id != request_id:
            raise ProtocolError(f"reply to request {frame.request_id}, expected {request_id}")
        if frame.flags & _ERROR:
            raise _error_from_reply(decode_body(frame))
        return (decode_body(frame) if frame.body else {}), fds

    def hand_back(self, fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        """After a HELLO reply asking for them: send the session's segment ``fds`` (one byte carries them),
        and return the HELLO reply that follows (and its fds). [Note: hand-back] in daemon.handback."""
        with self._lock:
            try:
                send_with_fds(self._sock, b"\0", fds)
                frame = self._read_frame(True)
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise DaemonNotRunningError(f"the daemon closed the connection ({exc.strerror})") from None
            got, self._fds = self._fds, []
        if frame.flags & _ERROR:
            for fd in got:
                os.close(fd)
            raise _error_from_reply(decode_body(frame))
        return decode_body(frame), got

    def _recv(self, spin: bool) -> bytes:
        # [Note: client spin] A small request's reply comes back in ~50 us. Polling for it
        # that long keeps this vCPU awake, so the daemon's reply does not have to wake a
        # halted one (an IPI and a VM exit here): measured 15% off the round trip. Waits,
        # FLUSH and FREE, whose replies take as long as I/O does, never poll.
        if spin and self.spin_seconds:
            deadline = time.perf_counter() + self.spin_seconds
            while time.perf_counter() < deadline:
                try:
                    return self._sock.recv(1 << 16, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    pass
        return self._sock.recv(1 << 16)

    def _read_frame(self, with_fds: bool, spin: bool = False) -> Frame:
        buf = self._buf
        while True:
            if len(buf) >= HEADER.size:
                nbytes, kind, flags, request_id = HEADER.unpack_from(buf)
                end = HEADER.size + nbytes
                if len(buf) >= end:
                    frame = Frame(kind, flags, request_id, bytes(buf[HEADER.size:end]))
                    del buf[:end]
                    return frame
            if with_fds:
                data, fds = recv_with_fds(self._sock, 1 << 16)
                self._fds.extend(fds)
            else:
                data = self._recv(spin)
            if not data:
                raise DaemonNotRunningError("the daemon closed the connection")
            if not buf and len(data) >= HEADER.size:  # the usual case: exactly one whole reply
                nbytes, kind, flags, request_id = HEADER.unpack_from(data)
                if len(data) == HEADER.size + nbytes:
                    return Frame(kind, flags, request_id, data[HEADER.size:])
            buf += data

    def peer_closed(self) -> bool:
        """True when the daemon has closed this connection (checked without blocking or reading)."""
        try:
            return self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def close(self) -> None:
        self._sock.close()


def daemon_status(socket_path: str, timeout_seconds: float = 10.0) -> dict[str, Any]:
    """The daemon's STATUS reply (what ``offload status`` prints); no session needed."""
    conn = DaemonConnection(socket_path, timeout_seconds)
    try:
        return conn.request(Kind.STATUS)[0]
    finally:
        conn.close()
