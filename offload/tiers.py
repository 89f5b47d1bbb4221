"""Open a tier from its plan (``offload.plan``): the embedded ``TierStore`` or a node daemon session.

The optimizer state's tier and stage 3's param shards' are opened here. Both kinds speak the same verbs (``allocate``, ``host_view``, ``mark_dirty``, ``prefetch`` /
``wait_for_prefetch``, ``evict`` / ``wait_for_evict``, ``free``, ``stats``, ``close``), so
nothing above this module knows which one it has. The daemon is used when the config's
``offload.daemon_socket`` or ``OFFLOAD_DAEMON_SOCKET`` names one; otherwise the store runs
inside this process (nothing to start): host only for ``cpu``, with a swap file under
``nvme_path`` for ``nvme``.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from offload.plan.tier_plan import PAGE, TierPlan
from offload.runtime.swap_dirs import SwapDir, claim_swap_dir
from swap import IoEngineConfig, TierStore, TierStoreConfig, align_up

logger = logging.getLogger(__name__)

__all__ = ["Tier", "open_tier"]


@dataclasses.dataclass
class Tier:
    """An open tier: the store (TierStore or TierClient), what it is, and what to clean up."""

    store: Any
    description: str
    swap_dir: SwapDir | None = None
    """The embedded store's swap directory, held while the tier is open ([Note: engine swap directories])."""
    daemon: bool = False
    registration: Any = None
    """``offload.gpu.HostRegistration`` of the store's segments (a GPU model), undone before the store closes."""

    @property
    def placement(self) -> str:
        """Where the tier keeps its bytes, for the one log line that says so: the daemon's socket and
        session, or the store and its swap files' directory."""
        return f"{self.description}, swap files in {self.swap_dir.path}" if self.swap_dir else self.description

    def register_with_cuda(self, api: Any = "torch") -> None:
        """Register the store's host segments with CUDA once (a no-op without CUDA); ``api`` is injectable."""
        from offload.gpu.registration import HostRegistration, cuda_host_api

        if self.registration is None:
            self.registration = HostRegistration(cuda_host_api() if api == "torch" else api)
        self.registration.register_tier(self.store)

    def close(self, *, keep_session: bool = False) -> None:
        if self.registration is not None:
            self.registration.close()
            self.registration = None
        if keep_session and hasattr(self.store, "detach"):
            self.store.detach()
        else:
            self.store.close()
        if self.swap_dir is not None:
            self.swap_dir.release()
            self.swap_dir = None


def open_tier(plan: TierPlan, *, daemon_socket: str | None, job_id: str, rank: int, aio: Any, checksum: bool,
              huge_pages: str = "auto", reconnect_seconds: float = 300.0) -> Tier:
    """Open the daemon session or the embedded store for ``plan`` (``offload.plan``: its host and swap
    capacities, and what a session holds besides its regions); ``huge_pages``: the embedded pool's,
    ``offload.huge_pages``; ``reconnect_seconds``: how long the session's client retries a lost daemon."""
    if daemon_socket:
        from daemon import TierClient, TierClientConfig

        client = TierClient(TierClientConfig(socket_path=daemon_socket, job_id=job_id, rank=rank,
                                             quota_bytes=plan.session_bytes(), reconnect_seconds=reconnect_seconds))
        packed = plan.quota_bytes(client.segment_bytes)
        if packed > client.quota_bytes and not client.reattached:
            client.close()  # [Note: quota in segments]: ask again for one that packs
            client = TierClient(TierClientConfig(socket_path=daemon_socket, job_id=job_id, rank=rank,
                                                 quota_bytes=packed, reconnect_seconds=reconnect_seconds))
        return Tier(client, f"daemon {daemon_socket} (job {job_id!r}, rank {rank})", daemon=True)
    config = TierStoreConfig(checksum="crc32c" if checksum else "none")
    host_bytes = plan.host_capacity_bytes or align_up(plan.resident_bytes, PAGE)
    if not plan.nvme:
        store = TierStore.create(host_capacity_bytes=host_bytes, swap_paths=[], swap_capacity_bytes=0,
                                 segment_bytes=plan.segment_bytes, config=config, slot_bytes=plan.slot_bytes,
                                 huge_pages=huge_pages)
        return Tier(store, "embedded TierStore (host memory)")
    swap_dir = claim_swap_dir(plan.nvme_path, rank)  # dead engines' directories swept first
    try:
        engine_config = IoEngineConfig(block_size_bytes=aio.block_size, queue_depth=aio.queue_depth,
                                       num_threads=aio.intra_op_parallelism, probe_paths=(swap_dir.path,))
        store = TierStore.create(host_capacity_bytes=host_bytes, swap_paths=[swap_dir.path],
                                 swap_capacity_bytes=plan.swap_capacity_bytes or align_up(plan.swap_bytes, PAGE),
                                 engine_config=engine_config, segment_bytes=plan.segment_bytes, config=config,
                                 slot_bytes=plan.slot_bytes, huge_pages=huge_pages)
    except BaseException:
        swap_dir.release()
        raise
    return Tier(store, f"embedded TierStore ({store.engine.name}, swap in {plan.nvme_path})", swap_dir)
