"""Prometheus metrics of the daemon, in their own registry, served over HTTP with /healthz.

Names follow the project's style: ``offload_`` prefix, base units (bytes, seconds),
``_total`` on counters, labels of low cardinality (never a region name; per-session
series carry only ``uid``, ``job`` and ``rank`` and are removed when the session is
reclaimed). No ``_created`` series are exported.

================================================  =========  ==========================================
metric                                            type       labels
================================================  =========  ==========================================
offload_swap_bytes_total                          counter    tier (nvme), direction (read|write)
offload_request_seconds                           histogram  kind (protocol message kind)
offload_transfer_seconds                          histogram  direction (read|write): one store batch
offload_prefetch_wait_seconds                     histogram  (none): WAIT_PREFETCH until data is ready
offload_queue_depth                               gauge      class (prefetch|writeback)
offload_in_flight_bytes                           gauge      (none): bytes of the transfers running now
offload_pinned_pool_bytes                         gauge      state (used|free): quotas reserved, and the rest
offload_swap_space_bytes                          gauge      state (used|capacity): extents in the swap files
offload_sessions                                  gauge      state (attached|detached)
offload_sessions_adopted_total                    counter    (none): taken over from a previous daemon at start
offload_sessions_reattached_after_restart_total   counter    (none): of those, reattached by their trainer
offload_sessions_refused_total                    counter    (none): a previous daemon's sessions not taken over
offload_journal_records_total, _seconds_total    counter    (none): kept for a successor, and the time it took
offload_errors_total                              counter    kind (error class name); a poll's "not yet"
                                                             is no error (see daemon.handlers)
offload_optimizer_step_seconds                    histogram  (none): reported by clients
offload_session_host_bytes                        gauge      uid, job, rank: bytes its regions hold in the pool
offload_session_quota_bytes                       gauge      uid, job, rank: the session's quota (reserved)
offload_job_* (step, steps, seconds, bytes...)    various    uid, job, rank: reported by engines per step
                                                             (``daemon.jobs``: at most [metrics] max_jobs jobs)
offload_build_info                                gauge      version, python, protocol (always 1)
process_* (cpu, memory, open fds, start time)      various    the standard process collector
================================================  =========  ==========================================

[Note: bounded metrics server] The endpoint is open to every local user, so it must
not be a way to exhaust the daemon: at most ``max_connections`` requests are served at
once (a connection beyond them is closed at once, unread), each connection gets
``timeout_seconds`` from accept to its last byte (then its socket is shut down, however
slowly it was sending), and only ``GET /metrics``, ``/healthz`` and ``/`` are answered.
``/healthz`` is a real check: 200 while the event loop has run within ``stall_seconds``
and the daemon is not stopping, else 503 with the reason.
"""
from __future__ import annotations

import http.server
import logging
import socket
import sys
import threading
import time
import urllib.parse
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from csrc.errors import ConfigError
from daemon.config import MetricsConfig, SessionConfig
from daemon.jobs import JobTable

logger = logging.getLogger(__name__)

__all__ = ["TRANSFER_BUCKETS_SECONDS", "REQUEST_BUCKETS_SECONDS", "DaemonMetrics", "BUILD_VERSION"]

