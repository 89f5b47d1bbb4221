"""One exception family for everything a user can cause.

``OffloadError`` is the root. Subclasses say what went wrong; where a standard
exception already means the same thing (a bad argument is a ``ValueError``), the
subclass inherits from it too, so ``except ValueError`` keeps working. A C
function's ``-errno`` becomes ``OSError(errno, strerror)`` through ``raise_errno``.
"""
from __future__ import annotations

import os

__all__ = [
    "OffloadError",
    "ConfigError",
    "BuildError",
    "TierFullError",
    "SwapIOError",
    "CheckpointWriteError",
    "ChecksumError",
    "DaemonNotRunningError",
    "ProtocolError",
    "QuotaExceededError",
    "SessionError",
    "StateTornError",
    "RendezvousError",
    "raise_errno",
]


class OffloadError(Exception):
    """Root of every error this project raises for something a user can cause."""


class ConfigError(OffloadError, ValueError):
    """A configuration value or argument is wrong; the message names it."""


class BuildError(OffloadError, ImportError):
    """The compiled C extension is missing or stale; the message says how to rebuild."""


class TierFullError(OffloadError):
    """A tier has no room: the host pool, the swap space's extents, or the file system
    under a swap path (ENOSPC). The message names the region and the tier or path."""


class SwapIOError(OffloadError, OSError):
    """A read or write of a swap file failed, was short, or its path is unusable.
    ``errno`` is set where the system gave one; the message names the region and path."""


class CheckpointWriteError(OffloadError, OSError):
    """A checkpoint save failed to write (a full disk: ``errno`` ENOSPC). The message names the tag's
    path; the partial tag is removed and ``latest`` still names the previous save."""


class ChecksumError(SwapIOError):
    """Data read back from a swap file does not match the checksum taken when it was
    written: the file was corrupted or changed underneath."""


class DaemonNotRunningError(OffloadError, ConnectionError):
    """No daemon answers on the socket path (or it went away); the message names the path."""


class ProtocolError(OffloadError):
    """A message broke the daemon protocol (bad framing, version, kind or field); says which."""


class QuotaExceededError(OffloadError, MemoryError):
    """A session asked for more host memory than its quota (or the node pool) has left."""


class SessionError(OffloadError):
    """A session cannot be opened or reattached (already attached, unknown, or refused)."""


class StateTornError(SessionError):
    """A trainer died inside an optimizer step: the state its session holds is inconsistent and is
    never resumed from (load the last checkpoint instead)."""


class RendezvousError(OffloadError, TimeoutError):
    """The ranks of a job did not meet to form their process group in time; the message names what
    this rank waited for (which ranks, which store, for how long)."""


def raise_errno(rc: int, what: str) -> None:
    """Raise ``OSError`` for a C return code ``rc`` (0 or ``-errno``); ``what`` names the call."""
    if rc == 0:
        return
    err = -rc if rc < 0 else rc
    raise OSError(err, f"{what}: {os.strerror(err)}")
