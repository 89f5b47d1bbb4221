"""What a TierStore is configured with and says about its regions: the tiers a region can be in,
the store's settings, a region's description and the store's statistics snapshot."""
from __future__ import annotations

import dataclasses
import enum

from csrc import ConfigError
from swap.engine import ALIGNMENT_BYTES

__all__ = ["RegionInfo", "Tier", "TierStats", "TierStoreConfig"]

_CHECKSUMS = ("crc32c", "none")


class Tier(enum.Enum):
    """Where a region lives, and who owns its memory."""

    HOST = "host"  # only a host copy (new, or written since its last write-back): the host pool owns it, the caller reads and writes it
    NVME = "nvme"  # only on NVMe: the swap space owns its extents; no host memory is held
    HOST_AND_NVME = "host_and_nvme"  # a clean host copy equal to the NVMe copy: the caller reads it, and calls mark_dirty after writing it
    IN_FLIGHT = "in_flight"  # a transfer owns the host copy: the caller must not touch it until the handle is waited for


@dataclasses.dataclass(frozen=True, kw_only=True)
class TierStoreConfig:
    """How a TierStore moves regions."""

    chunk_bytes: int = 8 << 20
    """A region moves in engine requests of at most this many bytes, one checksum each; a multiple of 4096."""
    checksum: str = "crc32c"
    """"crc32c" (taken on write-back, verified on prefetch) or "none"."""

    def __post_init__(self) -> None:
        if self.chunk_bytes <= 0 or self.chunk_bytes % ALIGNMENT_BYTES:
            raise ConfigError(f"chunk_bytes must be a positive multiple of {ALIGNMENT_BYTES}, got {self.chunk_bytes}")
        if self.checksum not in _CHECKSUMS:
            raise ConfigError(f"checksum must be one of {', '.join(_CHECKSUMS)}, got {self.checksum!r}")


@dataclasses.dataclass(frozen=True)
class RegionInfo:
    """A region: its logical length, where its host copy is (None when it has none), and its tier."""

    name: str
    nbytes: int
    segment_index: int | None
    offset: int | None
    tier: Tier


@dataclasses.dataclass(frozen=True, kw_only=True)
class TierStats:
    """A snapshot of a store. Bytes are logical (unpadded) unless the name says pool or swap."""

    regions: int
    host_bytes: int  # regions with a host copy (HOST, HOST_AND_NVME)
    nvme_bytes: int  # regions whose NVMe copy is current (NVME, HOST_AND_NVME)
    in_flight_bytes: int
    dirty_bytes: int
    host_pool_used_bytes: int
    host_pool_capacity_bytes: int
    swap_used_bytes: int
    swap_capacity_bytes: int
    bytes_read_total: int
    bytes_written_total: int
    read_seconds_total: float  # wall time with at least one prefetch in flight
    write_seconds_total: float
    read_bandwidth_bytes_per_second: float
    write_bandwidth_bytes_per_second: float
    errors_total: int
    engine: str
