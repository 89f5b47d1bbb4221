"""Import a compiled cffi extension of this project and check its ABI version.

A missing or stale build fails loudly at import with a ``BuildError`` that says how to
rebuild, instead of misbehaving later (STYLE: export an ABI version, check it at import).
"""
from __future__ import annotations

import importlib
from typing import Any

from csrc.errors import BuildError

__all__ = ["REBUILD_HINT", "load_extension"]

REBUILD_HINT = "rebuild it with `pip install -e .` (or `pip install .`) from the project root"


def load_extension(module: str, abi_symbol: str, expected_abi: int, what: str) -> tuple[Any, Any]:
    """``(ffi, lib)`` of ``module`` once ``lib.<abi_symbol>()`` returns ``expected_abi``."""
    try:
        ext = importlib.import_module(module)
    except ImportError as exc:
        raise BuildError(f"{what} ({module}) is missing: {exc}; {REBUILD_HINT}") from exc
    found = getattr(ext.lib, abi_symbol)()
    if found != expected_abi:
        raise BuildError(f"{module} is a stale build (ABI {found}, this code needs {expected_abi}); {REBUILD_HINT}")
    return ext.ffi, ext.lib
