"""What a daemon keeps for its successor, and what a successor takes over ([Note: adopted state] in
``daemon.journal``).

``StateKeeper(config.server)`` resolves ``[server] keep_state``. At start, before the backend is built,
``load()`` reads what a predecessor left (the fd store's fds, or the state directory's journal) and
returns the ``BackendAdoption`` to build the backend with, or None. It proves each part consistent
first: each segment's memfd must be the one the journal names (its inode), the pool must have the same
shape and the swap paths the same count; what fails is refused with a log line naming it, and the
sessions that needed it are not taken over (their trainers go back to their checkpoint, as when the
daemon died before). A session none of whose segments came back (no fd store) is kept *pending*: its
trainer may hand them back ([Note: hand-back] in ``daemon.handback``). After the sessions are restored, ``start(backend, sessions)`` writes the first
generation of this daemon's journal and keeps every segment in the fd store. From then on the session
table and the stores tell it of each change (``opened``, ``token``, ``closing``, ``region_hook``) and a
clean stop (``stop``) writes a last generation.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable

from daemon.backend import BackendAdoption
from daemon.config import DaemonConfig
from daemon.journal import JOURNAL_FDNAME, FileSink, Journal, MemfdSink, newest_state, read_records, state_of
from daemon.notify import listen_fds, remove_fds, store_available, store_fds
from daemon.pool import Adoption

logger = logging.getLogger(__name__)

__all__ = ["StateKeeper", "SEGMENT_FDNAME"]

SEGMENT_FDNAME = "seg"
"""fd store names of the pool's segments: ``seg-<index>``."""


def resolve_mode(keep_state: str, state_dir: str) -> tuple[str, str]:
    """(mode, state directory) for ``[server] keep_state`` and ``state_dir`` in this environment."""
    state_dir = state_dir or os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    if keep_state == "auto":
        keep_state = "fd_store" if store_available() else "state_dir" if state_dir else "off"
    if keep_state == "state_dir" and not state_dir:
        keep_state = "off"
        logger.warning("[server] keep_state = \"state_dir\" without a state_dir (nor $STATE_DIRECTORY): "
                       "a restart keeps no session")
    return keep_state, state_dir


