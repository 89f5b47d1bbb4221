"""cffi build script for the SIMD Adam kernels (out-of-line API mode).

Wired into the packaging by setup.py's ``cffi_modules``, so ``pip install`` compiles
it with the system C compiler; nothing is compiled at run time. One build carries the
scalar, AVX2 and AVX-512 paths; the AVX files set their own target with a pragma, and
the choice is made at run time from the CPU's features.
"""
from __future__ import annotations

import pathlib
import sys

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cffi_header import cdef_text  # noqa: E402  (a sibling file, not the package)

SOURCES = ["adam.c", "adam_scalar.c", "adam_avx2.c", "adam_avx512.c", "ofl_parallel.c"]

ffibuilder = FFI()
ffibuilder.cdef(cdef_text(HERE / "ofl_adam.h"))
ffibuilder.set_source(
    "csrc._adam",
    '#include "ofl_adam.h"',
    sources=[f"csrc/{name}" for name in SOURCES],
    include_dirs=["csrc"],
    extra_compile_args=["-O3", "-std=gnu11", "-fno-math-errno", "-pthread", "-Wall", "-Wextra",
                        "-Wno-unused-parameter"],
    extra_link_args=["-pthread"],
    libraries=["m"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
