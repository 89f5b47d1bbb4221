"""What machine a bench ran on, as the benches' reports name it: the CPU's model, family, model
and stepping, its last-level cache and AVX-512 (from /proc/cpuinfo and sysfs)."""
from __future__ import annotations

import os
import platform
from pathlib import Path

__all__ = ["cpu_description", "llc_bytes"]


def _cpu_fields() -> dict[str, str]:
    """The first CPU's entries of /proc/cpuinfo (empty where it cannot be read)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            if fields:
                break  # the first CPU is enough
            continue
        fields.setdefault(key.strip(), value.strip())
    return fields


def llc_bytes() -> int | None:
    """Size of the last-level cache from sysfs, or None."""
    cache = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(cache.glob("index*"), reverse=True):
        try:
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
    return None


def cpu_description() -> str:
    """CPU model, family/model/stepping and last-level cache, from /proc/cpuinfo and sysfs."""
    fields = _cpu_fields()
    if not fields:
        return platform.processor() or platform.machine()
    llc = "?"
    cache = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(cache.glob("index*"), reverse=True):
        try:
            llc = f"L{(index / 'level').read_text().strip()} {(index / 'size').read_text().strip()}"
            break
        except OSError:
            continue
    avx512 = "avx512f" in fields.get("flags", "").split()
    return (f"{fields.get('model name', 'unknown CPU')} ({fields.get('vendor_id', '?')}, family "
            f"{fields.get('cpu family', '?')} model {fields.get('model', '?')} stepping "
            f"{fields.get('stepping', '?')}), {os.cpu_count()} CPUs, last-level cache {llc}, "
            f"AVX-512 {'yes' if avx512 else 'no'}")
