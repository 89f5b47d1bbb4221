"""Prometheus metrics of the daemon, in their own registry, served over HTTP.

Names follow the project's style: ``offload_`` prefix, base units (bytes, seconds),
``_total`` on counters, labels of low cardinality (never a region name; per-session
series carry only ``job`` and ``rank`` and are removed when the session is reclaimed).

================================================  =========  ==========================================
metric                                            type       labels
================================================  =========  ==========================================
offload_swap_bytes_total                          counter    tier (nvme), direction (read|write)
offload_request_seconds                           histogram  kind (protocol message kind)
offload_transfer_seconds                          histogram  direction (read|write): one store batch
offload_prefetch_wait_seconds                     histogram  (none): WAIT_PREFETCH until data is ready
offload_queue_depth                               gauge      class (prefetch|writeback)
offload_pinned_pool_bytes                         gauge      state (used|free)
offload_sessions                                  gauge      state (attached|detached)
offload_errors_total                              counter    kind (error class name)
offload_optimizer_step_seconds                    histogram  (none): reported by clients
offload_session_host_bytes                        gauge      job, rank: the session's quota
================================================  =========  ==========================================
"""
from __future__ import annotations

import logging
import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from csrc.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["TRANSFER_BUCKETS_SECONDS", "REQUEST_BUCKETS_SECONDS", "DaemonMetrics"]

# Control round trips run 50 us - 1 ms; a batch of 64 MiB at 2 GB/s takes ~30 ms, and
# a multi-GiB prefetch seconds. The web defaults (5 ms - 10 s) see neither end.
REQUEST_BUCKETS_SECONDS = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 30.0,
)
TRANSFER_BUCKETS_SECONDS = (1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STEP_BUCKETS_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class DaemonMetrics:
    """Every metric the daemon exports, registered in ``registry`` (a new one by default)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.swap_bytes = Counter(
            "offload_swap_bytes", "Bytes moved between host memory and a tier.", ["tier", "direction"], registry=r
        )
        self.request_seconds = Histogram(
            "offload_request_seconds", "Time from a request's arrival to its reply.", ["kind"],
            buckets=REQUEST_BUCKETS_SECONDS, registry=r,
        )
        self.transfer_seconds = Histogram(
            "offload_transfer_seconds", "Time one scheduled store batch took.", ["direction"],
            buckets=TRANSFER_BUCKETS_SECONDS, registry=r,
        )
        self.prefetch_wait_seconds = Histogram(
            "offload_prefetch_wait_seconds", "Time a client waited in WAIT_PREFETCH.",
            buckets=REQUEST_BUCKETS_SECONDS, registry=r,
        )
        self.queue_depth = Gauge("offload_queue_depth", "Store batches queued, not yet dispatched.", ["class"], registry=r)
        self.pool_bytes = Gauge("offload_pinned_pool_bytes", "Host memory of the node pool.", ["state"], registry=r)
        self.sessions = Gauge("offload_sessions", "Sessions by state.", ["state"], registry=r)
        self.errors = Counter("offload_errors", "Error replies and dropped connections, by kind.", ["kind"], registry=r)
        self.optimizer_step_seconds = Histogram(
            "offload_optimizer_step_seconds", "Optimizer step times reported by clients.",
            buckets=STEP_BUCKETS_SECONDS, registry=r,
        )
        self.session_host_bytes = Gauge(
            "offload_session_host_bytes", "Host memory held by a session.", ["job", "rank"], registry=r
        )
        for direction in ("read", "write"):
            self.swap_bytes.labels(tier="nvme", direction=direction)
        for cls in ("prefetch", "writeback"):
            self.queue_depth.labels(cls).set(0)
        self._http: Any = None
        self._http_thread: threading.Thread | None = None

    def set_pool(self, used_bytes: int, capacity_bytes: int) -> None:
        self.pool_bytes.labels(state="used").set(used_bytes)
        self.pool_bytes.labels(state="free").set(capacity_bytes - used_bytes)

    def set_sessions(self, attached: int, detached: int) -> None:
        self.sessions.labels(state="attached").set(attached)
        self.sessions.labels(state="detached").set(detached)

    def error(self, kind: str) -> None:
        self.errors.labels(kind=kind).inc()

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics on ``host:port`` (port 0 picks one); returns the bound port."""
        try:
            result = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise ConfigError(f"[metrics] address {host}:{port}: {exc.strerror or exc}") from exc
        if isinstance(result, tuple):  # prometheus-client >= 0.17 returns (server, thread)
            self._http, self._http_thread = result
            bound = int(self._http.server_address[1])
        else:  # pragma: no cover - older clients return nothing
            bound = port
        logger.info("metrics on http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
