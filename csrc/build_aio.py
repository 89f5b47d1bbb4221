"""cffi build script for the async direct-I/O engine and CRC-32C (out-of-line API mode).

Wired into the packaging by setup.py's ``cffi_modules``. Linux AIO is reached through
raw syscalls and the kernel ABI header ``<linux/aio_abi.h>`` (part of the kernel
headers, not of libaio), so neither libaio nor its headers are needed to build.
"""
from __future__ import annotations

import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cffi_header import make_builder  # noqa: E402  (a sibling file, not the package)

SOURCES = ["aio.c", "aio_linux.c", "aio_uring.c", "crc32c.c"]

ffibuilder = make_builder("_aio", "ofl_aio.h", SOURCES, flags=["-O2"])

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
