"""The daemon: an asyncio server on a Unix socket over sessions, scheduler, store and metrics.

``DaemonServer(config, backend)`` owns everything; ``await server.start()`` makes the
socket's directory if it is missing (mode 0755; an existing one must not be writable by
others without the sticky bit; this daemon must be able to write it), replaces a stale
socket file (a live daemon on the same path is an error), raises the fd limit, starts the
metrics endpoint (a busy port is an error at once), then builds the backend (swap space,
node pool: the slow part) and binds the socket (mode and group from the config). A start that
fails at any step closes everything it had opened. ``await server.stop()`` stops
accepting, drains queued and running I/O (bounded by ``drain_timeout_seconds``),
closes every session's store and the backend (bounded by ``close_timeout_seconds``),
and removes the socket *if it is still the one this daemon bound* (a daemon that
replaced this one keeps its socket). ``run_daemon(config)`` is the foreground process:
it tells systemd ``READY=1`` once the socket serves (``daemon.notify``; nothing without
``NOTIFY_SOCKET``), serves until SIGTERM or SIGINT, then stops as above; a second signal, or
work that outlives the bounds, ends the process at once.

Connections are ``daemon.connection.Connection``; how many are kept, and for how long,
is ``daemon.admission``.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import functools
import grp
import logging
import os
import signal
import socket
import stat
import struct
import time
from typing import Any

from csrc.errors import ConfigError
from daemon.admission import ACCEPT_BACKLOG, CONNECTION_FD_RESERVE, Admission, RateLimitedLog, open_fd_count, \
    raise_fd_limit
from daemon.backend import StoreBackend, open_swap_backend
from daemon.config import DaemonConfig
from daemon.connection import Connection
from daemon.handlers import Handlers
from daemon.metrics import DaemonMetrics
from daemon.notify import notify
from daemon.protocol import Kind
from daemon.restart import StateKeeper
from daemon.scheduler import FairScheduler
from daemon.sessions import Session, SessionTable

logger = logging.getLogger(__name__)

__all__ = ["DaemonServer", "run_daemon"]


def _prepare_socket_dir(directory: str) -> bool:
    """Make the socket's directory (0755) if missing (True: made); refuse one in which others could swap the socket."""
    try:
        st = os.stat(directory)
    except FileNotFoundError:
        try:
            os.makedirs(directory, mode=0o755)
        except OSError as exc:
            raise ConfigError(f"[server] socket_path: directory {directory} does not exist and cannot be "
                              f"made ({exc.strerror})") from exc
        logger.info("made the socket directory %s (mode 0755)", directory)
        return True
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"[server] socket_path: {directory} is not a directory")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise ConfigError(f"[server] socket_path: directory {directory} is writable by every user without "
                          "the sticky bit, so anyone could replace the socket; use a directory of its own")
    if st.st_uid not in (0, os.getuid()):
        raise ConfigError(f"[server] socket_path: directory {directory} belongs to uid {st.st_uid}, "
                          "neither this daemon's user nor root")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(f"[server] socket_path: this daemon (uid {os.getuid()}) cannot create its socket in "
                          f"{directory}")
    return False


def _socket_gid(group: str) -> int:
    """The gid ``[server] socket_group`` names ("" is the daemon's own group)."""
    if not group:
        return os.getegid()
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"[server] socket_group = {group!r}: no such group (groupadd {group})") from None


_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13; Python names it only on some builds


def peer_groups(sock: socket.socket, gid: int) -> set[int]:
    """The peer's primary gid ``gid`` and its supplementary groups (SO_PEERGROUPS; only ``gid`` where refused)."""
    groups = {gid}
    size = 4 * 64
    while size <= 4 * 65536:
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, size)
        except OSError as exc:
            if exc.errno != errno.ERANGE:
                return groups
            size *= 4
            continue
        return groups | set(struct.unpack(f"{len(raw) // 4}I", raw))
    return groups


