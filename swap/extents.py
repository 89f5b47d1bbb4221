"""First-fit allocator of aligned extents in a linear space, with coalescing of free space.

Used for the host pool's segments and for each swap file. Not thread safe: its owner
holds a lock. Sizes are rounded up to the alignment, so every extent starts and ends
on an aligned boundary (see [Note: alignment] in ``swap.engine``).
"""
from __future__ import annotations

import bisect
import logging

from csrc import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["ExtentAllocator", "align_up"]


def align_up(nbytes: int, alignment: int) -> int:
    """``nbytes`` rounded up to a multiple of ``alignment``."""
    return -(-nbytes // alignment) * alignment


class ExtentAllocator:
    """Free space as sorted, non-touching (offset, length) runs; allocation is first fit."""

    def __init__(self, capacity_bytes: int, alignment_bytes: int) -> None:
        if alignment_bytes <= 0:
            raise ConfigError(f"alignment_bytes must be > 0, got {alignment_bytes}")
        if capacity_bytes < 0 or capacity_bytes % alignment_bytes:
            raise ConfigError(f"capacity_bytes must be a multiple of {alignment_bytes}, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.alignment_bytes = alignment_bytes
        self._starts: list[int] = [0] if capacity_bytes else []
        self._lengths: dict[int, int] = {0: capacity_bytes} if capacity_bytes else {}
        self._used: dict[int, int] = {}  # offset -> length of each allocated extent
        self.used_bytes = 0

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def largest_free_bytes(self) -> int:
        return max(self._lengths.values(), default=0)

    def allocate(self, nbytes: int) -> int | None:
        """Offset of a new extent of ``align_up(nbytes)`` bytes, or None if no free run is long enough."""
        if nbytes <= 0:
            raise ConfigError(f"an extent must have nbytes > 0, got {nbytes}")
        size = align_up(nbytes, self.alignment_bytes)
        for i, start in enumerate(self._starts):
            length = self._lengths[start]
            if length < size:
                continue
            del self._lengths[start]
            if length == size:
                del self._starts[i]
            else:
                self._starts[i] = start + size
                self._lengths[start + size] = length - size
            self._used[start] = size
            self.used_bytes += size
            return start
        return None

    def take(self, offset: int, nbytes: int) -> None:
        """Mark the extent ``[offset, offset + align_up(nbytes))`` allocated, as a successor adopting a
        predecessor's extents does; ``ConfigError`` if any of it is not free or not aligned."""
        size = align_up(nbytes, self.alignment_bytes)
        if nbytes <= 0 or offset < 0 or offset % self.alignment_bytes:
            raise ConfigError(f"an extent must start aligned and have nbytes > 0, got {offset}, {nbytes}")
        i = bisect.bisect_right(self._starts, offset) - 1
        start = self._starts[i] if i >= 0 else -1
        length = self._lengths.get(start, 0)
        if i < 0 or offset + size > start + length:
            raise ConfigError(f"extent [{offset}, {offset + size}) is not free")
        del self._lengths[start]
        del self._starts[i]
        if offset + size < start + length:  # the free tail
            self._starts.insert(i, offset + size)
            self._lengths[offset + size] = start + length - offset - size
        if start < offset:  # the free head
            self._starts.insert(i, start)
            self._lengths[start] = offset - start
        self._used[offset] = size
        self.used_bytes += size

    def free(self, offset: int) -> None:
        """Return the extent that starts at ``offset``; merges it with free neighbours."""
        size = self._used.pop(offset, None)
        if size is None:
            raise ConfigError(f"no allocated extent starts at offset {offset}")
        self.used_bytes -= size
        i = bisect.bisect_left(self._starts, offset)
        start, length = offset, size
        if i < len(self._starts) and self._starts[i] == offset + size:  # next run touches
            length += self._lengths.pop(self._starts[i])
            del self._starts[i]
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._lengths[prev] == offset:  # previous run touches
                self._lengths[prev] += length
                return
        self._starts.insert(i, start)
        self._lengths[start] = length

    def extent_bytes(self, offset: int) -> int:
        """Length of the allocated extent at ``offset``."""
        return self._used[offset]

    def free_runs(self) -> list[tuple[int, int]]:
        """The free space as sorted (offset, length) runs."""
        return [(s, self._lengths[s]) for s in self._starts]
