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
