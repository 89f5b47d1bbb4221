"""The training side: config, ``initialize()``, the engine, ZeRO partitioning, CLI.

Re-exports the exception family. The engine is not built yet.
"""
from csrc.errors import BuildError, ConfigError, OffloadError

__all__ = ["BuildError", "ConfigError", "OffloadError"]
