"""Daemon: the node service that owns pinned memory and NVMe swap and serves TierClient.

Not built yet (issue: "Daemon: the node service ...").
"""
__all__: list[str] = []
