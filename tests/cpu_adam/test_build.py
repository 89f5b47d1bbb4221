"""The build: a stale library fails loudly, and the header is the one declaration source."""
from __future__ import annotations

import importlib.machinery
import os
import pathlib
import re
import shutil
import subprocess
import sys

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


def test_a_stale_build_that_hides_a_fresh_one_is_named(tmp_path):
    """A stale interpreter-suffix build beside an .abi3.so one (what ``python csrc/build_adam.py`` and
    ``pip install`` write): Python imports the first, so the message names it to be removed. In a
    second process: an extension module imported under a second name shares its state with the first."""
    import csrc._adam as built
    with pytest.raises(BuildError) as alone:  # nothing beside the one imported here: no such clause
        load_extension("csrc._adam", "ofl_adam_abi_version", 0, "the Adam kernels")
    assert "remove it" not in str(alone.value), str(alone.value)
    pkg = tmp_path / "shadowpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    own = importlib.machinery.EXTENSION_SUFFIXES[0]  # the suffix Python tries first
    shutil.copy(built.__file__, pkg / f"_adam{own}")
    (pkg / "_adam.abi3.so").write_bytes(b"")  # the other build, never loaded
    code = ("from csrc.loader import load_extension\n"
            "try:\n    load_extension('shadowpkg._adam', 'ofl_adam_abi_version', 0, 'the Adam kernels')\n"
            "except ImportError as exc:\n    print(exc)\n")
    repo = pathlib.Path(kernels.__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(repo)]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert re.search(rf"stale build \(ABI \d+, this code needs 0\).*the stale one is .*shadowpkg/_adam"
                     rf"{re.escape(own)}, which Python imports before _adam\.abi3\.so beside it: remove it",
                     out.stdout), (out.stdout, out.stderr)


def test_compiled_abi_matches_the_header():
    declared = int(re.search(r"#define OFL_ADAM_ABI_VERSION (\d+)", HEADER.read_text()).group(1))
    assert lib.ofl_adam_abi_version() == declared == kernels.ABI_VERSION


def test_cdef_keeps_integer_defines_and_drops_other_preprocessor_lines():
    text = cdef_text(HEADER)
    kept = [line.strip() for line in text.splitlines() if line.strip().startswith("#")]
    assert kept and all(re.match(r"#define \w+ -?\d+$", line) for line in kept)
    assert "ofl_adam_step" in text and "/*" not in text
