"""The daemon's configuration: one frozen dataclass per component, read from TOML.

``load_config(path, overrides)`` is the one function that reads ``node.toml``. The
file has one table per component; every key maps to a field below, and a key that
is not a field is a ``ConfigError`` that names it (``[pool] capacty_bytes``).
The ``[swap]``, ``[io]`` and ``[store]`` tables are the swap package's own config
dataclasses, passed through; their keys are checked against those classes' fields.
Command-line flags arrive as ``overrides`` (``{"pool.capacity_bytes": ...}``) and
win over the file.

```toml
[server]
socket_path = "/run/offload/daemon.sock"
socket_mode = 0o660

[pool]
capacity_bytes = 17179869184      # node-wide host memory the daemon may hand out
segment_bytes = 268435456

[sessions]
default_quota_bytes = 4294967296
reattach_grace_seconds = 60.0

[scheduler]
max_inflight_jobs = 2

[swap]                             # the swap package's SwapSpaceConfig, shared by all sessions
paths = ["/nvme0/offload"]
capacity_bytes = 107374182400

[io]                               # its IoEngineConfig (probe_paths default to the swap paths)
queue_depth = 32

[store]                            # its TierStoreConfig, for each session's store
checksum = "crc32c"

[metrics]
address = "127.0.0.1:9464"
```
"""
from __future__ import annotations

import dataclasses
import logging
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from csrc.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = [
    "ServerConfig",
    "PoolConfig",
    "SessionConfig",
    "SchedulerConfig",
    "MetricsConfig",
    "DaemonConfig",
    "load_config",
]


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{type(obj).__name__}.{name} must be a positive number, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """The control socket."""

    socket_path: str = "/run/offload/daemon.sock"
    """Unix socket the daemon listens on; its directory must exist."""
    socket_mode: int = 0o660
    """File mode of the socket: owner and group may connect."""
    allowed_uids: tuple[int, ...] = ()
    """Peer uids allowed besides the daemon's own uid and root (checked with SO_PEERCRED)."""
    max_message_bytes: int = 65536
    """Largest message body accepted; a larger length prefix closes the connection."""
    drain_timeout_seconds: float = 60.0
    """On SIGTERM, how long in-flight I/O may take to finish before the daemon exits anyway."""

    def __post_init__(self) -> None:
        _positive(self, "max_message_bytes", "drain_timeout_seconds")
        if not self.socket_path:
            raise ConfigError("ServerConfig.socket_path must not be empty")
        if not 0 <= self.socket_mode <= 0o777:
            raise ConfigError(f"ServerConfig.socket_mode must be a file mode, got {self.socket_mode!r}")
        object.__setattr__(self, "allowed_uids", tuple(int(u) for u in self.allowed_uids))


@dataclass(frozen=True, kw_only=True)
class PoolConfig:
    """Host memory: the node-wide budget that session pools are carved from."""

    capacity_bytes: int = 1 << 30
    """Total host memory (memfd segments) the daemon hands out over all sessions."""
    segment_bytes: int = 64 << 20
    """Size of one memfd segment; a session's pool is a whole number of segments."""

    def __post_init__(self) -> None:
        _positive(self, "capacity_bytes", "segment_bytes")
        if self.segment_bytes % 4096:
            raise ConfigError(f"PoolConfig.segment_bytes must be a multiple of 4096, got {self.segment_bytes}")


