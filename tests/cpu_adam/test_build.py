"""The build: a stale library fails loudly, and the header is the one declaration source."""
from __future__ import annotations

import pathlib
import re

import pytest

from cpu_adam import kernels
from csrc import BuildError
from csrc._adam import lib
from csrc.cffi_header import cdef_text
from csrc.loader import load_extension

HEADER = pathlib.Path(kernels.__file__).resolve().parents[1] / "csrc" / "ofl_adam.h"


def test_stale_or_missing_build_names_the_fix():
    ffi, lib_again = load_extension("csrc._adam", "ofl_adam_abi_version", kernels.ABI_VERSION, "Adam")
    assert lib_again is lib
    with pytest.raises(BuildError, match=rf"stale build \(ABI {kernels.ABI_VERSION}, this code needs 0\).*pip install -e \."):
        load_extension("csrc._adam", "ofl_adam_abi_version", 0, "the Adam kernels")
    with pytest.raises(BuildError, match=r"the Adam kernels \(csrc._nothing\) is missing.*pip install"):
        load_extension("csrc._nothing", "ofl_adam_abi_version", 1, "the Adam kernels")
    assert issubclass(BuildError, ImportError)


def test_compiled_abi_matches_the_header():
    declared = int(re.search(r"#define OFL_ADAM_ABI_VERSION (\d+)", HEADER.read_text()).group(1))
    assert lib.ofl_adam_abi_version() == declared == kernels.ABI_VERSION


def test_cdef_keeps_integer_defines_and_drops_other_preprocessor_lines():
    text = cdef_text(HEADER)
    kept = [line.strip() for line in text.splitlines() if line.strip().startswith("#")]
    assert kept and all(re.match(r"#define \w+ -?\d+$", line) for line in kept)
    assert "ofl_adam_step" in text and "/*" not in text
