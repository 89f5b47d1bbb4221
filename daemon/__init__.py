"""Daemon: the node service that owns pinned memory and NVMe swap and serves TierClient.

Run it with ``offload daemon --config node.toml``; a training process reaches it with
``TierClient(TierClientConfig(socket_path=..., job_id=..., rank=...))``, which has the
verbs of ``swap.TierStore``. Layout: ``protocol`` (messages and byte layouts), ``shm``
(memfd segments and SCM_RIGHTS), ``sessions`` (ownership, tokens, grace), ``scheduler``
(fair NVMe queue), ``metrics`` (Prometheus, /healthz, the bounded HTTP server),
``handlers``, ``connection`` (framing, request fairness) and ``server`` (asyncio, life
cycle), ``admission`` (connection caps, fd limit), ``client`` and ``tokens``
(TierClient and its reattach tokens), ``config`` (TOML), ``backend`` (the swap objects the
daemon serves), ``pool`` (the node pool, made once and recycled), ``files`` (swap files
under a lock, swept after a crash).
"""
from daemon.client import TierClient, TierClientConfig, daemon_status
from daemon.config import (DaemonConfig, MetricsConfig, PoolConfig, SchedulerConfig, ServerConfig, SessionConfig,
                           load_config)
from daemon.metrics import DaemonMetrics
from daemon.server import DaemonServer, run_daemon

__all__ = [
    "TierClient",
    "TierClientConfig",
    "daemon_status",
    "DaemonConfig",
    "ServerConfig",
    "PoolConfig",
    "SessionConfig",
    "SchedulerConfig",
    "MetricsConfig",
    "load_config",
    "DaemonMetrics",
    "DaemonServer",
    "run_daemon",
]
