"""The bottom layer: C sources compiled by cffi at install, and the exception family.

Imports go one way: ``csrc <- cpu_adam, swap <- daemon <- offload``. This package
imports nothing else of the project, so every layer above can raise and catch the
same errors.
"""
from csrc.errors import (
    ConfigError,
    BuildError,
    ChecksumError,
    OffloadError,
    SwapIOError,
    TierFullError,
    raise_errno,
)

__all__ = [
    "ConfigError",
    "BuildError",
    "ChecksumError",
    "OffloadError",
    "SwapIOError",
    "TierFullError",
    "raise_errno",
]
