"""The training side: config, ``initialize()``, the engine, ZeRO partitioning, CLI.

Re-exports the exception family (as ``csrc.errors.__all__`` lists it, less the C
helper ``raise_errno``), so a training script catches ``offload.OffloadError`` or a
subclass whatever layer raised it. The engine is not built yet.
"""
from csrc import errors as _errors
from csrc.errors import *  # noqa: F401,F403

__all__ = [name for name in _errors.__all__ if name != "raise_errno"]
