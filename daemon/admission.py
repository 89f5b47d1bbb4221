"""Admission: how many connections the daemon keeps, per uid and in all, and for how long.

[Note: connection caps] Every connection costs the daemon an fd, and fds are finite:
a client that opens connections and never says HELLO must not be able to lock out the
others. So:

* the daemon raises its open-file limit to ``[server] fd_limit`` at start, and keeps
  its connections ``CONNECTION_FD_RESERVE`` fds below what is left after start
  (``max_connections`` is lowered to fit);
* a uid holds at most ``max_connections_per_uid`` connections, and all uids together
  at most ``max_connections``. At a cap, the *oldest idle connection without a
  session* (no HELLO, nothing under way) of that uid (for the global cap: of the uid
  holding the most such connections) is closed to make room; when there is none, the
  new connection is refused. Either way the closed side gets one error frame naming
  the cap (kind 0, request_id 0), and the log says so at most once per
  ``LOG_EVERY_SECONDS`` with a count;
* a connection without a session is closed ``hello_timeout_seconds`` after it connected.

So a flood of idle connections from one uid costs that uid its own oldest idle
connections, and a real client that connects and says HELLO at once always gets in.
"""
from __future__ import annotations

import collections
import logging
import os
import resource
import time
from typing import TYPE_CHECKING, Any

from csrc.errors import QuotaExceededError
from daemon.config import ServerConfig

if TYPE_CHECKING:
    from daemon.connection import Connection

logger = logging.getLogger(__name__)

__all__ = ["Admission", "RateLimitedLog", "raise_fd_limit", "open_fd_count", "CONNECTION_FD_RESERVE", "ACCEPT_BACKLOG"]

CONNECTION_FD_RESERVE = 32
"""Fds kept free besides the connections: a HELLO reply's dup, logs, the metrics server's."""
ACCEPT_BACKLOG = 128
"""The listening socket's backlog; asyncio accepts up to this many connections in one go, before the
caps see them, so that many fds are kept free as well."""
LOG_EVERY_SECONDS = 10.0


