"""The daemon: an asyncio server on a Unix socket over sessions, scheduler, store and metrics.

``DaemonServer(config, backend)`` owns everything; ``await server.start()`` binds the
socket (mode from the config, a stale socket file replaced, a live daemon on the same
path an error), starts the metrics endpoint; ``await server.stop()`` stops accepting,
drains queued and running I/O (bounded by ``drain_timeout_seconds``), closes every
session's store, and removes the socket. ``run_daemon(config)`` is the foreground
process: it serves until SIGTERM or SIGINT, then stops as above.

Each connection is an ``asyncio.Protocol``: frames are decoded in ``data_received``;
bookkeeping requests are answered there, I/O waits run as tasks (see
[Note: what runs on the loop] in ``daemon.handlers``). A peer whose uid is not allowed
(SO_PEERCRED) is closed at once. A protocol error costs only its own connection.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import stat
import struct
import time
from typing import Any

from csrc.errors import ConfigError, OffloadError, ProtocolError, SessionError
from daemon.backend import StoreBackend, SwapBackend
from daemon.config import DaemonConfig
from daemon.handlers import SYNC_KINDS, Handlers, needs_session, no_session_error
from daemon.metrics import DaemonMetrics
from daemon.protocol import PROTOCOL_VERSION, Flag, Frame, FrameDecoder, Kind, check_fields, decode_body, \
    encode_frame, error_body
from daemon.scheduler import FairScheduler
from daemon.sessions import Session, SessionTable
from daemon.shm import send_with_fds

logger = logging.getLogger(__name__)

__all__ = ["DaemonServer", "run_daemon"]

_UCRED = struct.Struct("3i")  # pid, uid, gid
_REPLY = int(Flag.REPLY)  # a plain int on the hot path
_SYNC = frozenset(int(k) for k in SYNC_KINDS)
_SESSIONLESS = frozenset(int(k) for k in Kind if not needs_session(k))


class _Connection(asyncio.Protocol):
    def __init__(self, server: "DaemonServer") -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.decoder = FrameDecoder(server.config.server.max_message_bytes)
        self.session: Session | None = None
        self.hello_pending = False
        self.tasks: set[asyncio.Task[None]] = set()
        self.peer_pid = -1

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        pid, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        self.peer_pid = pid
        allowed = {os.getuid(), 0, *self.server.config.server.allowed_uids}
        if uid not in allowed:
            logger.warning("refused a connection from uid %d (pid %d)", uid, pid)
            self.server.metrics.error("PeerRefused")
            transport.close()
            return
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        try:
            frames = self.decoder.feed(data)
        except ProtocolError as exc:  # framing lost: answer once, then close
            self.reply_error(self.decoder.oversized_request_id or 0, 0, exc)
            self.server.metrics.error("ProtocolError")
            self.transport.close()  # type: ignore[union-attr]
            return
        for frame in frames:
            self.handle(frame)

    # A client that pipelines requests without reading the replies stops being read
    # until it catches up, so its replies cannot pile up in the daemon's memory.
    def pause_writing(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        if self.decoder.pending_bytes:
            self.server.metrics.error("TruncatedMessage")
        if self.session is not None:
            self.server.sessions.detach(self.session)
            self.session = None

    # -- replies ----------------------------------------------------------------------
    def reply(self, frame: Frame, body: dict[str, Any]) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(encode_frame(frame.kind, frame.request_id, body, _REPLY))

    def reply_error(self, request_id: int, kind: int, exc: BaseException) -> None:
        self.server.metrics.error(type(exc).__name__)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(encode_frame(kind, request_id, error_body(exc), Flag.REPLY | Flag.ERROR))

    # -- dispatch ---------------------------------------------------------------------
    def handle(self, frame: Frame) -> None:
        t0 = time.perf_counter()
        try:
            body = decode_body(frame)
            kind = check_fields(frame.kind, body)
            if kind is Kind.HELLO:
                if self.session is not None or self.hello_pending:
                    raise SessionError("this connection already has a session")
                self.hello_pending = True
                self.spawn(self.hello(frame, body, t0))
                return
            number = frame.kind  # int keys below: an IntEnum hashes through Python code
            if self.session is None and number not in _SESSIONLESS:
                raise no_session_error(kind)
            fn = self.server.handler_table[number]
            if number in _SYNC:
                self.reply(frame, fn(self.session, body))  # type: ignore[arg-type]
                self.server.request_seconds[number].observe(time.perf_counter() - t0)
            else:
                self.spawn(self.run_async(frame, kind, fn(self.session, body), t0))
        except (OffloadError, KeyError, ValueError, TypeError, TimeoutError, OSError, MemoryError) as exc:
            self.reply_error(frame.request_id, frame.kind, exc)
        except Exception as exc:  # a bug of ours: still exactly one reply, and the loop goes on
            logger.exception("request %d (kind %d) failed", frame.request_id, frame.kind)
            self.reply_error(frame.request_id, frame.kind, OffloadError(f"internal error: {exc!r}"))

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def run_async(self, frame: Frame, kind: Kind, coro: Any, t0: float) -> None:
        try:
            body = await coro
        except (OffloadError, KeyError, ValueError, TypeError, TimeoutError, OSError, MemoryError) as exc:
            self.reply_error(frame.request_id, frame.kind, exc)
        except asyncio.CancelledError:
            self.reply_error(frame.request_id, frame.kind, SessionError("the session was closed"))
        except Exception as exc:  # a bug of ours: still exactly one reply
            logger.exception("request %d (kind %d) failed", frame.request_id, frame.kind)
            self.reply_error(frame.request_id, frame.kind, OffloadError(f"internal error: {exc!r}"))
        else:
            if kind is Kind.BYE:
                self.session = None
            self.reply(frame, body)
        self.server.request_seconds[int(kind)].observe(time.perf_counter() - t0)

    async def hello(self, frame: Frame, body: dict[str, Any], t0: float) -> None:
        try:
            if body["version"] != PROTOCOL_VERSION:
                raise ProtocolError(f"protocol version {body['version']} not spoken here (daemon speaks {PROTOCOL_VERSION})")
            session, reattached = await self.server.sessions.attach(body["job_id"], body["rank"], body["quota_bytes"])
        except (OffloadError, ValueError, OSError) as exc:
            self.hello_pending = False
            self.reply_error(frame.request_id, frame.kind, exc)
            if isinstance(exc, ProtocolError):
                self.transport.close()  # type: ignore[union-attr]
            return
        if self.transport is None or self.transport.is_closing():  # the client left while we built it
            self.server.sessions.detach(session)
            return
        self.session = session
        reply = {"version": PROTOCOL_VERSION, "session_id": session.session_id, "reattached": reattached,
                 "quota_bytes": session.quota_bytes,
                 "segments": [{"index": seg.index, "nbytes": seg.nbytes} for seg in session.segments]}
        data = encode_frame(Kind.HELLO, frame.request_id, reply, Flag.REPLY | Flag.FDS)
        await self.send_fds(data, [seg.fd for seg in session.segments])
        self.server.request_seconds[int(Kind.HELLO)].observe(time.perf_counter() - t0)

    async def send_fds(self, data: bytes, fds: list[int]) -> None:
        """Send ``data`` with ``fds`` on the transport's socket, in order with other writes."""
        transport = self.transport
        assert transport is not None
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


