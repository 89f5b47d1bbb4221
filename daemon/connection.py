"""One client connection of the daemon: framing, request fairness, dispatch, replies, HELLO.

Each connection is an ``asyncio.Protocol``: frames are decoded in ``data_received``;
bookkeeping requests are answered there, I/O waits run as tasks (see
[Note: what runs on the loop] in ``daemon.handlers``). A peer whose uid is not allowed
(SO_PEERCRED) is closed at once; admission caps are in ``daemon.admission``. A
protocol error costs only its own connection.

[Note: request fairness] A client that pipelines thousands of requests delivers them
in one read of up to 256 KiB. The connection handles ``frames_per_turn`` of them, then
stops reading and queues the rest behind every other connection's turn
(``loop.call_soon``), so a bystander's request waits for at most one turn of each
other connection, not for a whole flood. A client that does not read its replies is
not read either (``pause_writing``), so replies cannot pile up in the daemon. At most
``max_outstanding_requests`` requests of a connection are under way at once.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import struct
import time
from typing import TYPE_CHECKING, Any

from csrc.errors import OffloadError, ProtocolError, QuotaExceededError, SessionError
from daemon.handlers import PEER_KINDS, SYNC_KINDS, StillInFlight, needs_session, no_session_error
from daemon.protocol import MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, Flag, Frame, FrameDecoder, Kind, check_fields, decode_body, \
    encode_frame, error_body
from daemon.handback import HandBackNeeded, receive_hand_back
from daemon.sessions import Session
from daemon.shm import send_with_fds

if TYPE_CHECKING:
    from daemon.server import DaemonServer

logger = logging.getLogger(__name__)

__all__ = ["Connection"]

_UCRED = struct.Struct("3i")  # pid, uid, gid
_REPLY = int(Flag.REPLY)  # a plain int on the hot path
_SYNC = frozenset(int(k) for k in SYNC_KINDS)
_PEER = frozenset(int(k) for k in PEER_KINDS)
_SESSIONLESS = frozenset(int(k) for k in Kind if not needs_session(k))
_HANDLED = (OffloadError, KeyError, ValueError, TypeError, TimeoutError, OSError, MemoryError)
_KIND_NUMBERS = frozenset(int(k) for k in Kind)
_now = time.monotonic


class Connection(asyncio.Protocol):
    def __init__(self, server: "DaemonServer") -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.decoder = FrameDecoder(server.config.server.max_message_bytes)
        self.session: Session | None = None
        self.hello_pending = False
        self.tasks: set[asyncio.Task[None]] = set()
        self.peer_pid = -1
        self.uid = -1
        self.admitted = False
        self.last_active = _now()
        self._per_turn = server.config.server.frames_per_turn
        self._max_outstanding = server.config.server.max_outstanding_requests
        self._backlog: collections.deque[Frame] = collections.deque()
        self._write_paused = False
        self._hello_timer: asyncio.TimerHandle | None = None

    # -- life cycle -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        self.peer_pid, self.uid = pid, uid
        server = self.server
        if not server.allows(uid, gid, sock):
            server.admission.log.warning("peer", "refused a connection from uid %d (pid %d): not in [server] allowed_uids nor "
                                        "the socket's group", uid, pid)
            server.metrics.error("PeerRefused")
            transport.close()
            return
        if not server.admission.admit(self):
            return
        self._hello_timer = asyncio.get_running_loop().call_later(
            server.config.server.hello_timeout_seconds, self._hello_deadline)

    def _hello_deadline(self) -> None:
        self._hello_timer = None
        if self.session is not None or self.transport is None or self.transport.is_closing():
            return
        if self.hello_pending or self.tasks:  # a HELLO (or STATUS) under way: look again later
            self._hello_timer = asyncio.get_running_loop().call_later(1.0, self._hello_deadline)
            return
        self.server.admission.log.warning(
            "hello", "closed a connection of uid %d (pid %d) that opened no session within "
            "[server] hello_timeout_seconds = %s", self.uid, self.peer_pid, self.server.config.server.hello_timeout_seconds)
        self.server.metrics.error("HelloTimeout")
        self.server.admission.remove(self)
        self.transport.close()

    def _rearm_hello_deadline(self) -> None:
        """After BYE the connection has no session again: it is subject to eviction and the deadline."""
        if self.admitted:
            self.server.admission.lost_session(self)
            self._hello_timer = asyncio.get_running_loop().call_later(
                self.server.config.server.hello_timeout_seconds, self._hello_deadline)

    def idle_without_session(self) -> bool:
        """No session, no HELLO, nothing under way: may be closed to make room (see admission)."""
        return self.session is None and not self.hello_pending and not self.tasks and not self._backlog

    def close_with_error(self, exc: BaseException) -> None:
        """Tell the peer why in one connection-level error frame (request 0), then close."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(encode_frame(0, 0, error_body(exc), Flag.REPLY | Flag.ERROR))
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.admission.remove(self)
        if self._hello_timer is not None:
            self._hello_timer.cancel()
            self._hello_timer = None
        self._backlog.clear()
        if self.decoder.pending_bytes:
            self.server.metrics.error("TruncatedMessage")
        if self.session is not None:
            self.server.sessions.detach(self.session)
            self.session = None

    # -- reading, with request fairness ([Note: request fairness]) -------------------
    def data_received(self, data: bytes) -> None:
        self.last_active = _now()
        try:
            frames = self.decoder.feed(data)
        except ProtocolError as exc:  # framing lost: answer once, then close
            self.reply_error(self.decoder.oversized_request_id or 0, 0, exc)  # counted as a ProtocolError there
            self.transport.close()  # type: ignore[union-attr]
            return
        if self._backlog:
            self._backlog.extend(frames)
            return
        if len(frames) <= self._per_turn:
            for frame in frames:
                self.handle(frame)
            return
        self._backlog.extend(frames[self._per_turn:])
        for frame in frames[:self._per_turn]:
            self.handle(frame)
        self.transport.pause_reading()  # type: ignore[union-attr]
        asyncio.get_running_loop().call_soon(self._next_turn)

    def _next_turn(self) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            self._backlog.clear()
            return
        if self._write_paused:
            return  # resume_writing takes over
        backlog = self._backlog
        for _ in range(self._per_turn):
            if not backlog:
                break
            self.handle(backlog.popleft())
        if backlog:
            asyncio.get_running_loop().call_soon(self._next_turn)
        elif not self._write_paused:
            transport.resume_reading()

    # A client that pipelines requests without reading the replies stops being read
    # until it catches up, so its replies cannot pile up in the daemon's memory.
    def pause_writing(self) -> None:
        self._write_paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self.transport is None or self.transport.is_closing():
            return
        if self._backlog:
            asyncio.get_running_loop().call_soon(self._next_turn)
        else:
            self.transport.resume_reading()

    # -- replies ----------------------------------------------------------------------
    def reply(self, frame: Frame, body: dict[str, Any]) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(encode_frame(frame.kind, frame.request_id, body, _REPLY))

    def reply_error(self, request_id: int, kind: int, exc: BaseException, subject: str = "") -> None:
        if isinstance(exc, StillInFlight):  # a poll's "not yet": an answer, no error ([Note: a poll is a question])
            exc = TimeoutError(*exc.args)  # the client knows it as the store's TimeoutError
        else:
            self.server.metrics.error(type(exc).__name__)
            self._log_refusal(kind, exc, subject)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(encode_frame(kind, request_id, error_body(exc), Flag.REPLY | Flag.ERROR))

    def _log_refusal(self, kind: int, exc: BaseException, subject: str) -> None:
        """[Note: refusals logged] A warning per session (or uid, before a session) and request kind at most
        every LOG_EVERY_SECONDS, naming the session and the error, whose message names the key and value;
        the ones held back are counted in the next line."""
        s = self.session
        if s is not None:
            who, key = f"job {s.job_id!r} rank {s.rank} (session {s.session_id}, uid {self.uid})", s.session_id
        else:
            who, key = f"{subject or 'a connection'} of uid {self.uid} (pid {self.peer_pid})", f"uid{self.uid}"
        name = Kind(kind).name if kind in _KIND_NUMBERS else f"request kind {kind}"
        self.server.refusals.warning(f"{key}:{kind}", "refused %s of %s: %s: %s", name, who, type(exc).__name__, exc)

    # -- dispatch ---------------------------------------------------------------------
    def handle(self, frame: Frame) -> None:
        t0 = time.perf_counter()
        try:
            body = decode_body(frame)
            kind = check_fields(frame.kind, body)
            number = frame.kind  # int keys below: an IntEnum hashes through Python code
            if number not in _SYNC and len(self.tasks) >= self._max_outstanding:
                raise QuotaExceededError(f"the connection has [server] max_outstanding_requests = "
                                         f"{self._max_outstanding} requests under way")
            if kind is Kind.HELLO:
                if self.session is not None or self.hello_pending:
                    raise SessionError("this connection already has a session")
                self.hello_pending = True
                self.spawn(self.hello(frame, body, t0))
                return
            if self.session is None and number not in _SESSIONLESS:
                raise no_session_error(kind)
            fn = self.server.handler_table[number]
            if number in _SYNC:
                self.reply(frame, fn(self.session, body))  # type: ignore[arg-type]
                self.server.request_seconds[number].observe(time.perf_counter() - t0)
            else:
                self.spawn(self.run_async(frame, kind, fn(self.uid if number in _PEER else self.session, body), t0))
        except _HANDLED as exc:
            self.reply_error(frame.request_id, frame.kind, exc)
        except Exception as exc:  # a bug of ours: still exactly one reply, and the loop goes on
            logger.exception("request %d (kind %d) failed", frame.request_id, frame.kind)
            self.reply_error(frame.request_id, frame.kind, OffloadError(f"internal error: {exc!r}"))

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self.last_active = _now()

    async def run_async(self, frame: Frame, kind: Kind, coro: Any, t0: float) -> None:
        try:
            body = await coro
        except _HANDLED as exc:
            self.reply_error(frame.request_id, frame.kind, exc)
        except asyncio.CancelledError:
            self.reply_error(frame.request_id, frame.kind, SessionError("the session was closed"))
        except Exception as exc:  # a bug of ours: still exactly one reply
            logger.exception("request %d (kind %d) failed", frame.request_id, frame.kind)
            self.reply_error(frame.request_id, frame.kind, OffloadError(f"internal error: {exc!r}"))
        else:
            if kind is Kind.BYE:
                self.session = None
                self._rearm_hello_deadline()
            self.reply(frame, body)
        self.server.request_seconds[int(kind)].observe(time.perf_counter() - t0)

    async def hello(self, frame: Frame, body: dict[str, Any], t0: float) -> None:
        try:
            if not MIN_PROTOCOL_VERSION <= body["version"] <= PROTOCOL_VERSION:
                raise ProtocolError(f"protocol version {body['version']} not spoken here (daemon speaks "
                                    f"{MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION})")
            session, reattached = await self._attach(frame, body)
        except (OffloadError, ValueError, OSError) as exc:
            self.hello_pending = False
            self.reply_error(frame.request_id, frame.kind, exc, f"job {body.get('job_id')!r} rank {body.get('rank')}")
            if isinstance(exc, ProtocolError):
                self.transport.close()  # type: ignore[union-attr]
            return
        self.hello_pending = False
        if self.transport is None or self.transport.is_closing():  # the client left while we built it
            self.server.sessions.detach(session)
            return
        self.session = session
        self.server.admission.has_session(self)
        reply = {"version": PROTOCOL_VERSION, "session_id": session.session_id, "reattached": reattached,
                 "quota_bytes": session.quota_bytes, "token": session.token,
                 "idle_timeout_seconds": self.server.config.server.idle_timeout_seconds,
                 "segments": [{"index": i, "nbytes": seg.nbytes} for i, seg in enumerate(session.segments)]}
        data = encode_frame(Kind.HELLO, frame.request_id, reply, Flag.REPLY | Flag.FDS)
        try:
            await self.send_fds(data, [seg.fd for seg in session.segments])
        except OSError as exc:  # out of fds, or the peer went away: the session detaches with the connection
            logger.warning("HELLO reply to uid %d (pid %d) not sent: %s", self.uid, self.peer_pid, exc)
            self.transport.close()
            return
        self.server.request_seconds[int(Kind.HELLO)].observe(time.perf_counter() - t0)

    async def _attach(self, frame: Frame, body: dict[str, Any]) -> tuple[Session, bool]:
        """The HELLO's session; one whose segments its trainer is to hand back first asks for them
        ([Note: hand-back] in daemon.handback)."""
        args = (body["job_id"], body["rank"], body["quota_bytes"], self.uid, body.get("token", ""))
        try:
            return await self.server.sessions.attach(*args)
        except HandBackNeeded as need:
            count = len(need.session.pending["segments"])
            if body.get("hand_back") != count:  # a new process: the memory is gone with the old one
                logger.info("job %s rank %d: the client offers none of the %d segment(s) its session waits for; "
                            "the session is dropped and a new one opened", body["job_id"], body["rank"], count)
                await self.server.sessions.reclaim(need.session)
                return await self.server.sessions.attach(*args)
            self.transport.pause_reading()  # the fds come next, on their own: nothing else may read them
            try:
                self.reply(frame, {"hand_back": count})
                fds = await receive_hand_back(self.transport, count)
            except ProtocolError:
                await self.server.sessions.reclaim(need.session)
                raise
            finally:
                if not self.transport.is_closing():
                    self.transport.resume_reading()
            await self.server.sessions.take_hand_back(need.session, fds)
            return await self.server.sessions.attach(*args)

    async def send_fds(self, data: bytes, fds: list[int]) -> None:
        """Send ``data`` with ``fds`` on the transport's socket, in order with other writes."""
        transport = self.transport
        if transport is None:
            return
        deadline = time.monotonic() + 10.0
        while transport.get_write_buffer_size() and time.monotonic() < deadline:
            await asyncio.sleep(0.001)  # earlier replies must leave first
        sock = socket.socket(fileno=os.dup(transport.get_extra_info("socket").fileno()))
        try:
            while True:
                try:
                    sent = send_with_fds(sock, data, fds)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.001)
        finally:
            sock.close()
        if sent < len(data):
            transport.write(data[sent:])
