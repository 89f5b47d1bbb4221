"""Stage 3: this rank's shard of every unit, in the compute dtype, wherever ``offload_param`` puts it.

With ``offload_param`` none the shards are one tensor on the model's device (the rank's
partition, unit after unit). With cpu or nvme each unit's shard is a region ``param.<unit>``
of the tier (the embedded ``TierStore``; the same verbs as the optimizer's), seen through
``host_view``. With nvme a shard is on NVMe unless it is being used or was prefetched for
use, and at most ``window`` shards hold host memory at once (``offload.zero.window.HostWindow``,
which drops a prefetched shard nobody holds when it needs room; when a shard is needed and the
window holds only shards in use and prefetches in flight, ``acquire`` waits for the oldest of
those prefetches and drops it); the host pool is sized for
``window`` of the largest shard, so no unit is ever too large for it.
"""
from __future__ import annotations

import collections
import enum
import logging
from typing import Any, Iterable

import torch

from csrc import ConfigError
from offload.zero.layout import FlatLayout, Piece
from offload.zero.window import HostWindow

logger = logging.getLogger(__name__)

__all__ = ["ShardPlacement", "ShardStore"]


class ShardPlacement(enum.Enum):
    """Where a unit's shard is, and who owns its memory."""

    DEVICE = "device"  # a slice of this store's device tensor (offload_param none)
    HOST = "host"  # a host region of the tier, resident for good (offload_param cpu)
    NVME = "nvme"  # on NVMe: the tier owns the extents; no host memory is held
    IN_FLIGHT = "in_flight"  # a prefetch or evict owns the host copy until it is waited for
    RESIDENT = "resident"  # in host memory and ours to read and write


