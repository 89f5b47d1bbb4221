"""The bottom layer: C sources compiled by cffi at install, and the exception family.

Imports go one way: ``csrc <- cpu_adam, swap <- daemon <- offload``. This package
imports nothing else of the project, so every layer above can raise and catch the
same errors. The family is listed once, in ``csrc.errors.__all__``.
"""
from csrc import errors
from csrc.errors import *  # noqa: F401,F403  (the family, as errors.__all__ lists it)

__all__ = list(errors.__all__)
