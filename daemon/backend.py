"""The store-facing side of the daemon: build the swap objects, and carry their values on the wire.

The daemon serves the swap package's ``TierStore``: one ``SwapSpace`` and one I/O
engine shared by every session, one ``NodePool`` of memfd segments made at start
(``daemon.pool``), and per session a ``HostPool`` over segments lent from it (sized
by the session's quota) under its own ``TierStore``. ``SwapBackend`` builds them from
the daemon's config. Anything with the same members can stand in for it (the tests
use a test double where the swap package is absent): ``engine_name``,
``open_store(quota_bytes, owner_uid) -> SessionStore``, ``engine_stats()``,
``space_info()``, ``close()``.

``region_to_wire`` / ``region_from_wire`` and ``stats_to_wire`` / ``stats_from_wire``
turn ``RegionInfo`` and ``TierStats`` into JSON fields and back; enum values travel by
name (``Tier.HOST_AND_NVME`` as ``"HOST_AND_NVME"``).
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import os
from typing import Any, Callable, Mapping, NamedTuple, Protocol, Sequence

from csrc.errors import ConfigError
from daemon.config import PoolConfig
from daemon.files import SwapClaim
from daemon.pool import Adoption, NodePool

logger = logging.getLogger(__name__)

__all__ = ["BackendAdoption", "open_swap_backend", "SessionStore", "StoreBackend", "SwapBackend", "region_to_wire", "region_from_wire",
           "stats_to_wire", "stats_from_wire"]

try:  # the swap layer (issue 3); the daemon cannot serve without it
    import swap as _swap

    _HAVE_SWAP = hasattr(_swap, "TierStore")
except ImportError:  # only while the swap package is absent from a build
    _swap = None
    _HAVE_SWAP = False


class SessionStore(NamedTuple):
    """What one session gets: its store, its pool's segments (.fd/.nbytes/.index), and how to close both."""

    store: Any
    segments: Sequence[Any]
    close: Callable[[], None]