# Control round trips run 50 us - 1 ms; a batch of 64 MiB at 2 GB/s takes ~30 ms, and
# a multi-GiB prefetch seconds. The web defaults (5 ms - 10 s) see neither end.
REQUEST_BUCKETS_SECONDS = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 30.0,
)
TRANSFER_BUCKETS_SECONDS = (1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STEP_BUCKETS_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("tiered-offload")
    except Exception:  # not installed as a distribution (a bare checkout on PYTHONPATH)
        return "0+unknown"


BUILD_VERSION = _version()


class _WithoutCreated:
    """A registry's families without their ``_created`` samples (a timestamp per series that doubles the
    series count and that no dashboard reads). Filtered here rather than switched off process-wide with
    ``disable_created_metrics``, which would change the metrics of any program that imports this package."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self):
        for family in self._registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class _LiveCollector:
    """Gauges read when scraped: swap space use and bytes in flight (from the daemon, once it is up)."""

    def __init__(self) -> None:
        self.handlers: Any = None
        self.backend: Any = None
        self.sessions: Any = None
        self.keeper: Any = None

    def _per_session(self):
        labels = ["uid", "job", "rank"]
        held = GaugeMetricFamily("offload_session_host_bytes", "Host memory a session's regions hold now "
                                 "(what offload status shows; at most its quota).", labels=labels)
        quota = GaugeMetricFamily("offload_session_quota_bytes", "Host memory reserved for a session (its quota).",
                                  labels=labels)
        for session in self.sessions or ():
            values = [str(session.owner_uid), session.job_id, str(session.rank)]
            try:
                used = session.store.stats().host_pool_used_bytes
            except Exception as exc:  # reclaimed under the scrape
                logger.debug("session %s not readable for metrics: %s", session.session_id, exc)
                continue
            held.add_metric(values, used)
            quota.add_metric(values, session.quota_bytes)
        return held, quota

    def collect(self):
        swap = GaugeMetricFamily("offload_swap_space_bytes", "Bytes of the swap files: extents used, and capacity.",
                                 labels=["state"])
        inflight = GaugeMetricFamily("offload_in_flight_bytes", "Bytes of the transfers running now.")
        if self.backend is not None:
            try:
                info = self.backend.space_info()
                swap.add_metric(["used"], info["used_bytes"])
                swap.add_metric(["capacity"], info["capacity_bytes"])
            except Exception as exc:  # closing under the scrape
                logger.debug("swap space not readable for metrics: %s", exc)
        if self.handlers is not None:
            inflight.add_metric([], self.handlers.inflight_bytes)
        yield swap
        yield inflight
        yield from self._per_session()
        journal = getattr(self.keeper, "journal", None)
        if journal is not None:
            yield CounterMetricFamily("offload_journal_records", "Records the journal kept for a successor "
                                      "(daemon.journal).", value=journal.records_total)
            yield CounterMetricFamily("offload_journal_seconds", "Time spent appending them (encoding, "
                                      "checksum, write; new generations included).", value=journal.seconds_total)


class DaemonMetrics:
    """Every metric the daemon exports, registered in ``registry`` (a new one by default)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.exposed = _WithoutCreated(self.registry)
        """What /metrics serves: the registry without _created series."""
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
        self.sessions_adopted = Counter("offload_sessions_adopted", "Sessions taken over from the previous "
                                        "daemon at start (daemon.restart).", registry=r)
        self.sessions_reattached_after_restart = Counter(
            "offload_sessions_reattached_after_restart", "Sessions taken over from the previous daemon that "
            "their trainer reattached.", registry=r)
        self.sessions_refused = Counter("offload_sessions_refused", "Sessions of the previous daemon not taken "
                                        "over (see the daemon's log for why).", registry=r)
        self.errors = Counter("offload_errors", "Error replies and dropped connections, by kind.", ["kind"], registry=r)
        self.optimizer_step_seconds = Histogram(
            "offload_optimizer_step_seconds", "Optimizer step times reported by clients.",
            buckets=STEP_BUCKETS_SECONDS, registry=r,
        )
        build = Gauge("offload_build_info", "The daemon's build (always 1).", ["version", "python", "protocol"],
                      registry=r)
        from daemon.protocol import PROTOCOL_VERSION
        build.labels(BUILD_VERSION, sys.version.split()[0], str(PROTOCOL_VERSION)).set(1)
        ProcessCollector(registry=r)
        self.jobs = JobTable(max_jobs=MetricsConfig().max_jobs, grace_seconds=SessionConfig().reattach_grace_seconds)
        """Per-job series (the server sets its cap and grace from the config)."""
        r.register(self.jobs)
        self._live = _LiveCollector()
        r.register(self._live)
        for direction in ("read", "write"):
            self.swap_bytes.labels(tier="nvme", direction=direction)
        for cls in ("prefetch", "writeback"):
            self.queue_depth.labels(cls).set(0)
        self._http: _BoundedHTTPServer | None = None
        self._http_thread: threading.Thread | None = None
        self._heartbeat = time.monotonic()
        self.stopping = False

    def watch(self, handlers: Any, backend: Any, sessions: Any = None, keeper: Any = None) -> None:
        """Read in-flight bytes from ``handlers``, swap use from ``backend``, each of ``sessions``' bytes held and
        ``keeper``'s journal figures at every scrape."""
        self._live.handlers, self._live.backend, self._live.sessions = handlers, backend, sessions
        self._live.keeper = keeper

    def heartbeat(self) -> None:
        """The event loop ran just now (called from the loop every second)."""
        self._heartbeat = time.monotonic()

    def health(self, stall_seconds: float) -> tuple[bool, str]:
        if self.stopping:
            return False, "stopping"
        age = time.monotonic() - self._heartbeat
        if age > stall_seconds:
            return False, f"event loop stalled for {age:.1f} s"
        return True, "ok"

    def set_pool(self, used_bytes: int, capacity_bytes: int) -> None:
        self.pool_bytes.labels(state="used").set(used_bytes)
        self.pool_bytes.labels(state="free").set(capacity_bytes - used_bytes)

    def set_sessions(self, attached: int, detached: int) -> None:
        self.sessions.labels(state="attached").set(attached)
        self.sessions.labels(state="detached").set(detached)

    def error(self, kind: str) -> None:
        self.errors.labels(kind=kind).inc()

    def serve(self, host: str, port: int, config: MetricsConfig | None = None) -> int:
        """Serve /metrics and /healthz on ``host:port`` (port 0 picks one); returns the bound port."""
        config = config or MetricsConfig()
        try:
            self._http = _BoundedHTTPServer((host, port), self, config)
        except OSError as exc:
            raise ConfigError(f"[metrics] address {host}:{port}: {exc.strerror or exc}") from exc
        self._http_thread = threading.Thread(target=self._http.serve_forever, name="ofl-metrics", daemon=True)
        self._http_thread.start()
        bound = int(self._http.server_address[1])
        logger.info("metrics on http://%s:%d/metrics (and /healthz)", host, bound)
        return bound

    def close(self) -> None:
        self.stopping = True
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class _Handler(http.server.BaseHTTPRequestHandler):
    server: "_BoundedHTTPServer"
    protocol_version = "HTTP/1.0"  # one request per connection

    def setup(self) -> None:
        self.timeout = self.server.config.timeout_seconds  # each read and write; the whole is bounded too
        super().setup()

    def do_GET(self) -> None:  # noqa: N802 - the http.server name
        self.server.read_done(self.request)
        path = urllib.parse.urlsplit(self.path).path
        metrics = self.server.metrics
        if path == "/metrics":
            self._send(200, generate_latest(metrics.exposed), prometheus_client.CONTENT_TYPE_LATEST)
        elif path == "/healthz":
            ok, why = metrics.health(self.server.config.stall_seconds)
            self._send(200 if ok else 503, (why + "\n").encode(), "text/plain; charset=utf-8")
        elif path == "/":
            self._send(200, b"offload daemon: /metrics, /healthz\n", "text/plain; charset=utf-8")
        else:
            self._send(404, b"not found\n", "text/plain; charset=utf-8")

    def _send(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the http.server signature
        logger.debug("metrics: %s", format % args)


class _BoundedHTTPServer(http.server.HTTPServer):
    """[Note: bounded metrics server]: a thread per request, at most max_connections of them.

    When every slot is taken, the connection that has been sending its request the longest
    is cut to make room (a scrape sends its request at once; a slow sender is the one to go),
    so a handful of half-sent requests cannot lock Prometheus out."""

    daemon_threads = True
    request_queue_size = 64

    def __init__(self, address: tuple[str, int], metrics: DaemonMetrics, config: MetricsConfig) -> None:
        self.metrics = metrics
        self.config = config
        self._slots = threading.BoundedSemaphore(config.max_connections)
        self._reading: dict[socket.socket, float] = {}  # connections still sending their request, since when
        self._lock = threading.Lock()
        self.refused_total = 0
        super().__init__(address, _Handler)

    def read_done(self, request: socket.socket) -> None:
        with self._lock:
            self._reading.pop(request, None)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            with self._lock:
                slowest = min(self._reading, key=self._reading.__getitem__, default=None)
                if slowest is not None:
                    del self._reading[slowest]
            if slowest is not None:
                _cut(slowest)
            if slowest is None or not self._slots.acquire(timeout=1.0):
                self.refused_total += 1
                self.shutdown_request(request)
                return
        with self._lock:
            self._reading[request] = time.monotonic()
        threading.Thread(target=self._serve_one, args=(request, client_address), name="ofl-metrics-req",
                         daemon=True).start()

    def _serve_one(self, request: socket.socket, client_address: Any) -> None:
        # The whole exchange is bounded, not only each read: a drip-fed request is cut off.
        timer = threading.Timer(self.config.timeout_seconds, _cut, (request,))
        timer.daemon = True
        timer.start()
        try:
            self.finish_request(request, client_address)
        except Exception as exc:  # a peer that went away, a timeout: its own problem
            logger.debug("metrics request from %s ended: %s", client_address, exc)
        finally:
            timer.cancel()
            self.read_done(request)
            self.shutdown_request(request)
            self._slots.release()


def _cut(request: socket.socket) -> None:
    try:
        request.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
