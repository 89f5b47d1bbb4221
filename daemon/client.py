"""``TierClient``: the ``TierStore`` verbs, served by the node daemon.

A training process opens a session (``TierClient(TierClientConfig(...))``), maps its
segments once, and then calls the same verbs as on a local ``TierStore``:
``allocate``, ``info``, ``host_view``, ``mark_dirty``, ``prefetch`` /
``wait_for_prefetch``, ``evict`` / ``wait_for_evict``, ``flush``, ``free``, ``stats``,
``placements``, ``close``, and reads ``engine`` (``.name``, ``.stats()``) and ``space``
(``.files[i].path``). Errors the daemon reports are raised as the same classes a local
store raises (the protocol's error replies name the class). ``host_view`` returns a
``memoryview`` of the daemon's shared memory: no payload crosses the socket and nothing
is copied. Handles are ``ClientHandle`` objects with ``done()``.

One difference in timing, not in outcome: a local store reserves host room when
``prefetch`` is called; the daemon does when the fair scheduler starts the transfer,
so a prefetch without host room fails at its wait (``TierFullError``) rather than at
the call.

``close()`` ends the session now (its memory and extents are freed, as a local
store's ``close`` does); ``detach()`` only drops the connection, and the daemon keeps
the session for its grace period so that a new ``TierClient`` with the same job id and
rank gets it back.

[Note: reattach token] Only the uid that opened a session may reattach to it, and only
with the token of the session's last HELLO reply (see [Note: session ownership] in
``daemon.sessions``). ``TierClient`` handles the token by itself: it keeps it in a file
of its own uid, ``<token_dir>/<hash of socket path, job id, rank>.token`` (mode 0600),
written at every HELLO and removed by ``close()``; a new ``TierClient`` for the same
job id and rank (this process or a restarted one) reads it. ``token_dir`` defaults to
``$XDG_RUNTIME_DIR/offload``, else ``/run/user/<uid>/offload``, else
``/tmp/offload-<uid>``; it is made with mode 0700 and used only if it belongs to this
uid and no one else can read it. ``TierClientConfig.reattach_token`` overrides the file.

A connection the daemon refuses or closes at one of its connection caps is retried
until ``timeout_seconds`` have passed; a connection the daemon closed after its idle
timeout is reopened and the session reattached at the next call.

[Note: reconnect after a daemon restart] A connection lost under a call (the daemon stopped for an
upgrade, or killed) is retried for ``reconnect_seconds``: the session is reattached with its token,
and it must be the same one, over the same memory (each segment's memfd inode is checked), as a
daemon that took over its predecessor's state gives back (``daemon.restart``). Then every transfer not
yet waited for is issued again, under a new handle number the old handle now stands for, and the
call that failed is made again. Each is safe to repeat: a prefetch or evict of a region already
where it was going moves nothing, an ALLOCATE or FREE that the lost daemon had done is found done
(the region is, or is gone), the rest only read or set state. The host views taken before stay valid:
the memory is the same. A daemon that comes back without the session (it kept no state, or could not
prove it whole), or none within ``reconnect_seconds``, is a ``DaemonNotRunningError`` naming it, as
before: the job goes back to its checkpoint.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, NamedTuple

from csrc.errors import ConfigError, DaemonNotRunningError, OffloadError, SessionError
from daemon.backend import region_from_wire, stats_from_wire
from daemon.control import DaemonConnection, daemon_status
from daemon.protocol import PROTOCOL_VERSION, Kind
from daemon.shm import SegmentMap
from daemon.tokens import TokenFile

logger = logging.getLogger(__name__)

__all__ = ["TierClientConfig", "TierClient", "ClientHandle", "DaemonConnection", "daemon_status"]


@dataclass(frozen=True, kw_only=True)
class TierClientConfig:
    """How a training process reaches its node's daemon."""

    socket_path: str = "/run/offload/daemon.sock"
    """The daemon's Unix socket."""
    job_id: str = "default"
    """Names the training job; with ``rank`` it names the session (and its reattach)."""
    rank: int = 0
    """This process's rank on the node."""
    quota_bytes: int = 0
    """Host memory to ask for; 0 takes the daemon's default."""
    timeout_seconds: float = 60.0
    """Longest wait for a reply (waits with their own timeout add it to this)."""
    spin_seconds: float = 50e-6
    """How long to poll for the reply to a small request before sleeping; 0 never polls."""
    reattach_token: str = ""
    """The token to reattach with; empty: the one kept in token_dir (see [Note: reattach token])."""
    token_dir: str | None = None
    """Where reattach tokens are kept; None: the runtime directory of this uid (see the note)."""
    reconnect_seconds: float = 300.0
    """How long a lost connection is retried ([Note: reconnect after a daemon restart]); 0: not at all.
    Long enough for a restart that faults a fresh pool."""

    def __post_init__(self) -> None:
        if self.rank < 0 or self.quota_bytes < 0 or self.timeout_seconds <= 0 or not 0 <= self.spin_seconds < 0.01 \
                or not 0 <= self.reconnect_seconds < 1e6:
            raise ConfigError("TierClientConfig: rank and quota_bytes must be >= 0, timeout_seconds > 0, "
                              "spin_seconds in [0, 0.01), reconnect_seconds in [0, 1e6)")