@dataclass(frozen=True, kw_only=True)
class SessionConfig:
    """Sessions: quotas and the reattach grace period."""

    default_quota_bytes: int = 256 << 20
    """Host memory a session gets when its hello asks for none."""
    max_quota_bytes: int = 0
    """Largest quota one session may ask for; 0 means the whole pool."""
    reattach_grace_seconds: float = 60.0
    """How long a disconnected session keeps its memory and extents for a reattach."""
    quota_policy: str = "error"
    """When the node pool cannot hold a new session's quota: "error" (QuotaExceededError at
    once) or "wait" (the HELLO waits for other sessions to end, up to quota_wait_seconds)."""
    quota_wait_seconds: float = 60.0
    """With quota_policy "wait": how long a HELLO waits for room before QuotaExceededError."""

    def __post_init__(self) -> None:
        _positive(self, "default_quota_bytes", "quota_wait_seconds")
        if self.max_quota_bytes < 0 or self.reattach_grace_seconds < 0:
            raise ConfigError("SessionConfig.max_quota_bytes and reattach_grace_seconds must be >= 0")
        if self.quota_policy not in ("error", "wait"):
            raise ConfigError(f"SessionConfig.quota_policy must be 'error' or 'wait', got {self.quota_policy!r}")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """The fair NVMe scheduler."""

    max_inflight_jobs: int = 4
    """Batches in flight at once over all sessions (each batch is one store call)."""
    max_inflight_jobs_per_session: int = 2
    """Batches of one session in flight at once (on disjoint regions; see the scheduler's note)."""
    quantum_bytes: int = 64 << 20
    """Bytes a session may dispatch per round-robin turn (deficit round robin)."""

    def __post_init__(self) -> None:
        _positive(self, "max_inflight_jobs", "max_inflight_jobs_per_session", "quantum_bytes")


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """The Prometheus endpoint."""

    address: str = "127.0.0.1:9464"
    """host:port for /metrics; an empty string turns the endpoint off."""

    def __post_init__(self) -> None:
        if self.address:
            host, sep, port = self.address.rpartition(":")
            if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
                raise ConfigError(f"MetricsConfig.address must be host:port, got {self.address!r}")

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.address.rpartition(":")
        return host or "127.0.0.1", int(port)


@dataclass(frozen=True, kw_only=True)
class DaemonConfig:
    """Everything the daemon reads; each component receives only its own table."""

    server: ServerConfig = field(default_factory=ServerConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    sessions: SessionConfig = field(default_factory=SessionConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    swap: Mapping[str, Any] = field(default_factory=dict)
    """Fields of the swap package's SwapSpaceConfig (paths, capacity_bytes, stripe_bytes, ...)."""
    io: Mapping[str, Any] = field(default_factory=dict)
    """Fields of the swap package's IoEngineConfig (kind, block_size_bytes, queue_depth, ...)."""
    store: Mapping[str, Any] = field(default_factory=dict)
    """Fields of the swap package's TierStoreConfig (chunk_bytes, checksum), for every session's store."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)


_TABLES = {f.name: f for f in dataclasses.fields(DaemonConfig)}
# Tables passed through to the swap package's own config dataclasses, by their names there.
_SWAP_TABLES = {"swap": "SwapSpaceConfig", "io": "IoEngineConfig", "store": "TierStoreConfig"}


def _check_swap_table(table: str, values: Mapping[str, Any]) -> None:
    """Unknown keys of a pass-through table are errors too (when the swap package is here to ask)."""
    try:
        import swap
    except ImportError:  # the daemon cannot start without it anyway; it says so then
        return
    cls = getattr(swap, _SWAP_TABLES[table], None)
    if cls is None or not dataclasses.is_dataclass(cls):
        return
    names = {f.name for f in dataclasses.fields(cls)}
    for key in values:
        if key not in names:
            raise ConfigError(f"unknown key [{table}] {key} (known: {', '.join(sorted(names))})")


def _build(cls: type, table: str, values: Mapping[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    for key in values:
        if key not in names:
            raise ConfigError(f"unknown key [{table}] {key} (known: {', '.join(sorted(names))})")
    try:
        return cls(**values)
    except TypeError as exc:  # a wrong type the dataclass could not take
        raise ConfigError(f"[{table}]: {exc}") from exc


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> DaemonConfig:
    """Read ``path`` (TOML; None means defaults), apply ``overrides`` ("table.key": value)."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except FileNotFoundError as exc:
            raise ConfigError(f"config file {path} not found") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path}: {exc}") from exc
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        table, _, key = dotted.partition(".")
        raw.setdefault(table, {})[key] = value
    built: dict[str, Any] = {}
    for table, values in raw.items():
        if table not in _TABLES:
            raise ConfigError(f"unknown table [{table}] (known: {', '.join(sorted(_TABLES))})")
        if not isinstance(values, dict):
            raise ConfigError(f"[{table}] must be a table, got {values!r}")
        if table in _SWAP_TABLES:
            _check_swap_table(table, values)
            built[table] = dict(values)
            continue
        cls = _TABLES[table].default_factory().__class__  # type: ignore[misc]
        built[table] = _build(cls, table, values)
    config = DaemonConfig(**built)
    logger.debug("config %s", config)
    return config