class DaemonServer:
    """The daemon's parts, wired; see the module docstring for its life cycle."""

    def __init__(self, config: DaemonConfig, backend: StoreBackend | None = None,
                 metrics: DaemonMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or DaemonMetrics()
        self.backend = backend or SwapBackend(config.pool, config.swap, config.io, config.store)
        self.scheduler = FairScheduler(config.scheduler,
                                       on_depth=lambda cls, n: self.metrics.queue_depth.labels(cls.value).set(n))
        self.sessions = SessionTable(config.sessions, config.pool, self.backend, self.scheduler, self._changed)
        self.handlers = Handlers(self.sessions, self.scheduler, self.backend, self.metrics)
        self.handler_table = {int(k): fn for k, fn in self.handlers.table().items()}
        # Labelled children looked up once: labels() costs more than the observation.
        self.request_seconds = {int(k): self.metrics.request_seconds.labels(kind=k.name) for k in Kind}
        self.connections: set[_Connection] = set()
        self.metrics_port: int | None = None
        self._server: asyncio.AbstractServer | None = None
        self._changed()

    def _changed(self) -> None:
        self.metrics.set_pool(self.sessions.used_bytes, self.sessions.capacity_bytes)
        self.metrics.set_sessions(*self.sessions.counts())
        self.metrics.session_host_bytes.clear()  # reclaimed sessions leave no series behind
        for s in self.sessions:
            self.metrics.session_host_bytes.labels(job=s.job_id, rank=str(s.rank)).set(s.quota_bytes)

    @property
    def socket_path(self) -> str:
        return self.config.server.socket_path

    def _clear_stale_socket(self) -> None:
        path = self.socket_path
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise ConfigError(f"socket path {path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            logger.info("removing stale socket %s", path)
            os.unlink(path)
            return
        finally:
            probe.close()
        raise ConfigError(f"a daemon is already listening on {path}")

    async def start(self) -> None:
        directory = os.path.dirname(os.path.abspath(self.socket_path))
        if not os.path.isdir(directory):
            raise ConfigError(f"[server] socket_path {self.socket_path}: directory {directory} does not exist")
        self._clear_stale_socket()
        loop = asyncio.get_running_loop()
        old_umask = os.umask(0o177)  # no window in which the socket is wider than asked
        try:
            self._server = await loop.create_unix_server(lambda: _Connection(self), self.socket_path)
        finally:
            os.umask(old_umask)
        os.chmod(self.socket_path, self.config.server.socket_mode)
        if self.config.metrics.address:
            host = self.config.metrics.host_port[0]
            self.metrics_port = self.metrics.serve(host, self.config.metrics.host_port[1])
            self.handlers.metrics_address = f"{host}:{self.metrics_port}"
        logger.info("serving on %s (engine %s, pool %d bytes)", self.socket_path, self.backend.engine_name,
                    self.config.pool.capacity_bytes)

    async def stop(self) -> None:
        """Stop accepting, drain I/O, close every session and the backend."""
        if self._server is not None:
            self._server.close()
        drained = await self.scheduler.drain(self.config.server.drain_timeout_seconds)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        for conn in list(self.connections):
            for task in list(conn.tasks):
                task.cancel()
        await self.sessions.close_all()
        await asyncio.to_thread(self.backend.close)
        self.metrics.close()
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        logger.info("stopped (%s)", "drained" if drained else "drain timed out")


async def _serve_until_signal(server: DaemonServer) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    await stop.wait()
    logger.info("signal received: draining in-flight I/O")
    await server.stop()


def run_daemon(config: DaemonConfig, backend: StoreBackend | None = None) -> int:
    """Run the daemon in the foreground until SIGTERM/SIGINT; returns the exit status."""
    server = DaemonServer(config, backend)
    asyncio.run(_serve_until_signal(server))
    return 0
