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
socket_group = "offload"          # its members may connect ("": the daemon's group, no one by group)
max_connections_per_uid = 256     # and hello_timeout_seconds, idle_timeout_seconds, fd_limit, ...
keep_state = "auto"               # a restart takes the sessions over: systemd's fd store, else state_dir

[pool]
capacity_bytes = 17179869184      # node-wide host memory, made and faulted in once at start
segment_bytes = 268435456         # a session's quota is a whole number of segments
huge_pages = "auto"

[sessions]
default_quota_bytes = 4294967296
reattach_grace_seconds = 60.0
max_sessions_per_uid = 256        # and max_regions_per_session, max_region_name_bytes, ...

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
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
            raise ConfigError(f"{type(obj).__name__}.{name} must be a positive number, got {value!r}")


def _integers(obj: object, lo: int, hi: int, *names: str) -> None:
    """Each field named is an int in [lo, hi]."""
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise ConfigError(f"{type(obj).__name__}.{name} must be an integer in [{lo}, {hi}], got {value!r}")


def _seconds(obj: object, *names: str) -> None:
    """Each field named is a finite number of seconds >= 0 (0 turns the timer off where the field says so)."""
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1e9:
            raise ConfigError(f"{type(obj).__name__}.{name} must be a number of seconds in [0, 1e9), got {value!r}")


_MAX_BYTES = 1 << 53  # JSON numbers are exact up to here


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """The control socket."""

    socket_path: str = "/run/offload/daemon.sock"
    """Unix socket the daemon listens on; its directory must exist."""
    socket_mode: int = 0o660
    """File mode of the socket: owner and group may connect."""
    allowed_uids: tuple[int, ...] = ()
    """Peer uids allowed besides the daemon's own uid and root (checked with SO_PEERCRED)."""
    socket_group: str = ""
    """Group of the socket file, a name or a number ("": the daemon's own group, and no peer is allowed
    for its group). When it is named and socket_mode lets the group read and write, a peer in this group
    (primary or supplementary: SO_PEERCRED, SO_PEERGROUPS) is allowed too: training users join it, as
    with the docker group."""
    max_message_bytes: int = 65536
    """Largest message body accepted; a larger length prefix closes the connection."""
    drain_timeout_seconds: float = 60.0
    """On SIGTERM, how long in-flight I/O may take to finish before the daemon exits anyway."""
    close_timeout_seconds: float = 10.0
    """After the drain, how long closing sessions and the swap space may take before the daemon exits anyway."""
    max_connections: int = 4096
    """Connections open at once over all uids (also kept below the fd limit; see fd_limit)."""
    max_connections_per_uid: int = 256
    """Connections one uid may hold open at once. At either cap, a new connection replaces the
    oldest one that has no session and no request under way, or is refused naming the cap."""
    hello_timeout_seconds: float = 10.0
    """A connection that has opened no session this long after it connected is closed."""
    idle_timeout_seconds: float = 0.0
    """A connection with a session that sends nothing this long, with nothing under way, is closed: its
    session is detached and kept for the grace period, and TierClient reattaches by itself at its next call
    within it. 0 (the default): never; every session holds at least one pool segment, so the pool already
    bounds how many such connections there can be."""
    max_outstanding_requests: int = 256
    """Requests of one connection under way at once (waits, FLUSH, FREE, STATUS...); more get an error."""
    frames_per_turn: int = 8
    """Requests of one connection handled before every other connection gets its turn (request fairness)."""
    fd_limit: int = 65536
    """The daemon raises its open-file limit (RLIMIT_NOFILE) to this at start (at most the hard limit)."""
    keep_state: str = "auto"
    """Whether a restarted daemon takes over its predecessor's sessions ([Note: adopted state] in
    ``daemon.journal``): "fd_store" keeps the journal and the segments in systemd's fd store (the unit
    needs ``FileDescriptorStoreMax=``); "state_dir" keeps the journal in ``state_dir``, and the segments,
    which die with the daemon, come back from the trainers that map them ([Note: hand-back] in
    ``daemon.handback``); "off": a stop ends every session, as before; "auto": "fd_store" under systemd
    (``NOTIFY_SOCKET``), else "state_dir" where one is set, else "off"."""
    state_dir: str = ""
    """Where the journal is kept without an fd store; "" takes ``$STATE_DIRECTORY`` (systemd's
    ``StateDirectory=``), else none."""

    def __post_init__(self) -> None:
        _positive(self, "max_message_bytes", "drain_timeout_seconds", "close_timeout_seconds",
                  "hello_timeout_seconds")
        _seconds(self, "idle_timeout_seconds")
        _integers(self, 4096, 1 << 30, "max_message_bytes")
        if self.keep_state not in ("auto", "fd_store", "state_dir", "off"):
            raise ConfigError(f"[server] keep_state must be one of auto, fd_store, state_dir, off; "
                              f"got {self.keep_state!r}")
        _integers(self, 1, 1 << 20, "max_connections", "max_connections_per_uid", "max_outstanding_requests",
                  "frames_per_turn")
        _integers(self, 64, 1 << 24, "fd_limit")
        if not self.socket_path:
            raise ConfigError("ServerConfig.socket_path must not be empty")
        if not isinstance(self.socket_mode, int) or not 0 <= self.socket_mode <= 0o777:
            raise ConfigError(f"ServerConfig.socket_mode must be a file mode, got {self.socket_mode!r}")
        if len(self.socket_path.encode()) > 107:
            raise ConfigError(f"ServerConfig.socket_path is longer than a Unix socket path may be (107 bytes): "
                              f"{self.socket_path!r}")
        if not isinstance(self.socket_group, str):
            object.__setattr__(self, "socket_group", str(self.socket_group))
        object.__setattr__(self, "allowed_uids", tuple(int(u) for u in self.allowed_uids))
        if any(not 0 <= u < 1 << 32 for u in self.allowed_uids):
            raise ConfigError(f"ServerConfig.allowed_uids must be uids, got {self.allowed_uids!r}")