class DaemonServer:
    """The daemon's parts, wired; see the module docstring for its life cycle."""

    def __init__(self, config: DaemonConfig, backend: StoreBackend | None = None,
                 metrics: DaemonMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or DaemonMetrics()
        self.backend: StoreBackend | None = backend
        self.allowed_uids = frozenset({os.getuid(), 0, *config.server.allowed_uids})
        self.socket_gid: int | None = None
        """Peers in this group are allowed too (None: not by group); see ServerConfig.socket_group."""
        # [Note: what runs on the loop]: transfers, session open/close and STATUS each have threads of their own.
        self.io_executor = concurrent.futures.ThreadPoolExecutor(
            config.scheduler.max_inflight_jobs + 1, thread_name_prefix="ofl-io")
        self.admin_executor = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="ofl-admin")
        self.status_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ofl-status")
        self.scheduler = FairScheduler(config.scheduler,
                                       on_depth=lambda cls, n: self.metrics.queue_depth.labels(cls.value).set(n))
        self.admission = Admission(config.server, on_refused=self.metrics.error)
        self.refusals = RateLimitedLog(logging.getLogger("daemon.connection"))
        """Refused requests, logged per session and kind (see [Note: refusals logged] in daemon.connection)."""
        self.sessions: SessionTable | None = None
        self.handlers: Handlers | None = None
        self.handler_table: dict[int, Any] = {}
        # Labelled children looked up once: labels() costs more than the observation.
        self.request_seconds = {int(k): self.metrics.request_seconds.labels(kind=k.name) for k in Kind}
        self.metrics.jobs.max_jobs = config.metrics.max_jobs
        self.metrics.jobs.grace_seconds = config.sessions.reattach_grace_seconds
        self.metrics_port: int | None = None
        self.metrics_address = ""
        self._server: asyncio.AbstractServer | None = None
        self._socket_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket this daemon bound
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._made_dir: str | None = None
        self.keeper = StateKeeper(config)
        """What this daemon keeps for a successor, and took over from its predecessor (``daemon.restart``)."""

    @property
    def socket_path(self) -> str:
        return self.config.server.socket_path

    def allows(self, uid: int, gid: int, sock: socket.socket) -> bool:
        """Whether a peer of ``uid`` (primary group ``gid``) on ``sock`` may use the daemon."""
        if uid in self.allowed_uids:
            return True
        return self.socket_gid is not None and self.socket_gid in peer_groups(sock, gid)

    def _run_admin(self, fn: Any, *args: Any) -> Any:
        return asyncio.get_running_loop().run_in_executor(self.admin_executor, fn, *args)

    def _session_changed(self, event: str, session: Session) -> None:
        """Keep the gauges current for one session's change (never a walk over every session)."""
        m, table = self.metrics, self.sessions
        if table is None:
            return
        m.set_pool(table.used_bytes, table.capacity_bytes)
        m.set_sessions(*table.counts())
        if event == "attach":
            m.jobs.attached(session.owner_uid, session.job_id, session.session_id)
            if session.adopted and not session.reattached_after_restart:
                session.reattached_after_restart = True
                m.sessions_reattached_after_restart.inc()
        elif event == "reclaim":
            m.jobs.reclaimed(session.owner_uid, session.job_id, session.session_id, session.detached_at)

    # -- start ------------------------------------------------------------------------
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
        except OSError:
            pass  # a listener that does not accept in time is still a listener
        finally:
            probe.close()
        raise ConfigError(f"a daemon is already listening on {path}")

    async def start(self) -> None:
        """Bring the daemon up; on any failure, close whatever was opened and raise."""
        try:
            await self._start()
        except BaseException:
            await self._close_parts(self.config.server.close_timeout_seconds)
            if self._made_dir is not None:
                try:
                    os.rmdir(self._made_dir)  # only if empty: nothing of anyone else's goes
                except OSError:
                    pass
            raise

    async def _start(self) -> None:
        config = self.config
        # [Note: cheap checks first] What can fail in a moment (the socket's directory, a live daemon on
        # the socket, the metrics port) is checked before the pool is faulted and the swap preallocated,
        # which take tens of seconds on a real node: an operator hears of a busy port at once.
        directory = os.path.dirname(os.path.abspath(self.socket_path))
        self._made_dir = directory if _prepare_socket_dir(directory) else None
        self._clear_stale_socket()
        gid = _socket_gid(config.server.socket_group)
        fd_limit = raise_fd_limit(config.server.fd_limit)
        if config.metrics.address:
            host = config.metrics.host_port[0]
            self.metrics_port = self.metrics.serve(host, config.metrics.host_port[1], config.metrics)
            self.metrics_address = f"{host}:{self.metrics_port}"
        keeper = self.keeper if self.backend is None else None  # a backend handed in (tests) keeps nothing
        if self.backend is None:
            adoption = keeper.load() if keeper.active else None
            logger.info("faulting the pool (%d bytes) and preparing the swap space%s", config.pool.capacity_bytes,
                        ", taking over the previous daemon's" if adoption else "")
            try:
                self.backend = await open_swap_backend(config.pool, config.swap, config.io, config.store,
                                                       self._run_admin, adoption)
            except Exception as exc:
                if adoption is None:
                    raise
                keeper.refuse_all(f"its swap files or segments could not be taken over ({exc})")
                self.backend = await open_swap_backend(config.pool, config.swap, config.io, config.store,
                                                       self._run_admin)
        self.sessions = SessionTable(config.sessions, config.pool, self.backend, self.scheduler,
                                     self._session_changed, self._run_admin, keeper if keeper and keeper.active else None)
        if keeper is not None and keeper.active:
            previous = keeper.previous
            if previous is not None:
                self.keeper.refused_sessions += await self.sessions.restore(previous["sessions"])
                self.keeper.refused_sessions += await self.sessions.restore_pending(keeper.pending)
                self.sessions.next_session_id = max(self.sessions.next_session_id, previous["next_session_id"])
                self.sessions.restart_ids()
                self.metrics.sessions_adopted.inc(len(previous["sessions"]) + len(keeper.pending))
            self.metrics.sessions_refused.inc(keeper.refused_sessions)
            await self._run_admin(keeper.start, self.backend, self.sessions.rows(), self.sessions.next_session_id)
        self.handlers = Handlers(self.sessions, self.scheduler, self.backend, self.metrics, config.sessions,
                                 self.io_executor, self.status_executor)
        self.handlers.metrics_address = self.metrics_address
        self.handler_table = {int(k): fn for k, fn in self.handlers.table().items()}
        self.metrics.set_pool(0, self.sessions.capacity_bytes)
        self.metrics.set_sessions(0, 0)
        self.metrics.watch(self.handlers, self.backend, self.sessions, self.keeper)
        loop = asyncio.get_running_loop()
        old_umask = os.umask(0o177)  # no window in which the socket is wider than asked
        try:
            self._server = await loop.create_unix_server(lambda: Connection(self), self.socket_path,
                                                         backlog=ACCEPT_BACKLOG)
        finally:
            os.umask(old_umask)
        st = os.stat(self.socket_path)
        self._socket_id = (st.st_dev, st.st_ino)
        if gid != os.getegid():
            os.chown(self.socket_path, -1, gid)
        os.chmod(self.socket_path, config.server.socket_mode)
        if config.server.socket_group and config.server.socket_mode & 0o060 == 0o060:  # named, and may connect
            self.socket_gid = gid
        reserve = CONNECTION_FD_RESERVE + ACCEPT_BACKLOG  # asyncio accepts up to a backlog's worth at once
        if config.metrics.address:
            reserve += config.metrics.max_connections
        self.admission.fit_to_fds(fd_limit, open_fd_count(), reserve)
        self._tick()
        if config.server.idle_timeout_seconds:
            self._sweep_idle()
        logger.info("serving on %s (engine %s, pool %d bytes, fd limit %d, at most %d connections)",
                    self.socket_path, self.backend.engine_name, self.sessions.capacity_bytes, fd_limit,
                    self.admission.max_connections)

    def _tick(self) -> None:
        """The event loop's heartbeat, which /healthz reads."""
        self.metrics.heartbeat()
        self._timers["tick"] = asyncio.get_running_loop().call_later(1.0, self._tick)

    def _sweep_idle(self) -> None:
        """Close connections whose session sent nothing for idle_timeout_seconds (see ServerConfig)."""
        idle = self.config.server.idle_timeout_seconds
        now = time.monotonic()
        for conn in self.admission.connections():
            if conn.session is not None and not conn.tasks and now - conn.last_active > idle:
                logger.info("closing the idle connection of job %s rank %d (uid %d): nothing for %.0f s",
                            conn.session.job_id, conn.session.rank, conn.uid, now - conn.last_active)
                conn.transport.close()  # type: ignore[union-attr]
        self._timers["idle"] = asyncio.get_running_loop().call_later(min(30.0, max(idle / 4, 0.1)), self._sweep_idle)

    # -- stop -------------------------------------------------------------------------
    def _unlink_socket_if_ours(self) -> None:
        if self._socket_id is None:
            return
        socket_id, self._socket_id = self._socket_id, None
        try:
            st = os.stat(self.socket_path)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) == socket_id:
            os.unlink(self.socket_path)
        else:
            logger.info("socket %s now belongs to another daemon; left in place", self.socket_path)

    async def stop(self) -> bool:
        """Stop accepting, drain I/O, close every session and the backend; True if all of it finished in time.

        When this daemon keeps state for a successor (``daemon.restart``), the sessions are not closed:
        once the I/O has drained (each transfer's outcome journaled), the journal's last generation is
        written, and the segments (in the fd store), the swap files and their directories are left as
        they are for the next start to take over."""
        self.metrics.stopping = True  # /healthz says so from now on
        if self._server is not None:
            self._server.close()
        self._unlink_socket_if_ours()
        drained = await self.scheduler.drain(self.config.server.drain_timeout_seconds)
        for conn in self.admission.connections():
            if conn.transport is not None:
                conn.transport.close()
            for task in list(conn.tasks):
                task.cancel()
        if self.keeper.journal is not None:  # consistent drained or not: a transfer in flight counts as not begun
            await self._run_admin(self.keeper.stop)
            self.sessions = None  # kept: not closed
            closed = await self._close_parts(self.config.server.close_timeout_seconds, keep=True)
            logger.info("stopped (%s), keeping %s for the next start", "drained" if drained else "drain timed out",
                        "the journal and segments in the fd store" if self.keeper.mode == "fd_store"
                        else f"the journal in {self.keeper.state_dir}")
            return closed
        closed = await self._close_parts(self.config.server.close_timeout_seconds)
        logger.info("stopped (%s%s)", "drained" if drained else "drain timed out",
                    "" if closed else "; closing timed out")
        return closed

    async def _close_parts(self, budget_seconds: float, keep: bool = False) -> bool:
        """Close sessions, backend, metrics, executors and the socket, within ``budget_seconds`` (``keep``:
        the backend's segments and swap files stay for a successor)."""
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        if self._server is not None:
            self._server.close()
        self._unlink_socket_if_ours()
        deadline = time.monotonic() + budget_seconds
        closed = True
        if self.sessions is not None:
            try:
                await asyncio.wait_for(self.sessions.close_all(), max(0.1, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                logger.warning("closing sessions took longer than %.1f s", budget_seconds)
                closed = False
        if self.backend is not None:
            try:
                close = functools.partial(self.backend.close, keep=True) if keep else self.backend.close
                await asyncio.wait_for(self._run_admin(close), max(0.1, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                logger.warning("closing the swap space and engine took longer than %.1f s", budget_seconds)
                closed = False
            except Exception:
                logger.exception("closing the backend failed")
        self.metrics.close()
        for pool in (self.io_executor, self.admin_executor, self.status_executor):
            pool.shutdown(wait=False, cancel_futures=True)
        return closed


async def _serve_until_signal(server: DaemonServer) -> bool:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():  # a second signal: the operator wants out now
            logger.warning("second signal: exiting without finishing the drain")
            logging.shutdown()
            os._exit(1)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    await server.start()
    notify(READY=1, STATUS=f"serving on {server.socket_path}")  # systemd's Type=notify: the pool is faulted
    await stop.wait()
    logger.info("signal received: draining in-flight I/O")
    notify(STOPPING=1, STATUS="draining in-flight I/O")
    return await server.stop()


def run_daemon(config: DaemonConfig, backend: StoreBackend | None = None) -> int:
    """Run the daemon in the foreground until SIGTERM/SIGINT; returns the exit status.

    Shutdown is bounded: when closing outlives ``close_timeout_seconds`` (a transfer stuck
    in the kernel), the process exits at once rather than wait for its threads; the next
    start sweeps the swap files it leaves."""
    server = DaemonServer(config, backend)
    closed = asyncio.run(_serve_until_signal(server))
    if not closed:
        logger.warning("exiting with work still under way in worker threads")
        logging.shutdown()
        os._exit(1)
    return 0
