"""The bottom layer: C sources compiled by cffi at install, and the exception family.

Imports go one way: ``csrc <- cpu_adam, swap <- daemon <- offload``. This package
imports nothing else of the project, so every layer above can raise and catch the
same errors.
"""
from csrc.errors import (
    BuildError,
    ChecksumError,
    ConfigError,
    DaemonNotRunningError,
    OffloadError,
    ProtocolError,
    QuotaExceededError,
    SessionError,
    SwapIOError,
    TierFullError,
    raise_errno,
)

__all__ = [
    "BuildError",
    "ChecksumError",
    "ConfigError",
    "DaemonNotRunningError",
    "OffloadError",
    "ProtocolError",
    "QuotaExceededError",
    "SessionError",
    "SwapIOError",
    "TierFullError",
    "raise_errno",
]
