"""TierStore: named regions in host memory, on NVMe, or both, moved by paired async verbs.

``prefetch`` / ``evict`` return a handle at once; ``wait_for_prefetch`` /
``wait_for_evict`` block until that handle's transfers are done and apply their
outcome. A region's state changes only at those points, under the store's lock.

[Note: nothing is lost] A region's host copy is freed only after its write-back is
complete and checked. A failed evict (a full disk, an I/O error, a swap file deleted
underneath) leaves the region in HOST with its host copy and dirty flag as they were;
a failed prefetch leaves it on NVMe as it was. Errors name the region and the path.

A verb on a region with a transfer still pending first waits for that transfer
("settles" it); its outcome, good or bad, is still reported by the handle's wait.
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading
import time
from typing import Callable, Iterable

from csrc import ConfigError, OffloadError
from swap.buffers import HostBlock, HostPool, embedded_pool_config
from swap.durable import durable_record, parse_record
from swap.engine import IoEngine, IoEngineConfig, open_engine
from swap.records import RegionInfo, Tier, TierStats, TierStoreConfig
from swap.space import Placement, SwapSpace, SwapSpaceConfig
from swap.transfer import BusyTime, RegionTransfer, split_chunks

logger = logging.getLogger(__name__)

__all__ = ["RegionInfo", "Tier", "TierStats", "TierStore", "TierStoreConfig", "TransferHandle"]

@dataclasses.dataclass(eq=False)
class _Region:
    name: str
    nbytes: int
    tier: Tier
    host: HostBlock | None
    placements: list[Placement] | None = None
    checksums: list[int] | None = None
    dirty: bool = True
    pending: "_Op | None" = None


@dataclasses.dataclass(eq=False)
class _Op:
    region: _Region
    transfer: RegionTransfer
    new_placements: bool  # allocated for this write (released if it fails)
    free_host: bool  # evict: free the host copy once written
    applied: bool = False


class TransferHandle:
    """What prefetch/evict return; pass it to the matching wait verb."""

    def __init__(self, kind: str, ops: list[_Op], names: list[str]) -> None:
        self.kind = kind
        self.names = names
        self._ops = ops

    def done(self) -> bool:
        return all(op.applied for op in self._ops)

    def __repr__(self) -> str:
        return f"TransferHandle({self.kind}, {len(self.names)} region(s), done={self.done()})"


class TierStore:
    """Named regions over a host pool and a swap space, moved by one engine. Thread safe.

    Without a swap space (``space=None``, ``engine=None``) the store is host only: regions are
    allocated, viewed and freed as usual, ``prefetch`` has nothing to read, ``flush`` has nothing
    to write, and ``evict`` of a region with a host copy is a ``ConfigError``. The training
    engine uses this for ``offload_optimizer: cpu``, so it speaks one interface for every tier.
    """

    def __init__(self, config: TierStoreConfig, *, pool: HostPool, space: SwapSpace | None,
                 engine: IoEngine | None, on_change: Callable[[str, dict | None], None] | None = None) -> None:
        """``on_change(name, record)``: called under the store's lock after every change of what a region
        durably is (``record``: ``swap.durable.durable_record``; None once freed): [Note: durable regions]."""
        if (space is None) != (engine is None):
            raise ConfigError("a TierStore needs both a swap space and an engine, or neither (host only)")
        self.config = config
        self.pool = pool
        self.space = space
        self.engine = engine
        self._lock = threading.RLock()
        self._regions: dict[str, _Region] = {}
        self._read = BusyTime()
        self._write = BusyTime()
        self._errors = 0
        self._owned: list[HostPool | SwapSpace | IoEngine] = []
        self._closed = False
        self._on_change = on_change
        # [Note: registered buffers] in swap.engine: pin the pool once for the engine
        self._buffer_slots = ([engine.register_buffer(seg.address, seg.nbytes) for seg in pool.segments]
                              if engine is not None else [])

    @classmethod
    def create(cls, *, host_capacity_bytes: int, swap_paths: Iterable[str], swap_capacity_bytes: int,
               segment_bytes: int | None = None, engine_config: IoEngineConfig | None = None,
               config: TierStoreConfig | None = None, slot_bytes: int | None = None,
               huge_pages: str = "auto") -> "TierStore":
        """A store that makes (and on close, closes) its own pool, engine and swap space.

        No ``swap_paths`` makes a host-only store (no engine, no swap space). ``slot_bytes``: the
        pool's (``HostPoolConfig.slot_bytes``). The pool is this process's alone: private memory on
        huge pages where the kernel gives them (``embedded_pool_config``)."""
        paths = tuple(swap_paths)
        pool_config = embedded_pool_config(host_capacity_bytes, segment_bytes, slot_bytes, huge_pages)
        if not paths:
            pool = HostPool(pool_config)
            store = cls(config or TierStoreConfig(), pool=pool, space=None, engine=None)
            store._owned = [pool]
            return store
        engine = open_engine(engine_config or IoEngineConfig(probe_paths=paths))
        parts: list = [engine]
        try:
            space = SwapSpace(SwapSpaceConfig(paths=paths, capacity_bytes=swap_capacity_bytes), engine=engine)
            parts.append(space)
            pool = HostPool(pool_config)
            parts.append(pool)
        except BaseException:
            for part in reversed(parts):
                part.close()
            raise
        store = cls(config or TierStoreConfig(), pool=pool, space=space, engine=engine)
        store._owned = [pool, space, engine]
        return store

    # -- regions -------------------------------------------------------------------------

    def _get(self, name: str) -> _Region:
        if self._closed:
            raise ConfigError("the TierStore is closed")
        region = self._regions.get(name)
        if region is None:
            raise ConfigError(f"no region named {name!r}")
        return region

    def _info(self, r: _Region) -> RegionInfo:
        seg, off = (r.host.segment_index, r.host.offset) if r.host is not None else (None, None)
        return RegionInfo(r.name, r.nbytes, seg, off, r.tier)

    def _changed(self, r: _Region, freed: bool = False) -> None:
        if self._on_change is not None:
            self._on_change(r.name, None if freed else durable_record(r))

    def durable(self) -> dict[str, dict]:
        """Every region's durable record (for a snapshot of the daemon's state)."""
        with self._lock:
            return {name: durable_record(r) for name, r in self._regions.items()}

    def restore(self, name: str, record: dict) -> None:
        """Take back a region a predecessor held, from its durable record: its host block and swap
        extents marked held (``ConfigError`` if either is taken or out of range), its state as recorded."""
        nbytes, tier, host, placements, checksums, dirty = parse_record(name, record)
        with self._lock:
            if name in self._regions:
                raise ConfigError(f"a region named {name!r} already exists")
            if placements is not None and self.space is None:
                raise ConfigError(f"region {name!r} has swap extents and this store has no swap space")
            if host is not None:
                if not 0 <= host.segment_index < len(self.pool.segments):
                    raise ConfigError(f"region {name!r}: host segment {host.segment_index} is not this store's")
                self.pool.take(host)
            try:
                if placements is not None:
                    self.space.reserve(placements)
            except BaseException:
                if host is not None:
                    self.pool.free(host)
                raise
            self._regions[name] = _Region(name, nbytes, tier, host, placements, checksums, dirty)

    def allocate(self, name: str, nbytes: int) -> RegionInfo:
        """A new region of ``nbytes`` in host memory (tier HOST, contents undefined until written)."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"a region name must be a non-empty string, got {name!r}")
        if nbytes <= 0:
            raise ConfigError(f"region {name!r}: nbytes must be > 0, got {nbytes}")
        with self._lock:
            if self._closed:
                raise ConfigError("the TierStore is closed")
            if name in self._regions:
                raise ConfigError(f"a region named {name!r} already exists")
            block = self.pool.allocate(nbytes, f"region {name!r}")
            region = _Region(name, nbytes, Tier.HOST, block)
            self._regions[name] = region
            self._changed(region)
            return self._info(region)

    def info(self, name: str) -> RegionInfo:
        with self._lock:
            return self._info(self._get(name))

    def placements(self, name: str) -> list[Placement]:
        """Where the region's NVMe copy lives (empty if it has none yet): for tools and tests."""
        with self._lock:
            return list(self._get(name).placements or [])

    def names(self) -> list[str]:
        with self._lock:
            return list(self._regions)

    def host_view(self, name: str) -> memoryview:
        """Writable view of the region's host copy (its logical bytes); an error if it has none.

        The view is valid until the region is evicted or freed: the memory then goes back to
        the pool and may hold another region. Take a new view after each prefetch."""
        with self._lock:
            r = self._get(name)
            if r.tier not in (Tier.HOST, Tier.HOST_AND_NVME):
                hint = "prefetch it and wait first" if r.tier == Tier.NVME else "wait for its transfer first"
                raise ConfigError(f"region {name!r} has no host copy to view (tier {r.tier.value}): {hint}")
            return self.pool.view(r.host, r.nbytes)

    def mark_dirty(self, name: str) -> None:
        """Say that the host copy was written: the next evict writes it back."""
        with self._lock:
            r = self._get(name)
            if r.tier not in (Tier.HOST, Tier.HOST_AND_NVME):
                raise ConfigError(f"region {name!r} has no host copy to mark dirty (tier {r.tier.value})")
            if not (r.dirty and r.tier == Tier.HOST):
                r.dirty = True
                r.tier = Tier.HOST
                self._changed(r)

    def free(self, name: str) -> None:
        """Forget a region and release its host memory and swap extents."""
        with self._lock:
            r = self._get(name)
            self._settle(r)
            self._release(r)
            del self._regions[name]
            self._changed(r, freed=True)

    def _release(self, r: _Region) -> None:
        if r.host is not None:
            self.pool.free(r.host)
            r.host = None
        if r.placements is not None:
            self.space.release(r.placements)
            r.placements = None

    # -- transfers -----------------------------------------------------------------------

    def _unique(self, names: Iterable[str]) -> list[_Region]:
        if isinstance(names, str):
            names = [names]
        seen: dict[str, _Region] = {}
        for name in names:
            if name not in seen:
                seen[name] = self._get(name)
        return list(seen.values())

    def _settled(self, names: Iterable[str]) -> list[_Region]:
        """The named regions, once, each with no transfer pending."""
        regions = self._unique(names)
        for r in regions:
            self._settle(r)
        return regions

    def _settle(self, r: _Region) -> None:
        """Wait for a pending transfer of ``r`` and apply it; its error stays with its handle."""
        op = r.pending
        if op is not None:
            op.transfer.wait(None)
            self._apply(op)

    def _submit(self, r: _Region, *, write: bool, placements: list[Placement], expected: list[int] | None,
                new_placements: bool, free_host: bool) -> _Op:
        transfer = RegionTransfer(name=r.name, nbytes=r.nbytes, write=write, host_address=self.pool.address(r.host),
                                  chunks=split_chunks(placements, self.config.chunk_bytes), engine=self.engine,
                                  space=self.space, checksum=self.config.checksum != "none", expected=expected)
        op = _Op(r, transfer, new_placements, free_host)
        r.pending = op
        r.tier = Tier.IN_FLIGHT
        return op

    def _host_for_nvme_only(self, regions: list[_Region], what: str) -> tuple[list[_Region], list[HostBlock]]:
        """The regions only on NVMe, and a host block for each (all or none: an error frees them)."""
        todo = [r for r in regions if r.tier == Tier.NVME]
        blocks: list[HostBlock] = []
        try:
            for r in todo:
                blocks.append(self.pool.allocate(r.nbytes, f"{what} of region {r.name!r}"))
        except OffloadError:
            for b in blocks:
                self.pool.free(b)
            raise
        return todo, blocks

    def prefetch(self, names: Iterable[str]) -> TransferHandle:
        """Start reading regions that are only on NVMe into host memory; returns at once."""
        with self._lock:
            regions = self._settled(names)
            todo, blocks = self._host_for_nvme_only(regions, "prefetch")
            try:
                if todo:
                    self.space.check({p.file_index for r in todo for p in r.placements})
            except OffloadError as exc:  # the open descriptor still reads it: nothing is lost
                logger.warning("%s; reading through the open descriptor", exc)
            ops = []
            for r, block in zip(todo, blocks):
                r.host = block
                ops.append(self._submit(r, write=False, placements=r.placements, expected=r.checksums,
                                        new_placements=False, free_host=False))
            return TransferHandle("prefetch", ops, [r.name for r in regions])

    def claim(self, names: Iterable[str]) -> TransferHandle:
        """Give the regions that are only on NVMe a host copy without reading them: zeros, marked
        dirty (the caller is about to overwrite them: reading them first would be wasted I/O).
        Regions with a host copy or a transfer in flight are left as they are. Returns a handle
        for ``wait_for_prefetch``, already done."""
        with self._lock:
            regions = self._settled(names)
            todo, blocks = self._host_for_nvme_only(regions, "claim")
            for r, block in zip(todo, blocks):
                ctypes.memset(self.pool.address(block), 0, r.nbytes)
                r.host = block
                r.tier = Tier.HOST
                r.dirty = True
                self._changed(r)
            return TransferHandle("prefetch", [], [r.name for r in regions])

    def evict(self, names: Iterable[str]) -> TransferHandle:
        """Start writing back the dirty ones among ``names``; their host copies are freed at wait."""
        return self._write_back(names, free_host=True, kind="evict")

    def _write_back(self, names: Iterable[str], *, free_host: bool, kind: str) -> TransferHandle:
        with self._lock:
            regions = self._settled(names)
            dirty = [r for r in regions if r.tier == Tier.HOST]
            if self.space is None:
                if dirty and free_host:
                    raise ConfigError(f"cannot evict region {dirty[0].name!r}: this store is host only "
                                      "(no swap space to write it to)")
                return TransferHandle(kind, [], [r.name for r in regions])
            fresh: list[_Region] = []
            try:
                for r in dirty:
                    if r.placements is None:
                        r.placements = self.space.allocate(r.nbytes, f"{kind} of region {r.name!r}")
                        fresh.append(r)
                self.space.check({p.file_index for r in dirty for p in r.placements})
            except OffloadError:
                for r in fresh:
                    self.space.release(r.placements)
                    r.placements = None
                raise
            ops = []
            for r in regions:
                if r.tier == Tier.HOST_AND_NVME and free_host:  # clean: nothing to write
                    self.pool.free(r.host)
                    r.host = None
                    r.tier = Tier.NVME
                    self._changed(r)
            for r in dirty:
                ops.append(self._submit(r, write=True, placements=r.placements, expected=None,
                                        new_placements=r in fresh, free_host=free_host))
            return TransferHandle(kind, ops, [r.name for r in regions])

    def _apply(self, op: _Op) -> None:
        """Under the lock: make a finished transfer's outcome the region's state (once), and say so
        (the bytes it names are in place by now: [Note: durable regions])."""
        if op.applied:
            return
        op.applied = True
        self._apply_outcome(op)
        if op.region.name in self._regions:
            self._changed(op.region)

    def _apply_outcome(self, op: _Op) -> None:
        r, t = op.region, op.transfer
        r.pending = None
        if t.outcome is not None:
            self._errors += 1
            if t.write:  # [Note: nothing is lost]: keep the host copy, still dirty
                if op.new_placements:
                    self.space.release(r.placements)
                    r.placements = None
                r.checksums = None
                r.tier = Tier.HOST
                r.dirty = True
            else:
                self.pool.free(r.host)
                r.host = None
                r.tier = Tier.NVME
            return
        if t.write:
            self._write.add(t.start_ns, t.end_ns, t.bytes_moved)
            r.checksums = t.checksums if self.config.checksum != "none" else None
            r.dirty = False
            if op.free_host:
                self.pool.free(r.host)
                r.host = None
                r.tier = Tier.NVME
            else:
                r.tier = Tier.HOST_AND_NVME
        else:
            self._read.add(t.start_ns, t.end_ns, t.bytes_moved)
            r.dirty = False
            r.tier = Tier.HOST_AND_NVME

    def _wait(self, handle: TransferHandle, kinds: tuple[str, ...], timeout_seconds: float | None) -> None:
        if not isinstance(handle, TransferHandle) or handle.kind not in kinds:
            raise ConfigError(f"expected a handle from {' or '.join(kinds)}, got {handle!r}")
        deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
        for op in handle._ops:
            if not op.transfer.wait(deadline):
                pending = [o.region.name for o in handle._ops if not o.applied]
                raise TimeoutError(f"{handle.kind} not done after {timeout_seconds} s; regions still "
                                   f"in flight: {', '.join(pending[:8])}{' ...' if len(pending) > 8 else ''}")
        with self._lock:
            for op in handle._ops:
                self._apply(op)
        errors = [op.transfer.outcome for op in handle._ops if op.transfer.outcome is not None]
        if errors:
            first = errors[0]
            if len(errors) > 1 and not getattr(first, "__notes__", None):  # once, if waited for again
                first.add_note(f"{len(errors) - 1} more region(s) of this {handle.kind} failed: "
                               + "; ".join(str(e) for e in errors[1:4]))
            raise first

    def wait_for_prefetch(self, handle: TransferHandle, timeout_seconds: float | None = None) -> None:
        """Block until the prefetch is done; raises the first region's error (the others in its notes)."""
        self._wait(handle, ("prefetch",), timeout_seconds)

    def wait_for_evict(self, handle: TransferHandle, timeout_seconds: float | None = None) -> None:
        """Block until the evict is done; failed regions keep their host copies (see the note)."""
        self._wait(handle, ("evict",), timeout_seconds)

    def flush(self) -> None:
        """Wait for every pending transfer, write back every dirty region (keeping host copies), fdatasync."""
        with self._lock:
            for r in list(self._regions.values()):
                self._settle(r)
            handle = self._write_back(list(self._regions), free_host=False, kind="flush")
        self._wait(handle, ("flush",), None)
        if self.space is not None:
            self.space.sync()

    def host_ranges(self) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of each host pool segment (what CUDA host registration pins)."""
        return [(seg.address, seg.nbytes) for seg in self.pool.segments]

    def stats(self) -> TierStats:
        with self._lock:
            regions = list(self._regions.values())
            return TierStats(
                regions=len(regions),
                host_bytes=sum(r.nbytes for r in regions if r.tier in (Tier.HOST, Tier.HOST_AND_NVME)),
                nvme_bytes=sum(r.nbytes for r in regions if r.tier in (Tier.NVME, Tier.HOST_AND_NVME)),
                in_flight_bytes=sum(r.nbytes for r in regions if r.tier == Tier.IN_FLIGHT),
                dirty_bytes=sum(r.nbytes for r in regions if r.dirty and r.tier == Tier.HOST),
                host_pool_used_bytes=self.pool.used_bytes,
                host_pool_capacity_bytes=self.pool.capacity_bytes,
                swap_used_bytes=self.space.used_bytes if self.space is not None else 0,
                swap_capacity_bytes=self.space.capacity_bytes if self.space is not None else 0,
                bytes_read_total=self._read.bytes,
                bytes_written_total=self._write.bytes,
                read_seconds_total=self._read.seconds,
                write_seconds_total=self._write.seconds,
                read_bandwidth_bytes_per_second=self._read.bytes / self._read.seconds if self._read.seconds else 0.0,
                write_bandwidth_bytes_per_second=self._write.bytes / self._write.seconds if self._write.seconds else 0.0,
                errors_total=self._errors,
                engine=self.engine.name if self.engine is not None else "none",
            )

    def close(self) -> None:
        """Wait for pending transfers, free every region, close the parts this store made. Idempotent."""
        with self._lock:
            if self._closed:
                return
            for r in list(self._regions.values()):
                if r.pending is not None:
                    r.pending.transfer.abandon(lambda exc: logger.warning("on close: %s", exc))
                    self._apply(r.pending)
                self._release(r)
            self._regions.clear()
            self._closed = True
            for slot in self._buffer_slots:
                self.engine.unregister_buffer(slot)
            self._buffer_slots = []
        for part in self._owned:
            part.close()

    def __enter__(self) -> "TierStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
