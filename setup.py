"""Only here to hand cffi its build scripts; everything else is in pyproject.toml."""
from setuptools import setup

setup(cffi_modules=["csrc/build_adam.py:ffibuilder", "csrc/build_aio.py:ffibuilder"])
