"""Sessions whose memory the trainers hand back to a restarted daemon.

[Note: hand-back] Without systemd's fd store (``[server] keep_state = "state_dir"``), a daemon's segments
die with it, but not their memory: each trainer still maps its session's memfds, and can send them to the
next daemon. That daemon reads the journal its predecessor left in the state directory, takes over the
swap files, holds each journaled session's swap extents, leaves its segments *vacant* in the pool (not
made: their memory is in the trainers' hands), and keeps the session *pending*, detached, for the
reattach grace period. A trainer that reattaches with the session's token and offers its segments
(HELLO's ``hand_back``) is asked for them; the daemon checks that they are the memfds the journal names
(their inodes, in order) and only then maps them, rebuilds the store and restores every region as
journaled. A pending session whose trainer does not come back in time is reclaimed: its extents freed,
its vacant segments made anew. A hand-back that does not match is refused, and the trainer is told to go
back to its checkpoint, as when nothing was kept.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Any

from csrc.errors import ProtocolError, SessionError
from daemon.shm import recv_with_fds

logger = logging.getLogger(__name__)

__all__ = ["HandBackNeeded", "receive_hand_back", "take_hand_back", "HAND_BACK_TIMEOUT_SECONDS"]

HAND_BACK_TIMEOUT_SECONDS = 10.0
"""How long a daemon that asked for a session's segments waits for them before it closes the connection."""


class HandBackNeeded(Exception):
    """Internal to the daemon: a reattach to a pending session, which needs its trainer's segments first."""

    def __init__(self, session: Any) -> None:
        super().__init__(f"session {session.session_id} waits for its segments")
        self.session = session


async def receive_hand_back(transport: asyncio.Transport, count: int) -> list[int]:
    """The ``count`` fds a client sends with one byte, read off the transport's socket while it reads
    nothing else (the caller has paused it, and asked for them)."""
    loop = asyncio.get_running_loop()
    # A duplicate of the transport's socket (asyncio watches no fd a transport owns for anyone else): the same
    # open socket, non-blocking as the transport keeps it.
    sock = socket.socket(fileno=os.dup(transport.get_extra_info("socket").fileno()))
    fd = sock.fileno()
    got: asyncio.Future[list[int]] = loop.create_future()

    def readable() -> None:
        if got.done():
            return
        try:
            data, fds = recv_with_fds(sock, 1)
        except BlockingIOError:
            return
        except (OSError, ProtocolError) as exc:
            got.set_exception(exc)
            return
        if not data:
            got.set_exception(ProtocolError("the client closed the connection before handing its segments back"))
        elif len(fds) != count:
            for x in fds:
                os.close(x)
            got.set_exception(ProtocolError(f"a hand-back of {len(fds)} fd(s); the session has {count} segment(s)"))
        else:
            got.set_result(fds)

    loop.add_reader(fd, readable)
    try:
        return await asyncio.wait_for(got, HAND_BACK_TIMEOUT_SECONDS)
    except asyncio.TimeoutError:
        raise ProtocolError(f"no segments handed back within {HAND_BACK_TIMEOUT_SECONDS} s") from None
    finally:
        loop.remove_reader(fd)
        sock.close()  # the duplicate only


async def take_hand_back(table: Any, session: Any, fds: list[int]) -> None:
    """Rebuild a pending session over the segments its trainer handed back (``fds``, in its order), or
    refuse them (``SessionError``, the session reclaimed); the fds are this daemon's either way."""
    row, backend = session.pending, table.backend
    indices = list(row["segments"])
    inodes = [os.fstat(fd).st_ino for fd in fds]
    expected = backend.vacant_inodes(indices)
    if inodes != expected:
        for fd in fds:
            os.close(fd)
        await table.reclaim(session)
        raise SessionError(f"job {session.job_id!r} rank {session.rank}: the segments handed back are not the "
                           f"memory the journal names (inodes {inodes}, journaled {expected}); session refused")

    released = []

    def build() -> Any:
        backend.release_extents(row["regions"])
        released.append(True)
        backend.install(indices, fds)
        opened = backend.open_store(session.quota_bytes, session.owner_uid, table.region_hook(session.session_id),
                                    indices)
        try:
            for name, record in row["regions"].items():
                opened.store.restore(name, record)
        except BaseException:
            opened.close()
            raise
        return opened

    try:
        opened = await table.run(build)
    except Exception as exc:
        def undo() -> None:  # whatever build() got to: the extents, the segments installed or still vacant
            if not released:
                backend.release_extents(row["regions"])
            backend.return_adopted(indices, session.owner_uid)
            backend.fill(indices)

        session.pending, session.closer = None, undo
        await table.reclaim(session)
        raise SessionError(f"job {session.job_id!r} rank {session.rank}: its regions could not be restored over "
                           f"the segments handed back ({exc}); session refused") from None
    session.store, session.segments, session.closer = opened.store, list(opened.segments), opened.close
    session.pending = None
    logger.info("job %s rank %d handed its %d segment(s) back; session %d restored with %d region(s)",
                session.job_id, session.rank, len(fds), session.session_id, session.regions)
