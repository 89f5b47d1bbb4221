"""What the cffi build scripts share: header-to-cdef text and the builder setup.

The header is the one declaration source (STYLE: C through cffi). cdef takes no
preprocessor, so guards and includes are dropped; ``#define NAME <integer>`` lines
are kept, which cdef turns into integer constants on ``lib``.
"""
from __future__ import annotations

import pathlib
import re

from cffi import FFI

_INT_DEFINE = re.compile(r"^#define\s+\w+\s+-?(0x[0-9a-fA-F]+|\d+)\s*$")


def cdef_text(header: pathlib.Path) -> str:
    """Return the header's declarations with only integer #defines kept."""
    text = re.sub(r"/\*.*?\*/", "", header.read_text(), flags=re.S)
    lines = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") and not _INT_DEFINE.match(stripped):
            continue
        lines.append(line)
    return "\n".join(lines)


WARNINGS = ["-std=gnu11", "-pthread", "-Wall", "-Wextra", "-Wno-unused-parameter"]


def make_builder(module: str, header: str, sources: list[str], *, flags: list[str],
                 libraries: list[str] = ()) -> FFI:
    """An out-of-line API-mode FFI for ``csrc.<module>`` from ``csrc/<header>`` and ``csrc/<sources>``.

    Paths are relative to the project root, where setuptools runs the build.
    """
    here = pathlib.Path(__file__).resolve().parent
    ffi = FFI()
    ffi.cdef(cdef_text(here / header))
    ffi.set_source(
        f"csrc.{module}",
        f'#include "{header}"',
        sources=[f"csrc/{name}" for name in sources],
        include_dirs=["csrc"],
        extra_compile_args=flags + WARNINGS,
        extra_link_args=["-pthread"],
        libraries=list(libraries),
    )
    return ffi
