"""The training side: config, ``initialize()``, the engine, ZeRO partitioning, CLI.

Re-exports the exception family, so a training script catches ``offload.OffloadError``
(or a subclass) whatever layer raised it. The engine is not built yet.
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
]