@dataclass(frozen=True, kw_only=True)
class PoolConfig:
    """Host memory: the node-wide budget that session pools are carved from."""

    capacity_bytes: int = 1 << 30
    """Total host memory (memfd segments) the daemon makes at start and hands out over all sessions;
    it must fit in the memory available at start."""
    segment_bytes: int = 64 << 20
    """Size of one memfd segment; a session's pool is a whole number of segments."""
    huge_pages: str = "auto"
    """"auto", "hugetlb", "thp" or "off": the page size of the segments (see swap.buffers' note)."""

    def __post_init__(self) -> None:
        _positive(self, "capacity_bytes", "segment_bytes")
        _integers(self, 1, _MAX_BYTES, "capacity_bytes", "segment_bytes")
        if self.segment_bytes % 4096:
            raise ConfigError(f"PoolConfig.segment_bytes must be a multiple of 4096, got {self.segment_bytes}")
        if self.huge_pages not in ("auto", "hugetlb", "thp", "off"):
            raise ConfigError(f"PoolConfig.huge_pages must be auto, hugetlb, thp or off, got {self.huge_pages!r}")


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
    min_quota_bytes: int = 4096
    """Smallest quota a HELLO may ask for (0 asks for default_quota_bytes)."""
    max_sessions: int = 1024
    """Sessions (attached or detached) over all uids."""
    max_sessions_per_uid: int = 256
    """Sessions (attached or detached) one uid may hold."""
    max_regions_per_session: int = 65536
    """Regions one session may hold at once."""
    max_region_name_bytes: int = 256
    """Longest region name (UTF-8 bytes)."""
    max_queued_transfers_per_session: int = 256
    """Prefetches, evicts and flushes of one session waiting in the scheduler at once."""
    max_unwaited_handles_per_session: int = 4096
    """Prefetch and evict handles of one session not yet waited for; more get an error until some are."""

    def __post_init__(self) -> None:
        _positive(self, "default_quota_bytes", "quota_wait_seconds")
        _seconds(self, "reattach_grace_seconds")
        _integers(self, 0, _MAX_BYTES, "max_quota_bytes")
        _integers(self, 1, _MAX_BYTES, "default_quota_bytes", "min_quota_bytes")
        _integers(self, 1, 1 << 24, "max_sessions", "max_sessions_per_uid", "max_regions_per_session",
                  "max_queued_transfers_per_session", "max_unwaited_handles_per_session")
        _integers(self, 1, 4096, "max_region_name_bytes")
        if self.max_quota_bytes and self.min_quota_bytes > self.max_quota_bytes:
            raise ConfigError("SessionConfig.min_quota_bytes must not exceed max_quota_bytes")
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
        _integers(self, 1, 1024, "max_inflight_jobs", "max_inflight_jobs_per_session")
        _integers(self, 4096, _MAX_BYTES, "quantum_bytes")


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """The Prometheus endpoint."""

    address: str = "127.0.0.1:9464"
    """host:port for /metrics and /healthz; an empty string turns the endpoint off."""
    max_connections: int = 8
    """Scrapes served at once; a connection beyond them is closed at once."""
    timeout_seconds: float = 5.0
    """Longest a scrape connection may take from accept to the last byte of its reply."""
    stall_seconds: float = 10.0
    """/healthz answers 503 when the daemon's event loop has not run for this long."""
    max_jobs: int = 64
    """Jobs with per-job series (offload_job_*) at once; reports of further jobs are only counted
    (offload_job_reports_over_cap_total). See [Note: bounded job labels] in daemon.jobs."""

    def __post_init__(self) -> None:
        _integers(self, 1, 1024, "max_connections")
        _integers(self, 0, 1 << 20, "max_jobs")
        _positive(self, "timeout_seconds", "stall_seconds")
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
