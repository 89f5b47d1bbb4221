"""cffi build script for the SIMD Adam kernels (out-of-line API mode).

Wired into the packaging by setup.py's ``cffi_modules``, so ``pip install`` compiles
it with the system C compiler; nothing is compiled at run time. One build carries the
scalar, AVX2 and AVX-512 paths; the AVX files set their own target with a pragma, and
the choice is made at run time from the CPU's features.
"""
from __future__ import annotations

import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cffi_header import make_builder  # noqa: E402  (a sibling file, not the package)

SOURCES = ["adam.c", "adam_scalar.c", "adam_avx2.c", "adam_avx512.c", "adam_avx512bf16.c", "adam_undo.c",
           "ofl_parallel.c", "adam_q8.c", "adam_q8_scalar.c", "adam_q8_avx2.c", "adam_q8_avx512.c",
           "adam_q8_avx512vbmi.c", "adam_master.c"]

ffibuilder = make_builder("_adam", "ofl_adam.h", SOURCES, flags=["-O3", "-fno-math-errno"], libraries=["m", "dl"])

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
