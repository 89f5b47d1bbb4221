"""Daemon: the node service that owns pinned memory and NVMe swap and serves TierClient.

Run it with ``offload daemon --config node.toml``; a training process reaches it with
``TierClient(TierClientConfig(socket_path=..., job_id=..., rank=...))``, which has the
verbs of ``swap.TierStore``. Layout: ``protocol`` (messages and byte layouts), ``shm``
(memfd segments and SCM_RIGHTS), ``sessions`` (ownership, tokens, grace), ``scheduler``
(fair NVMe queue), ``metrics`` (Prometheus, /healthz, the bounded HTTP server),
``handlers``, ``connection`` (framing, request fairness) and ``server`` (asyncio, life
cycle), ``admission`` (connection caps, fd limit), ``notify`` (systemd's READY=1),
``control`` (the blocking control connection and ``daemon_status``), ``client`` and
``tokens`` (TierClient and its reattach tokens), ``config`` (TOML), ``backend`` (the swap
objects the daemon serves), ``pool`` (the node pool, made once and recycled), ``files``
(swap files under a lock, swept after a crash, through aiofiles), ``journal`` (the bookkeeping kept
for a successor), ``restart`` (what a start takes over from its predecessor, through systemd's fd
store), ``handback`` (sessions whose trainers give their memory back to a restarted daemon).
"""
# Names load on first use: `offload status` needs only the client and the protocol, not the server's
# metrics and swap layer (a third of a second of imports on a loaded node).
_LAZY = {"TierClient": "daemon.client", "TierClientConfig": "daemon.client", "daemon_status": "daemon.control",
         "DaemonConfig": "daemon.config", "ServerConfig": "daemon.config", "PoolConfig": "daemon.config",
         "SessionConfig": "daemon.config", "SchedulerConfig": "daemon.config", "MetricsConfig": "daemon.config",
         "load_config": "daemon.config", "DaemonMetrics": "daemon.metrics", "DaemonServer": "daemon.server",
         "run_daemon": "daemon.server"}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'daemon' has no attribute {name!r}")
