"""A region as a successor may take it over: its durable record, written and read back.

[Note: durable regions] A daemon that dies leaves its regions' bytes behind (host copies in memfds
that outlive it, NVMe copies in swap files) and a journal of where they are (``daemon.journal``).
What the journal says of a region must be true of those bytes whenever the process dies, so the
record a store reports (``TierStore(on_change=...)``) counts a transfer in flight as not begun: a
read is still only on NVMe (its new host block not yet its own), a write is still dirty in host
memory (its new extents not yet its own, its old checksums stale). A finished transfer is reported
only after its bytes are in place, when the store applies its outcome. The record is plain JSON:
tier name, dirty, host block ``[segment, offset, padded bytes]``, placements ``[file, file offset,
region offset, bytes]`` each, and the per-chunk checksums.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from csrc import ConfigError
from swap.buffers import HostBlock
from swap.records import Tier
from swap.space import Placement

__all__ = ["DurableRegion", "durable_record", "parse_record"]


class DurableRegion(NamedTuple):
    """A durable record, parsed and checked."""

    nbytes: int
    tier: Tier
    host: HostBlock | None
    placements: list[Placement] | None
    checksums: list[int] | None
    dirty: bool


def durable_record(r: Any) -> dict:
    """The record of a store's region ``r`` (a ``swap.store._Region``), a transfer in flight counted as not begun."""
    tier, host, placements, checksums, dirty = r.tier, r.host, r.placements, r.checksums, r.dirty
    op = r.pending
    if op is not None and op.transfer.write:
        tier, dirty, checksums = Tier.HOST, True, None
        placements = None if op.new_placements else placements
    elif op is not None:
        tier, host, dirty = Tier.NVME, None, False
    return {"nbytes": r.nbytes, "tier": tier.name, "dirty": dirty,
            "host": list(host) if host is not None else None,
            "placements": [list(p) for p in placements] if placements is not None else None,
            "checksums": list(checksums) if checksums is not None else None}


def parse_record(name: str, record: dict) -> DurableRegion:
    """A record read back; ``ConfigError`` naming the region when it is no state a region can be in."""
    try:
        tier = Tier[record["tier"]]
        host = HostBlock(*record["host"]) if record["host"] is not None else None
        placements = [Placement(*p) for p in record["placements"]] if record["placements"] is not None else None
        parsed = DurableRegion(int(record["nbytes"]), tier, host, placements, record["checksums"],
                               bool(record["dirty"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"region {name!r}: the record {record} cannot be read ({exc})") from None
    if tier == Tier.IN_FLIGHT or (host is None) != (tier == Tier.NVME) or (placements is None and tier != Tier.HOST):
        raise ConfigError(f"region {name!r}: the record {record} is not a state a region can be in")
    return parsed