class StoreBackend(Protocol):
    engine_name: str

    def open_store(self, quota_bytes: int, owner_uid: int) -> SessionStore: ...

    def engine_stats(self) -> dict[str, Any]: ...

    def space_info(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class _RegionInfo(NamedTuple):
    """Stand-in for ``swap.RegionInfo`` where the swap package is absent (tests only)."""

    name: str
    nbytes: int
    segment_index: int | None
    offset: int | None
    tier: str


class _PoolRegisteredEngine:
    """The shared engine as a session's store sees it: the node pool's segments are registered once
    (by ``SwapBackend``), so a store's own register/unregister calls do nothing, and however many
    sessions come and go, the engine's registered-buffer table holds only the pool's segments."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.submit = engine.submit  # the hot path: no proxy hop

    def register_buffer(self, address: int, nbytes: int) -> None:
        return None

    def unregister_buffer(self, slot: int | None) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def _checked(swap: Mapping[str, Any], io: Mapping[str, Any], store: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    """The [swap] table with its paths as strings, and the store's config; their errors before anything is made."""
    if not _HAVE_SWAP:
        raise ConfigError("the swap package (TierStore) is not installed in this build; the daemon cannot serve")
    swap = dict(swap)
    if not swap.get("paths"):
        raise ConfigError("[swap] paths must name at least one directory")
    swap["paths"] = [str(p) for p in swap["paths"]]
    try:
        store_config = _swap.TierStoreConfig(**dict(store))
        _swap.SwapSpaceConfig(**swap)
        _swap.IoEngineConfig(**dict(io))
    except TypeError as exc:  # a missing or unknown key
        raise ConfigError(f"[swap], [io] or [store]: {exc}") from None
    return swap, store_config


class BackendAdoption(NamedTuple):
    """What a predecessor's backend left ([Note: adopted state] in ``daemon.journal``): its swap
    directories and files (``SwapFile.record()`` each), and its pool's segments."""

    swap_dirs: list[str]
    swap_files: list[dict[str, Any]]
    pool: Adoption


async def open_swap_backend(pool: PoolConfig, swap: Mapping[str, Any], io: Mapping[str, Any],
                            store: Mapping[str, Any], run_in_thread: Callable[..., Any],
                            adopt: BackendAdoption | None = None) -> "SwapBackend":
    """The daemon's backend: the config checked, the swap paths swept and claimed on the event loop
    (``SwapClaim.open``, through aiofiles; with ``adopt``, the predecessor's directories taken over),
    then the engine, the preallocated swap files and the faulted pool built by ``run_in_thread`` (the
    slow part, off the loop)."""
    checked, _ = _checked(swap, io, store)
    claim = await SwapClaim.open(checked["paths"], adopt.swap_dirs if adopt else None)
    try:
        return await run_in_thread(SwapBackend, pool, checked, io, store, claim, adopt)
    except BaseException:
        claim.close()  # idempotent: the backend may have closed it already
        raise


class SwapBackend:
    """The real thing: swap's HostPool/SwapSpace/engine/TierStore built from the daemon config."""

    def __init__(self, pool: PoolConfig, swap: Mapping[str, Any], io: Mapping[str, Any],
                 store: Mapping[str, Any], claim: SwapClaim, adopt: BackendAdoption | None = None) -> None:
        """Built in a worker thread (it preallocates the swap files and faults the pool); ``claim`` is the
        swap paths' claim, made on the loop by ``open_swap_backend``, and this backend closes it."""
        self._claim = claim  # [Note: swap file ownership]
        swap, self._store_config = _checked(swap, io, store)
        self._pool_config = pool
        self._engine = self._space = self._pool = None
        self._slots: dict[int, int | None] = {}  # pool segment index -> its registered-buffer slot
        self._table_full = False
        self.on_segment: Callable[[Any, bool], None] = lambda seg, made: None
        """Told of every pool segment made (True) or dropped (False) after start: the state keeper."""
        try:
            swap["paths"] = list(self._claim.dirs)
            io = dict(io)
            io.setdefault("probe_paths", swap["paths"])  # AIO only where the swap paths take O_DIRECT
            self._engine = _swap.open_engine(_swap.IoEngineConfig(**io))
            self._space = _swap.SwapSpace(_swap.SwapSpaceConfig(**swap), engine=self._engine,
                                          adopt=adopt.swap_files if adopt else None)
            self._pool = NodePool(pool, on_made=self._register, on_dropped=self._unregister,
                                  adopt=adopt.pool if adopt else None)
        except BaseException:
            self.close()
            raise
        self._store_engine = _PoolRegisteredEngine(self._engine)
        if self._engine.name == "io_uring":
            logger.info("io_uring: %d of %d pool segment(s) registered once, for every session",
                        sum(slot is not None for slot in self._slots.values()), len(self._slots))
        self.engine_name = str(self._engine.name)
        logger.info("swap: engine %s, %d file(s), %d bytes", self.engine_name, len(self._space.files),
                    self._space.capacity_bytes)

    def open_store(self, quota_bytes: int, owner_uid: int, on_change: Callable[..., None] | None = None,
                   adopted: list[int] | None = None) -> SessionStore:
        """A store over ``quota_bytes`` (a whole number of segments) lent from the node pool; with
        ``adopted``, over those segments a predecessor's session held (its regions restored by the caller)."""
        seg = self._pool.segment_bytes
        segments = self._pool.take(quota_bytes // seg, owner_uid) if adopted is None else \
            self._pool.take_adopted(adopted)
        try:
            host = _swap.HostPool(_swap.HostPoolConfig(capacity_bytes=quota_bytes, segment_bytes=seg),
                                  segments=segments)
            store = _swap.TierStore(self._store_config, pool=host, space=self._space, engine=self._store_engine,
                                    on_change=on_change)
        except BaseException:
            self._pool.give(segments, owner_uid)
            raise

        def close() -> None:
            try:
                store.close()  # frees every region's extents in the shared space, waits for its transfers
            finally:
                host.close()
                self._pool.give(segments, owner_uid)  # zeroed, kept for this uid ([Note: recycling segments])

        return SessionStore(store, list(host.segments), close)

    @property
    def segment_bytes(self) -> int:
        return self._pool.segment_bytes

    def _placements(self, regions: dict[str, dict]) -> list[list[Any]]:
        return [[_swap.Placement(*p) for p in r["placements"]] for r in regions.values() if r["placements"]]

    def reserve_extents(self, regions: dict[str, dict]) -> None:
        """Hold the swap extents of a session waiting for its trainer's hand-back (its ``durable`` records)."""
        for placements in self._placements(regions):
            self._space.reserve(placements)

    def release_extents(self, regions: dict[str, dict]) -> None:
        for placements in self._placements(regions):
            self._space.release(placements)

    def install(self, indices: list[int], fds: list[int]) -> None:
        """Segments handed back by the trainer that maps them (inodes checked by the caller)."""
        for index, fd in zip(indices, fds):
            self._pool.install(index, fd)

    def vacant_inodes(self, indices: list[int]) -> list[int | None]:
        """The journaled memfd inodes of vacant segments (None: not vacant)."""
        return [self._pool.vacant.get(i) for i in indices]

    def fill(self, indices: list[int]) -> None:
        """Vacant segments that no trainer handed back: made anew."""
        self._pool.fill(indices)

    def return_adopted(self, indices: list[int], owner_uid: int) -> None:
        """A predecessor's session was refused: its segments go back to the pool (zeroed, kept for its uid)."""
        self._pool.return_adopted(indices, owner_uid)

    def pool_record(self) -> dict[str, Any]:
        """The pool as the journal keeps it: its shape and each segment's memfd inode."""
        return {"segment_bytes": self._pool.segment_bytes, "count": self._pool.count,
                "inodes": {str(i): ino for i, ino in sorted({**self._pool.vacant, **{
                    i: os.fstat(s.fd).st_ino for i, s in self._pool.segments.items()}}.items())},
                "given": {str(uid): indices for uid, indices in self._pool.given().items()}}

    def pool_segments(self) -> dict[int, Any]:
        return dict(self._pool.segments)

    def swap_record(self) -> dict[str, Any]:
        return {"dirs": list(self._claim.dirs), "files": [f.record() for f in self._space.files]}

    def _register(self, seg: Any) -> None:
        """A new pool segment: pin it for io_uring once (when the engine's table is full, it goes unregistered)."""
        self.on_segment(seg, True)
        slot = None
        if not self._table_full:
            slot = self._engine.register_buffer(seg.address, seg.nbytes)  # None where the engine has no table
            self._table_full = slot is None and self._engine.name == "io_uring"
        self._slots[seg.index] = slot

    def _unregister(self, seg: Any) -> None:
        self.on_segment(seg, False)
        slot = self._slots.pop(seg.index, None)
        if slot is not None:
            self._engine.unregister_buffer(slot)
            self._table_full = False

    def engine_stats(self) -> dict[str, Any]:
        return dict(self._engine.stats())

    def space_info(self) -> dict[str, Any]:
        return {"files": [f.path for f in self._space.files], "used_bytes": self._space.used_bytes,
                "capacity_bytes": self._space.capacity_bytes}

    def close(self, keep: bool = False) -> None:
        """Close the pool, the swap space (its files unlinked), the engine and the claim. Idempotent.
        ``keep``: leave the segments' pages and the swap files for a successor (the fd store holds the
        segments); only the engine is closed."""
        try:
            if self._pool is not None and not keep:
                self._pool.close()  # unregisters each segment before it goes
            if self._space is not None:
                self._space.close(keep_files=keep)
        finally:
            try:
                if self._engine is not None:
                    self._engine.close()
            finally:
                self._claim.close(keep=keep)


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k.name if isinstance(k, enum.Enum) else k): _plain(v) for k, v in value.items()}
    return value


def _fields(obj: Any) -> dict[str, Any]:
    if isinstance(obj, dict):
        return dict(obj)
    if dataclasses.is_dataclass(obj):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if hasattr(obj, "_asdict"):
        return dict(obj._asdict())
    return dict(vars(obj))


def region_to_wire(info: Any) -> dict[str, Any]:
    return {k: _plain(v) for k, v in _fields(info).items()}


def region_from_wire(fields: dict[str, Any]) -> Any:
    if _HAVE_SWAP:
        values = dict(fields)
        if isinstance(values.get("tier"), str):
            values["tier"] = _swap.Tier[values["tier"]]
        return _swap.RegionInfo(**values)
    return _RegionInfo(**fields)


def stats_to_wire(stats: Any) -> dict[str, Any]:
    return {k: _plain(v) for k, v in _fields(stats).items()}


def stats_from_wire(fields: dict[str, Any]) -> Any:
    if _HAVE_SWAP:
        try:
            return _swap.TierStats(**fields)
        except TypeError:  # a test double's stats: keep them as they came
            logger.debug("stats fields are not TierStats'; returning a dict")
    return dict(fields)