class RateLimitedLog:
    """A warning per key at most every ``LOG_EVERY_SECONDS``, saying how many were held back."""

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._last: dict[str, float] = {}
        self._held: collections.Counter[str] = collections.Counter()

    MAX_KEYS = 4096
    """Keys remembered at once; past it, those quiet for a whole window are forgotten (their next line logs)."""

    def warning(self, key: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if len(self._last) > self.MAX_KEYS:
            for old in [k for k, t in self._last.items() if now - t >= LOG_EVERY_SECONDS]:
                del self._last[old]
                self._held.pop(old, None)
        if now - self._last.get(key, -LOG_EVERY_SECONDS) < LOG_EVERY_SECONDS:
            self._held[key] += 1
            return
        held = self._held.pop(key, 0)
        self._last[key] = now
        self._log.warning(msg + (f" ({held} more like this in the last {LOG_EVERY_SECONDS:.0f} s)" if held else ""),
                          *args)


def raise_fd_limit(target: int) -> int:
    """Set RLIMIT_NOFILE's soft limit to ``target`` (raising the hard limit too where allowed); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target
    if hard != resource.RLIM_INFINITY and want > hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))  # root may raise the hard limit
            return want
        except (ValueError, OSError):
            want = hard
    if want != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as exc:
            logger.warning("cannot set the open-file limit to %d (%s); it stays %d", want, exc, soft)
            return soft
    if want < target:
        logger.info("open-file limit %d: [server] fd_limit = %d is above the hard limit", want, target)
    return want


def open_fd_count() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 64


class Admission:
    """The connection table: caps, eviction of idle connections without a session, HELLO deadlines."""

    def __init__(self, config: ServerConfig, on_refused=None) -> None:
        self._config = config
        self.max_connections = config.max_connections
        self.count = 0
        self.by_uid: collections.Counter[int] = collections.Counter()
        # Per uid, its connections without a session, oldest first (dicts keep insertion order).
        self._sessionless: dict[int, dict["Connection", None]] = {}
        self._all: dict["Connection", None] = {}
        self.log = RateLimitedLog(logger)
        self._on_refused = on_refused or (lambda why: None)
        self.evicted_total = 0
        self.refused_total = 0

    def fit_to_fds(self, fd_limit: int, in_use: int, reserve: int) -> None:
        """Lower ``max_connections`` to what ``fd_limit`` leaves after ``in_use`` fds and ``reserve``."""
        room = fd_limit - in_use - reserve
        self.max_connections = max(1, min(self._config.max_connections, room))
        if room < self._config.max_connections:
            logger.info("connections: at most %d (fd limit %d, %d fds in use after start, %d kept free)",
                        self.max_connections, fd_limit, in_use, reserve)

    def admit(self, conn: "Connection") -> bool:
        """Take ``conn`` in (closing an idle one to make room), or refuse it: False, and it is told why."""
        uid = conn.uid
        if self.by_uid[uid] >= self._config.max_connections_per_uid:
            why = f"uid {uid} holds [server] max_connections_per_uid = {self._config.max_connections_per_uid} connections"
            if not self._evict(self._oldest_idle(uid), why):
                return self._refuse(conn, why)
        if self.count >= self.max_connections:
            why = f"the daemon holds [server] max_connections = {self.max_connections} connections"
            if not self._evict(self._oldest_idle(self._most_idle_uid()), why):
                return self._refuse(conn, why)
        self.count += 1
        self.by_uid[uid] += 1
        self._sessionless.setdefault(uid, {})[conn] = None
        self._all[conn] = None
        conn.admitted = True
        return True

    def connections(self) -> list["Connection"]:
        return list(self._all)

    def _refuse(self, conn: "Connection", why: str) -> bool:
        self.refused_total += 1
        self.log.warning("refuse", "refused a connection from uid %d (pid %d): %s", conn.uid, conn.peer_pid, why)
        self._on_refused("ConnectionRefused")
        conn.close_with_error(QuotaExceededError(f"connection refused: {why}"))
        return False

    def _oldest_idle(self, uid: int | None) -> "Connection | None":
        for conn in self._sessionless.get(uid, {}) if uid is not None else ():
            if conn.idle_without_session():
                return conn
        return None

    def _most_idle_uid(self) -> int | None:
        best = max(self._sessionless.items(), key=lambda kv: len(kv[1]), default=None)
        return best[0] if best else None

    def _evict(self, victim: "Connection | None", why: str) -> bool:
        if victim is None:
            return False
        self.evicted_total += 1
        self.log.warning("evict", "closed an idle connection without a session of uid %d (pid %d) to make room: %s",
                         victim.uid, victim.peer_pid, why)
        self._on_refused("ConnectionEvicted")
        self.remove(victim)
        victim.close_with_error(QuotaExceededError(f"closed to make room for a new connection: {why}"))
        return True

    def has_session(self, conn: "Connection") -> None:
        """``conn`` opened a session: it is no longer a candidate for eviction or the HELLO deadline."""
        waiting = self._sessionless.get(conn.uid)
        if waiting is not None:
            waiting.pop(conn, None)
            if not waiting:
                del self._sessionless[conn.uid]

    def lost_session(self, conn: "Connection") -> None:
        """``conn`` ended its session (BYE) and stays open: without a session again."""
        if conn.admitted:
            self._sessionless.setdefault(conn.uid, {})[conn] = None

    def remove(self, conn: "Connection") -> None:
        """``conn`` is gone (or going); idempotent."""
        if not conn.admitted:
            return
        conn.admitted = False
        self._all.pop(conn, None)
        self.count -= 1
        self.by_uid[conn.uid] -= 1
        if self.by_uid[conn.uid] <= 0:
            del self.by_uid[conn.uid]
        self.has_session(conn)