class StateKeeper:
    """See the module docstring."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.mode, self.state_dir = resolve_mode(config.server.keep_state, config.server.state_dir)
        self.journal: Journal | None = None
        self.previous: dict[str, Any] | None = None
        """The predecessor's state, as far as it was proven consistent (its sessions: those to take over)."""
        self.refused: list[str] = []
        """One line for each thing of the predecessor's that was not taken over."""
        self.refused_sessions = 0
        """The predecessor's sessions not taken over, for ``offload_sessions_refused_total``."""
        self._stored: dict[str, list[int]] = {}
        self._adopted: set[int] = set()
        self._generation = 0
        self.pending: dict[str, dict[str, Any]] = {}
        """The predecessor's sessions whose segments are not here: their trainers are to hand them back."""

    @property
    def active(self) -> bool:
        return self.mode != "off"

    # -- at start --------------------------------------------------------------------------
    def load(self) -> BackendAdoption | None:
        """Read what a predecessor left; None when there is nothing to take over."""
        if self.mode == "fd_store":
            self._stored = listen_fds()
            state, self._generation = newest_state(self._stored)
            if self._stored:
                logger.info("the fd store passed %d fd(s) (%s)", sum(map(len, self._stored.values())),
                            ", ".join(sorted(self._stored)[:6]) + (" ..." if len(self._stored) > 6 else ""))
        elif self.mode == "state_dir":
            state = state_of(read_records(FileSink(self.state_dir).read()))
        else:
            return None
        if state is None:
            self._close_stored()
            return None
        adoption = self._prove(state)
        if adoption is None:
            self._close_stored()
        return adoption

    def _refuse(self, line: str, sessions: int = 1) -> None:
        self.refused.append(line)
        self.refused_sessions += sessions
        logger.warning("not taken over from the previous daemon: %s", line)

    def _prove(self, state: dict[str, Any]) -> BackendAdoption | None:
        pool, swap, sessions = state["pool"], state["swap"], state["sessions"]
        config = self.config
        if not sessions:
            logger.info("the previous daemon left no session")
            return None
        count = config.pool.capacity_bytes // config.pool.segment_bytes
        if (pool["segment_bytes"], pool["count"]) != (config.pool.segment_bytes, count):
            self._refuse(f"all {len(sessions)} session(s): the pool was {pool['count']} segment(s) of "
                         f"{pool['segment_bytes']} bytes and is now {count} of {config.pool.segment_bytes}",
                         len(sessions))
            return None
        paths = list(config.swap.get("paths", ()))
        if len(swap["dirs"]) != len(paths) or len(swap["files"]) != len(paths):
            self._refuse(f"all {len(sessions)} session(s): the swap paths changed ({len(swap['dirs'])} before, "
                         f"{len(paths)} now)", len(sessions))
            return None
        fds: dict[int, int] = {}
        for name, held in self._stored.items():
            prefix, _, index = name.rpartition("-")
            if prefix == SEGMENT_FDNAME and index.isdigit() and held:
                fd = held[-1]
                if pool["inodes"].get(index) == os.fstat(fd).st_ino:
                    fds[int(index)] = fd
        vacant: dict[int, int] = {}
        for sid, s in list(sessions.items()):
            missing = [i for i in s["segments"] if i not in fds]
            if missing and len(missing) == len(s["segments"]):  # [Note: hand-back]: its trainer may have them
                vacant.update((i, pool["inodes"][str(i)]) for i in missing)
                self.pending[sid] = sessions.pop(sid)
            elif missing:
                self._refuse(f"job {s['job_id']!r} rank {s['rank']} (uid {s['uid']}): its host memory is gone "
                             f"(segment(s) {missing[:8]}: not in the fd store, or not the same memfd)")
                del sessions[sid]
        if not sessions and not self.pending:
            return None
        self.previous = state
        self._adopted = set(fds)
        lent = {i for s in sessions.values() for i in s["segments"]}
        given = {int(uid): [i for i in indices if i in fds] for uid, indices in pool["given"].items()}
        for name, held in self._stored.items():
            keep = [fd for fd in held if fd in fds.values() or name.startswith(JOURNAL_FDNAME + "-")]
            for fd in set(held) - set(keep):
                os.close(fd)
            self._stored[name] = keep
        return BackendAdoption(list(swap["dirs"]), list(swap["files"]), Adoption(fds, lent, given, vacant))

    def _journal_fds(self) -> set[int]:
        return {fd for name, held in self._stored.items() if name.startswith(JOURNAL_FDNAME + "-") for fd in held}

    def _close_stored(self) -> None:
        """Close every fd the store passed (their names stay known: ``start`` replaces them)."""
        for name, held in self._stored.items():
            for fd in held:
                os.close(fd)
            self._stored[name] = []

    def refuse_all(self, why: str) -> None:
        """The backend could not take over the predecessor's swap files or segments: start afresh."""
        if self.previous is not None:
            count = len(self.previous["sessions"]) + len(self.pending)
            self._refuse(f"all {count} session(s): {why}", count)
        self.previous, self.pending = None, {}
        self._close_stored()

    def start(self, backend: Any, session_rows: dict[str, dict[str, Any]], next_session_id: int) -> None:
        """Write this daemon's first journal generation (after the sessions were restored) and keep every
        pool segment in the fd store; from here on changes are journaled."""
        if not self.active:
            return
        if self.mode == "fd_store":
            for fd in self._journal_fds():
                os.close(fd)
            if self.previous is None:
                self._generation = 0  # nothing taken over: the old generations go too
            for name in self._stored:
                if name.startswith(JOURNAL_FDNAME + "-") and name != f"{JOURNAL_FDNAME}-{self._generation}":
                    remove_fds(name)  # an older generation a kill left behind
            for index, seg in backend.pool_segments().items():
                if index not in self._adopted:
                    name = f"{SEGMENT_FDNAME}-{index}"
                    if name in self._stored:
                        remove_fds(name)  # not the memfd the journal named
                    store_fds([seg.fd], name)
            sink: Any = MemfdSink(store_fds, remove_fds, self._generation)
        else:
            sink = FileSink(self.state_dir)
        self._stored = {}
        pool = backend.pool_record()
        state = {"pool": pool, "swap": backend.swap_record(), "sessions": session_rows,
                 "next_session_id": next_session_id}
        self.journal = Journal(sink, state)
        backend.on_segment = self._segment
        logger.info("keeping state for a successor (%s%s): %d session(s) taken over", self.mode,
                    f" in {self.state_dir}" if self.mode == "state_dir" else "", len(session_rows))

    # -- changes ---------------------------------------------------------------------------
    def _append(self, record: dict[str, Any]) -> None:
        if self.journal is not None:
            self.journal.append(record)

    def _segment(self, seg: Any, made: bool) -> None:
        """A pool segment replaced after start (another uid's, made anew): its fd and inode are new."""
        if self.journal is None:
            return
        name = f"{SEGMENT_FDNAME}-{seg.index}"
        if not made:
            if self.mode == "fd_store":
                remove_fds(name)
            return
        if self.mode == "fd_store":
            store_fds([seg.fd], name)
        self._append({"op": "segment", "index": seg.index, "inode": os.fstat(seg.fd).st_ino})

    def opened(self, session: Any) -> None:
        self._append({"op": "open", "id": session.session_id, "uid": session.owner_uid, "job_id": session.job_id,
                      "rank": session.rank, "token": session.token, "quota_bytes": session.quota_bytes,
                      "segments": [seg.index for seg in session.segments]})

    def token(self, session: Any) -> None:
        self._append({"op": "token", "id": session.session_id, "token": session.token})

    def closing(self, session: Any) -> None:
        self._append({"op": "close", "id": session.session_id})

    def region_hook(self, session_id: int) -> Callable[[str, dict | None], None] | None:
        """The ``on_change`` of a session's store: each region's durable record, journaled."""
        if not self.active:
            return None

        def changed(name: str, record: dict | None) -> None:
            if record is None:
                self._append({"op": "free", "id": session_id, "name": name})
            else:
                self._append({"op": "region", "id": session_id, "name": name, "region": record})
        return changed

    def stop(self) -> None:
        """A clean stop: the whole state as one last generation, for the successor to read at once."""
        if self.journal is not None:
            self.journal.snapshot()
            self.journal.close()
            self.journal = None
