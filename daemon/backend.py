"""The store-facing side of the daemon: build the swap objects, and carry their values on the wire.

The daemon serves the swap package's ``TierStore``: one ``SwapSpace`` and one I/O
engine shared by every session, and per session its own ``HostPool`` (memfd
segments, sized by the session's quota) under its own ``TierStore``. ``SwapBackend``
builds them from the daemon's config; anything with the same two methods
(``open_store``, ``close``) and an ``engine_name`` can stand in for it (the tests use
a test double while the real store is absent).

``region_to_wire`` / ``region_from_wire`` and ``stats_to_wire`` / ``stats_from_wire``
turn ``RegionInfo`` and ``TierStats`` into JSON fields and back; enum values travel by
name.
"""
from __future__ import annotations

import dataclasses
import enum
import logging
from typing import Any, Mapping, NamedTuple, Protocol, Sequence

from csrc.errors import ConfigError
from daemon.config import PoolConfig, SwapConfig

logger = logging.getLogger(__name__)

__all__ = ["StoreBackend", "SwapBackend", "region_to_wire", "region_from_wire", "stats_to_wire", "stats_from_wire"]

try:  # the swap layer (issue 3); the daemon cannot serve without it
    import swap as _swap

    _HAVE_SWAP = hasattr(_swap, "TierStore")
except ImportError:  # pragma: no cover - only while the swap package is incomplete
    _swap = None
    _HAVE_SWAP = False


class _RegionInfo(NamedTuple):
    """Stand-in for ``swap.RegionInfo`` while the swap package lacks it."""

    name: str
    nbytes: int
    segment_index: int
    offset: int
    tier: str


class StoreBackend(Protocol):
    engine_name: str

    def open_store(self, quota_bytes: int) -> tuple[Any, Sequence[Any]]:
        """A new ``(TierStore, segments)`` for one session; segments have .fd/.nbytes/.index."""

    def close(self) -> None:
        """Release what every session shared (swap space, engine)."""


class SwapBackend:
    """The real thing: swap's HostPool/SwapSpace/engine/TierStore built from the daemon config."""

    def __init__(self, pool: PoolConfig, swap_config: SwapConfig, io: Mapping[str, Any]) -> None:
        if not _HAVE_SWAP:
            raise ConfigError("the swap package (TierStore) is not installed in this build; the daemon cannot serve")
        if not swap_config.paths:
            raise ConfigError("[swap] paths must name at least one directory")
        self._pool_config = pool
        try:
            self._engine = _swap.open_engine(_swap.IoEngineConfig(**dict(io)))
        except TypeError as exc:
            raise ConfigError(f"[io]: {exc}") from exc
        self._space = _swap.SwapSpace(
            _swap.SwapSpaceConfig(paths=list(swap_config.paths), capacity_bytes=swap_config.capacity_bytes),
            engine=self._engine,
        )
        self.engine_name = str(getattr(self._engine, "name", type(self._engine).__name__))
        logger.info("swap: engine %s, paths %s, %d bytes", self.engine_name, swap_config.paths, swap_config.capacity_bytes)

    def open_store(self, quota_bytes: int) -> tuple[Any, Sequence[Any]]:
        seg = self._pool_config.segment_bytes
        host = _swap.HostPool(_swap.HostPoolConfig(capacity_bytes=quota_bytes, segment_bytes=min(seg, quota_bytes)))
        store = _swap.TierStore(_swap.TierStoreConfig(), pool=host, space=self._space, engine=self._engine)
        return store, list(host.segments)

    def close(self) -> None:
        for obj in (self._space, self._engine):
            close = getattr(obj, "close", None)
            if close is not None:
                close()


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
    if _HAVE_SWAP and hasattr(_swap, "RegionInfo"):
        values = dict(fields)
        tier_cls = getattr(_swap, "Tier", None)
        if tier_cls is not None and isinstance(values.get("tier"), str):
            values["tier"] = tier_cls[values["tier"]]
        return _swap.RegionInfo(**values)
    return _RegionInfo(**fields)


def stats_to_wire(stats: Any) -> dict[str, Any]:
    return {k: _plain(v) for k, v in _fields(stats).items()}


def stats_from_wire(fields: dict[str, Any]) -> Any:
    if _HAVE_SWAP and hasattr(_swap, "TierStats"):
        try:
            return _swap.TierStats(**fields)
        except TypeError:
            logger.debug("TierStats fields differ from the wire; returning a dict")
    return dict(fields)
