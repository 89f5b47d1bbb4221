"""The field checks every config section runs in ``__post_init__``: each failure is a ``ConfigError``
naming the class, the field and the value, with ``field`` set so that ``offload.config.read_config``
can put the JSON key's dotted path in front."""
from __future__ import annotations

import math
from typing import Any

from csrc.errors import ConfigError

__all__ = ["check_bool", "check_float", "check_int", "check_text", "fail", "is_int"]


def fail(obj: object, name: str, requirement: str) -> None:
    value = getattr(obj, name)
    err = ConfigError(f"{type(obj).__name__}.{name} must be {requirement}, got {value!r}")
    err.field = name  # read_config turns this into the JSON key's dotted path
    raise err


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(obj: object, name: str, lo: int | None = None, hi: int | None = None,
              optional: bool = False) -> None:
    value = getattr(obj, name)
    if optional and value is None:
        return
    if not is_int(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = (f" in [{lo}, {hi}]" if lo is not None and hi is not None
                  else f" >= {lo}" if lo is not None else "")
        fail(obj, name, f"an integer{bounds}" + (" or null" if optional else ""))


def check_float(obj: object, name: str, lo: float | None = None, hi: float | None = None,
                lo_open: bool = False, hi_open: bool = False) -> None:
    value = getattr(obj, name)
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and (lo is None or (value > lo if lo_open else value >= lo))
          and (hi is None or (value < hi if hi_open else value <= hi)))
    if not ok:
        parts = []
        if lo is not None:
            parts.append(f"{'>' if lo_open else '>='} {lo}")
        if hi is not None:
            parts.append(f"{'<' if hi_open else '<='} {hi}")
        fail(obj, name, "a finite number" + (" " + " and ".join(parts) if parts else ""))
    object.__setattr__(obj, name, float(value))


def check_bool(obj: object, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(obj, name), bool):
            fail(obj, name, "true or false")


def check_text(obj: object, name: str, optional: bool = True) -> None:
    value = getattr(obj, name)
    if optional and value is None:
        return
    if not isinstance(value, str) or not value:
        fail(obj, name, "a non-empty string" + (" or null" if optional else ""))
