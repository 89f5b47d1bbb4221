"""systemd's readiness protocol (``sd_notify``), without libsystemd: one datagram to ``$NOTIFY_SOCKET``.

Under ``Type=notify`` systemd counts the service as started only when it reads ``READY=1``
on the socket it names in ``NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract
namespace), so units ordered after the daemon, and ``systemctl start`` itself, wait until
the pool is faulted and the socket serves. ``STOPPING=1`` says a drain has begun and
``STATUS=`` is the line ``systemctl status`` shows. Without ``NOTIFY_SOCKET`` (not under
systemd) every call does nothing. A failed send is logged, never raised: readiness
reporting must not stop a daemon that serves.
"""
from __future__ import annotations

import array
import logging
import os
import socket

logger = logging.getLogger(__name__)

__all__ = ["notify"]


def _address(name: str) -> str | bytes:
    return b"\0" + name[1:].encode() if name.startswith("@") else name


def notify(**fields: str | int) -> bool:
    """Send ``KEY=value`` lines (``notify(READY=1, STATUS="serving")``); True if a datagram went out."""
    name = os.environ.get("NOTIFY_SOCKET", "")
    if not name:
        return False
    message = "\n".join(f"{key}={value}" for key, value in fields.items()).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(message, _address(name))
    except OSError as exc:
        logger.warning("could not tell systemd %s on NOTIFY_SOCKET %s: %s", message.decode(), name,
                       exc.strerror or exc)
        return False
    return True


def store_fds(fds: list[int], name: str) -> bool:
    """Keep ``fds`` in systemd's fd store under ``name`` (``FDSTORE=1``; the unit needs
    ``FileDescriptorStoreMax=``): systemd holds them while the service restarts and hands them to the
    next start (``listen_fds``). False without ``NOTIFY_SOCKET`` or when the send fails."""
    address = os.environ.get("NOTIFY_SOCKET", "")
    if not address:
        return False
    message = f"FDSTORE=1\nFDNAME={name}".encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            # sendmsg, not socket.send_fds: 3.11's drops the address (ENOTCONN on an unconnected socket)
            sock.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))], 0,
                         _address(address))
    except OSError as exc:
        logger.warning("could not keep %s in systemd's fd store: %s", name, exc.strerror or exc)
        return False
    return True


def remove_fds(name: str) -> bool:
    """Drop every fd systemd's fd store keeps under ``name`` (``FDSTOREREMOVE=1``)."""
    return notify(FDSTOREREMOVE=1, FDNAME=name)


SD_LISTEN_FDS_START = 3


def listen_fds() -> dict[str, list[int]]:
    """The fds systemd passed to this start (``LISTEN_FDS`` from 3, ``LISTEN_FDNAMES``), by name; made
    close-on-exec and the variables removed, as ``sd_listen_fds(1)`` does. Empty when they are not for
    this process (``LISTEN_PID`` names another)."""
    count, pid = os.environ.pop("LISTEN_FDS", ""), os.environ.pop("LISTEN_PID", "")
    names = os.environ.pop("LISTEN_FDNAMES", "")
    if not count.isdigit() or (pid and pid != str(os.getpid())):
        return {}
    labels = names.split(":") if names else []
    passed: dict[str, list[int]] = {}
    for i in range(int(count)):
        fd = SD_LISTEN_FDS_START + i
        try:
            os.set_inheritable(fd, False)
        except OSError:
            logger.warning("LISTEN_FDS names fd %d, which is not open", fd)
            continue
        passed.setdefault(labels[i] if i < len(labels) else "unknown", []).append(fd)
    return passed


def store_available() -> bool:
    """Whether this process can keep fds in systemd's fd store (it runs under a notify socket)."""
    return bool(os.environ.get("NOTIFY_SOCKET"))