class ShardStore:
    """The compute-dtype shards of one rank's partition, per unit (bucket of the layout)."""

    def __init__(self, layout: FlatLayout, *, dtype: torch.dtype, device: torch.device, tier: Any | None,
                 nvme: bool, window: int) -> None:
        if nvme and tier is None:
            raise ConfigError("offload_param nvme needs a tier")
        self.layout = layout
        self.dtype = dtype
        self.device = device
        self.tier = tier
        self.nvme = nvme
        self.window = max(3, window)
        self.itemsize = torch.empty(0, dtype=dtype).element_size()
        self._part_start = []
        part = 0
        for b in layout.buckets:
            self._part_start.append(part)
            part += b.shard_numel
        self._flat: torch.Tensor | None = None
        self._place = [ShardPlacement.DEVICE if tier is None else ShardPlacement.HOST for _ in layout.buckets]
        self._pins = [0] * len(layout.buckets)
        self._held_for_write: collections.OrderedDict[int, torch.Tensor] = collections.OrderedDict()
        self._written: set[int] = set()  # shards params_out has handed out this step
        self._window = HostWindow(tier, self._place, ShardPlacement, size=self.window, name=self._name,
                                  label=lambda b: f"unit {b}'s shard", noun="shards", drop_idle=self._idle)

    @property
    def io_wait_seconds(self) -> float:
        return self._window.io_wait_seconds

    @property
    def prefetches_started(self) -> int:
        return self._window.prefetches_started

    def _name(self, b: int) -> str:
        return f"param.{b}"

    def allocate(self) -> None:
        """Make every shard, zeroed; with nvme they then go to NVMe as they are written (``release``)."""
        if self.tier is None:
            self._flat = torch.zeros(self.layout.partition_numel, dtype=self.dtype, device=self.device)
            return
        for b in self.layout.buckets:
            if self.nvme:
                self._window.make_room()
            self.tier.allocate(self._name(b.index), b.shard_numel * self.itemsize)
            self._place[b.index] = ShardPlacement.RESIDENT if self.nvme else ShardPlacement.HOST
            self._view(b.index).zero_()
            self.tier.mark_dirty(self._name(b.index))
            self._evict(b.index)

    def _view(self, b: int) -> torch.Tensor:
        if self._flat is not None:
            start = self._part_start[b]
            return self._flat[start:start + self.layout.buckets[b].shard_numel]
        return torch.frombuffer(self.tier.host_view(self._name(b)), dtype=self.dtype,
                                count=self.layout.buckets[b].shard_numel)

    def _idle(self) -> int | None:
        """A resident shard that nobody holds (a prefetch not yet used): clean, so dropped for room."""
        return next((b for b, p in enumerate(self._place) if p == ShardPlacement.RESIDENT and not self._pins[b]), None)

    def _evict(self, b: int) -> None:
        if self.nvme and self._place[b] == ShardPlacement.RESIDENT:
            self._window.evict(b)

    def ready(self, b: int) -> bool:
        """Whether unit ``b``'s shard is in memory now (acquiring it waits for no NVMe read)."""
        if self.nvme:
            return self._window.arrived(b)
        return self._place[b] in (ShardPlacement.DEVICE, ShardPlacement.HOST)

    def prefetch(self, units: Iterable[int]) -> None:
        """Start bringing shards from NVMe to host memory while the window has room (no-op otherwise)."""
        if self.nvme:
            self._window.prefetch(units)

    def acquire(self, b: int, *, read: bool = True) -> torch.Tensor:
        """The shard of unit ``b`` (held until ``release``), waiting for or starting its prefetch;
        ``read`` False: one only on NVMe is not read (zeros: the caller overwrites it)."""
        if self.nvme:
            if self._place[b] == ShardPlacement.NVME and not self._window.make_room():
                self._land_oldest_prefetch()
            self._window.bring_in(b, read=read)
        self._pins[b] += 1
        return self._view(b)

    def _land_oldest_prefetch(self) -> None:
        """The window is full of shards in use and prefetches in flight (prefetched along an order that
        changed): wait for the oldest prefetch nobody holds, so that it is idle and can be dropped for
        the shard needed now."""
        pending = self._window.handles
        b = next((b for b in pending if self._place[b] == ShardPlacement.IN_FLIGHT and b not in self._window.evicting
                  and not self._pins[b]), None)
        if b is not None:
            self._window.bring_in(b)

    def release(self, b: int, *, dirty: bool) -> None:
        """Done with a shard; with nvme it goes back (written if ``dirty``) once nobody holds it."""
        self._pins[b] -= 1
        if self.tier is not None and dirty:
            self.tier.mark_dirty(self._name(b))
        if self._pins[b] == 0:
            self._evict(b)

    # -- the optimizer step writes the updated params straight into the shards ---------------

    def params_out(self, piece: Piece) -> torch.Tensor:
        """Where the fused step writes a piece's low-precision params (held until ``flush``)."""
        shard = self._held_for_write.get(piece.bucket)
        if shard is None:
            while len(self._held_for_write) >= self.window - 1:
                old, _ = self._held_for_write.popitem(last=False)
                self.release(old, dirty=True)
            # [Note: the step reads no shard] the step overwrites every param of a shard (only its
            # padding is not a piece): the first time in a step it is not read from NVMe. Once given
            # back (window pressure) it may hold pieces already written, so it is read again.
            first = piece.bucket not in self._written
            self._written.add(piece.bucket)
            shard = self._held_for_write[piece.bucket] = self.acquire(piece.bucket, read=not first)
        start = piece.flat_start - self.layout.buckets[piece.bucket].shard_start(self.layout.rank)
        return shard[start:start + piece.numel]

    def flush(self) -> None:
        """Give back the shards the step wrote (to NVMe with nvme) and wait for the writes."""
        self._written.clear()
        while self._held_for_write:
            b, _ = self._held_for_write.popitem(last=False)
            self.release(b, dirty=True)
        self.drain()

    def drain(self) -> None:
        self._window.drain()

    def bytes_by_tier(self) -> dict[str, int]:
        out = {"device": 0, "host": 0, "nvme": 0}
        for b, where in zip(self.layout.buckets, self._place):
            key = {ShardPlacement.DEVICE: "device", ShardPlacement.NVME: "nvme"}.get(where, "host")
            out[key] += b.shard_numel * self.itemsize
        return out

    def close(self) -> None:
        if self.tier is None:
            self._flat = None
            return
        self._window.settle("param shard")
        for b in self.layout.buckets:
            try:
                self.tier.free(self._name(b.index))
            except ConfigError:
                pass  # never allocated (a failed start)