class ClientHandle:
    """What ``TierClient.prefetch`` / ``evict`` return; pass it to the matching wait verb."""

    __slots__ = ("kind", "number", "names", "_waited")

    def __init__(self, kind: str, number: int, names: list[str]) -> None:
        self.kind, self.number, self.names = kind, number, names
        self._waited = False

    def done(self) -> bool:
        """True once a wait for this handle has returned (as ``TransferHandle.done``)."""
        return self._waited

    def __repr__(self) -> str:
        return f"ClientHandle({self.kind} #{self.number}, {len(self.names)} region(s), done={self._waited})"


def _number(handle: "ClientHandle | int") -> int:
    return handle.number if isinstance(handle, ClientHandle) else int(handle)


class _SwapFileView(NamedTuple):
    index: int
    path: str


class _SpaceView(NamedTuple):
    files: list[_SwapFileView]
    used_bytes: int
    capacity_bytes: int


class _EngineView:
    def __init__(self, client: "TierClient") -> None:
        self._client = client

    @property
    def name(self) -> str:
        return self._client._request(Kind.ENGINE)["name"]

    def stats(self) -> dict[str, Any]:
        return self._client._request(Kind.ENGINE)["stats"]


class TierClient:
    """The TierStore interface over a daemon session; see the module docstring."""

    def __init__(self, config: TierClientConfig) -> None:
        self.config = config
        self._token_file = TokenFile(config.socket_path, config.job_id, config.rank, config.token_dir)
        self._conn, reply, fds = self._hello(config.reattach_token or self._token_file.read())
        try:
            self._segments = SegmentMap(fds, [s["nbytes"] for s in reply["segments"]])
        except BaseException:
            self._conn.close()
            raise
        self.session_id: int = reply["session_id"]
        self.reattached: bool = reply["reattached"]
        self.quota_bytes: int = reply["quota_bytes"]
        self.segment_bytes: int = max((s["nbytes"] for s in reply["segments"]), default=0)
        """The largest of the session's segments: no region can be longer, nor span two."""
        self._idle_check_seconds = float(reply.get("idle_timeout_seconds") or 0) / 2
        self._session_kept = True
        self._reconnecting = threading.Lock()
        self._regions: dict[str, Any] = {}  # placements of host copies, asked for when first viewed
        self._stale: set[str] = set()
        self._closed = False
        self._pending: dict[int, ClientHandle] = {}
        """Handles not yet waited for, by number: issued again after a reconnect (each takes its new number)."""
        self.reconnects = 0
        """Daemon restarts (lost connections) this client went through, reattached."""
        self.reconnect_seconds_total = 0.0
        """Time spent without the daemon, from the lost call to the reattach."""

    def _hello(self, token: str) -> tuple[DaemonConnection, dict[str, Any], list[int]]:
        """Connect and HELLO, retrying while the daemon refuses the connection at a cap."""
        config = self.config
        body = {"version": PROTOCOL_VERSION, "job_id": config.job_id, "rank": config.rank,
                "quota_bytes": config.quota_bytes}
        if token:
            body["token"] = token
        deadline = time.monotonic() + config.timeout_seconds
        pause = 0.05
        while True:
            conn = DaemonConnection(config.socket_path, config.timeout_seconds, config.spin_seconds)
            try:
                reply, fds = conn.request(Kind.HELLO, body)
                break
            except (OffloadError, OSError) as exc:
                conn.close()
                refused = conn.refused or isinstance(exc, DaemonNotRunningError)  # closed before its HELLO reply
                if not refused or time.monotonic() + pause > deadline:
                    raise
                logger.info("the daemon refused the connection (%s); trying again", exc)
                time.sleep(pause)
                pause = min(1.0, pause * 2)
        self._token_file.write(reply.get("token", ""))
        return conn, reply, fds

    def _request(self, kind: Kind, body: dict[str, Any] | Callable[[], dict[str, Any]] | None = None,
                 wait_seconds: float | None = 0.0) -> dict[str, Any]:
        """One request and its reply; ``body`` may be a function that makes it (made again for a call
        made again after a reconnect: a wait names its handle's new number)."""
        if self._idle_check_seconds and time.monotonic() - self._conn.last_used > self._idle_check_seconds \
                and self._conn.peer_closed():
            self._reattach_after_idle()
        conn = self._conn
        try:
            return conn.request(kind, body() if callable(body) else body, wait_seconds)[0]
        except DaemonNotRunningError:
            if not self.config.reconnect_seconds or conn.refused:
                raise
            lost_at = time.monotonic()
        while True:  # [Note: reconnect after a daemon restart]
            with self._reconnecting:
                if self._conn is conn:  # not yet reconnected by another thread that lost it too
                    self._reconnect(lost_at, closing=kind is Kind.BYE)
                conn = self._conn
            try:
                return self._again(kind, body, wait_seconds)
            except DaemonNotRunningError:  # lost again at once: the daemon went down again
                lost_at = time.monotonic()

    def _again(self, kind: Kind, body: Any, wait_seconds: float | None) -> dict[str, Any]:
        """The call that failed, made again after a reconnect, as safe to repeat (see the note)."""
        conn = self._conn
        body = body() if callable(body) else body
        if kind is Kind.ALLOCATE or kind is Kind.FREE:
            try:
                found = conn.request(Kind.REGION, {"name": body["name"], "view": False})[0]
            except ConfigError:  # no such region
                found = None
            if kind is Kind.FREE and found is None:
                return {}
            if kind is Kind.ALLOCATE and found is not None and found["region"]["nbytes"] == body["nbytes"]:
                return found
        elif kind is Kind.BYE and not self._session_kept:
            return {}
        return conn.request(kind, body, wait_seconds)[0]

    def _reconnect(self, lost_at: float, why: str = "lost the daemon", seconds: float | None = None,
                   closing: bool = False) -> None:
        """Reattach the session after a lost connection, within reconnect_seconds; the transfers not
        waited for issued again (a daemon lost again meanwhile is looked for again, within the same time).
        ``DaemonNotRunningError`` when the daemon does not come back with it; with ``closing`` (a BYE was
        lost), a daemon that comes back without it had done the BYE, and that is no error."""
        config = self.config
        self._conn.close()
        seconds = config.reconnect_seconds if seconds is None else seconds
        deadline = lost_at + seconds
        logger.warning("%s on %s; reconnecting for up to %.0f s", why, config.socket_path, seconds)
        while True:
            conn, reply, fds = self._hello_again(deadline, seconds)
            inodes = [os.fstat(fd).st_ino for fd in fds]
            for fd in fds:
                os.close(fd)
            if not (reply["reattached"] and reply["session_id"] == self.session_id and inodes == self._segments.inodes):
                self._session_kept = False
                try:
                    conn.request(Kind.BYE, wait_seconds=None)  # the fresh session it opened is not wanted
                finally:
                    conn.close()
                if closing:  # the lost daemon had done the BYE (journaled) before it died: the session is closed
                    logger.info("session %d was closed by the daemon before it restarted", self.session_id)
                    return
                raise DaemonNotRunningError(
                    f"the daemon on {config.socket_path} came back without session {self.session_id} of job "
                    f"{config.job_id!r} rank {config.rank} (it kept no state, or could not take this session "
                    "over: see its log): its host memory and regions are gone; go back to the last checkpoint")
            self._token_file.write(reply.get("token", ""))
            pending = sorted(self._pending.values(), key=lambda h: h.number)  # in the order they were issued
            try:
                numbers = [conn.request(Kind.PREFETCH if h.kind == "prefetch" else Kind.EVICT,
                                        {"names": h.names})[0]["handle"] for h in pending]
            except DaemonNotRunningError:  # lost again (stopped again) before they were all issued: once more
                conn.close()
                logger.warning("lost the daemon on %s again while reattaching", config.socket_path)
                continue
            break
        self._conn = conn
        self._pending = {}
        for handle, number in zip(pending, numbers):
            handle.number = number
            self._pending[number] = handle
        self._stale.update(self._regions)  # host placements are asked again
        seconds = time.monotonic() - lost_at
        self.reconnects += 1
        self.reconnect_seconds_total += seconds
        logger.warning("reattached session %d after %.2f s without the daemon; %d transfer(s) issued again",
                       self.session_id, seconds, len(self._pending))

    def _hello_again(self, deadline: float, seconds: float) -> tuple[DaemonConnection, dict[str, Any], list[int]]:
        """A HELLO with the session's token, the segments handed back when asked, retried until ``deadline``."""
        config = self.config
        body = {"version": PROTOCOL_VERSION, "job_id": config.job_id, "rank": config.rank,
                "quota_bytes": config.quota_bytes, "token": self._token_file.read() or config.reattach_token,
                "hand_back": len(self._segments.fds)}
        pause = 0.02
        while True:
            conn = None
            try:
                conn = DaemonConnection(config.socket_path, config.timeout_seconds, config.spin_seconds)
                reply, fds = conn.request(Kind.HELLO, body)
                if "hand_back" in reply:  # a daemon restarted without our memory asks for it
                    reply, fds = conn.hand_back(self._segments.fds)
                return conn, reply, fds
            except (OffloadError, OSError) as exc:
                if conn is not None:
                    conn.close()
                attached = isinstance(exc, SessionError) and "already has a session attached" in str(exc)
                if (isinstance(exc, SessionError) and not attached) or time.monotonic() + pause > deadline:
                    raise DaemonNotRunningError(
                        f"the daemon on {config.socket_path} went away and did not come back with session "
                        f"{self.session_id} of job {config.job_id!r} rank {config.rank} within "
                        f"{seconds:.0f} s ({exc}): go back to the last checkpoint") from None
                time.sleep(pause)
                pause = min(0.1, pause * 2)  # a failed connect costs little: find the new daemon soon

    def _reattach_after_idle(self) -> None:
        """The daemon closed the idle connection: reattach to the session (same segments, still mapped), as
        after a lost connection."""
        with self._reconnecting:
            self._reconnect(time.monotonic(), "the daemon closed this idle connection", self.config.timeout_seconds)

    # -- the TierStore verbs ----------------------------------------------------------
    def allocate(self, name: str, nbytes: int) -> Any:
        info = region_from_wire(self._request(Kind.ALLOCATE, {"name": name, "nbytes": nbytes})["region"])
        self._regions[name] = info
        self._stale.discard(name)
        return info

    def info(self, name: str) -> Any:
        return region_from_wire(self._request(Kind.REGION, {"name": name, "view": False})["region"])

    def host_view(self, name: str) -> memoryview:
        """A writable view of the region's bytes in the daemon's shared memory (no copy)."""
        if name not in self._regions or name in self._stale:
            self._regions[name] = region_from_wire(
                self._request(Kind.REGION, {"name": name, "view": True})["region"])
            self._stale.discard(name)
        info = self._regions[name]
        return self._segments.view(info.segment_index, info.offset, info.nbytes)

    def host_ranges(self) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of this client's mapping of each session segment (CUDA registers them)."""
        return self._segments.ranges()

    def mark_dirty(self, name: str) -> None:
        self._request(Kind.MARK_DIRTY, {"name": name})

    def _issue(self, kind: str, names: Iterable[str]) -> ClientHandle:
        names = list(names)
        self._stale.update(names)
        number = self._request(Kind.PREFETCH if kind == "prefetch" else Kind.EVICT, {"names": names})["handle"]
        handle = self._pending[number] = ClientHandle(kind, number, names)
        return handle

    def prefetch(self, names: Iterable[str]) -> ClientHandle:
        return self._issue("prefetch", names)

    def wait_for_prefetch(self, handle: ClientHandle, timeout_seconds: float | None = None) -> None:
        self._wait(Kind.WAIT_PREFETCH, handle, timeout_seconds)

    def evict(self, names: Iterable[str]) -> ClientHandle:
        return self._issue("evict", names)

    def wait_for_evict(self, handle: ClientHandle, timeout_seconds: float | None = None) -> None:
        self._wait(Kind.WAIT_EVICT, handle, timeout_seconds)

    def _wait(self, kind: Kind, handle: ClientHandle | int, timeout_seconds: float | None) -> None:
        """A wait; a ``ClientHandle`` keeps naming its transfer across a reconnect (a bare number does not)."""
        try:
            self._request(kind, lambda: {"handle": _number(handle), "timeout_seconds": timeout_seconds},
                          wait_seconds=timeout_seconds)
        except (OffloadError, OSError) as exc:
            if not isinstance(exc, TimeoutError):  # a failed transfer's wait is its end, as on a local store
                self._pending.pop(_number(handle), None)
            raise
        self._pending.pop(_number(handle), None)
        if isinstance(handle, ClientHandle):
            handle._waited = True

    def flush(self) -> None:
        self._request(Kind.FLUSH, wait_seconds=None)

    def free(self, name: str) -> None:
        self._request(Kind.FREE, {"name": name}, wait_seconds=None)
        self._regions.pop(name, None)
        self._stale.discard(name)

    def stats(self) -> Any:
        return stats_from_wire(self._request(Kind.STATS)["stats"])

    def close(self) -> None:
        """End the session: the daemon frees its memory and extents now."""
        if self._closed:
            return
        self._closed = True
        try:
            self._request(Kind.BYE, wait_seconds=None)
            self._token_file.remove()
        finally:
            self._release()

    def placements(self, name: str) -> list[Any]:
        """Where the region lies in the swap files (``swap.Placement`` tuples)."""
        rows = self._request(Kind.PLACEMENTS, {"name": name})["placements"]
        try:
            from swap import Placement
        except ImportError:
            return [tuple(r) for r in rows]
        return [Placement(*r) for r in rows]

    @property
    def engine(self) -> "_EngineView":
        """The daemon's I/O engine, read only: ``.name`` and ``.stats()`` (shared by all sessions)."""
        return _EngineView(self)

    @property
    def space(self) -> "_SpaceView":
        """The daemon's swap space, read only: ``.files[i].path``, ``.used_bytes``, ``.capacity_bytes``."""
        reply = self._request(Kind.SPACE)
        return _SpaceView([_SwapFileView(i, p) for i, p in enumerate(reply["files"])], reply["used_bytes"],
                          reply["capacity_bytes"])

    # -- daemon extras ----------------------------------------------------------------
    def detach(self) -> None:
        """Drop the connection but keep the session for the daemon's grace period."""
        if not self._closed:
            self._closed = True
            self._release()

    def report_step(self, seconds: float) -> None:
        """Tell the daemon how long an optimizer step took (for its metrics)."""
        self._request(Kind.REPORT_STEP, {"seconds": float(seconds)})

    def job_step(self, *, step: int, step_seconds: float, io_wait_seconds: float, read_bytes: int,
                 write_bytes: int, skipped_steps: int, loss_scale: float, closing: bool = False) -> bool:
        """One optimizer step's figures for the daemon's per-job series (JOB_STEP; ``closing``: the last
        report, at close, which is no step); False when the daemon only counted them (the job is beyond
        its [metrics] max_jobs)."""
        body = {"step": int(step), "step_seconds": float(step_seconds), "io_wait_seconds": float(io_wait_seconds),
                "read_bytes": int(read_bytes), "write_bytes": int(write_bytes), "skipped_steps": int(skipped_steps),
                "loss_scale": float(loss_scale)}
        if closing:
            body["closing"] = True
        reply = self._request(Kind.JOB_STEP, body)
        return bool(reply.get("labelled", False))

    def ping(self) -> None:
        self._request(Kind.PING)

    def _release(self) -> None:
        self._regions.clear()
        self._segments.close()
        self._conn.close()

    def __enter__(self) -> "TierClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
