"""Turn a C header of this project into text that cffi's cdef accepts.

The header is the one declaration source (STYLE: C through cffi). cdef takes no
preprocessor, so guards and includes are dropped; ``#define NAME <integer>`` lines
are kept, which cdef turns into integer constants on ``lib``.
"""
from __future__ import annotations

import pathlib
import re

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
