"""Import a compiled cffi extension of this project and check its ABI version.

A missing or stale build fails loudly at import with a ``BuildError`` that says how to
rebuild, instead of misbehaving later (STYLE: export an ABI version, check it at import).
"""
from __future__ import annotations

import importlib
from pathlib import Path
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
        raise BuildError(f"{module} is a stale build (ABI {found}, this code needs {expected_abi}); "
                         f"{REBUILD_HINT}{_shadowed(ext)}")
    return ext.ffi, ext.lib


def _shadowed(ext: Any) -> str:
    """The other builds of the module beside the one imported, which Python passed over: it tries
    the interpreter's own suffix (``.cpython-311-...so``, what ``python csrc/build_adam.py`` writes)
    before ``.abi3.so`` (what ``pip install`` writes), so a stale file of the first kind hides a
    fresh build of the second."""
    path = Path(getattr(ext, "__file__", "") or ".")
    if not path.is_file():
        return ""
    stem = path.name.split(".", 1)[0]
    others = sorted(p.name for p in path.parent.glob(f"{stem}.*") if p != path and p.name.endswith((".so", ".pyd")))
    if not others:
        return ""
    return f"; the stale one is {path}, which Python imports before {', '.join(others)} beside it: remove it"
