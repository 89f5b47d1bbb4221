"""cffi build script for the async direct-I/O engine and CRC-32C (out-of-line API mode).

Wired into the packaging by setup.py's ``cffi_modules``. Linux AIO is reached through
raw syscalls and the kernel ABI header ``<linux/aio_abi.h>`` (part of the kernel
headers, not of libaio), so neither libaio nor its headers are needed to build.
"""
from __future__ import annotations

import pathlib
import sys

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cffi_header import cdef_text  # noqa: E402  (a sibling file, not the package)

SOURCES = ["aio.c", "aio_linux.c", "aio_uring.c", "crc32c.c"]

ffibuilder = FFI()
ffibuilder.cdef(cdef_text(HERE / "ofl_aio.h"))
ffibuilder.set_source(
    "csrc._aio",
    '#include "ofl_aio.h"',
    sources=[f"csrc/{name}" for name in SOURCES],
    include_dirs=["csrc"],
    extra_compile_args=["-O2", "-std=gnu11", "-pthread", "-Wall", "-Wextra", "-Wno-unused-parameter"],
    extra_link_args=["-pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
