"""Open the tier the optimizer state lives in: the embedded ``TierStore`` or the node daemon.

Both speak the same verbs (``allocate``, ``host_view``, ``mark_dirty``, ``prefetch`` /
``wait_for_prefetch``, ``evict`` / ``wait_for_evict``, ``free``, ``stats``, ``close``), so
nothing above this module knows which one it has. The daemon is used when the config's
``offload.daemon_socket`` or ``OFFLOAD_DAEMON_SOCKET`` names one; otherwise the store runs
inside this process (nothing to start): host only for ``offload_optimizer: cpu``, with a
swap file under ``nvme_path`` for nvme.
"""
from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
from typing import Any

from csrc import ConfigError
from swap import IoEngineConfig, TierStore, TierStoreConfig, align_up

logger = logging.getLogger(__name__)

__all__ = ["Tier", "TierPlan", "open_tier"]

PAGE = 4096


@dataclasses.dataclass(frozen=True, kw_only=True)
class TierPlan:
    """What the engine asks of its tier: sizes derived from the layout, and where to put files."""

    nvme: bool
    """Swap space on NVMe (offload_optimizer nvme) or host only (cpu)."""
    region_bytes: tuple[int, ...]
    """Every region the engine allocates, in bytes."""
    resident_bytes: int
    """The most host memory the engine's regions hold at once (page-rounded)."""
    swap_bytes: int
    """NVMe space for the regions that are evicted (page-rounded); 0 when host only."""
    state_bytes: tuple[int, ...] = ()
    """The page-rounded size of each sub-group's state block (what the NVMe window holds; with the
    gradient tier on NVMe, the block and its gradient accumulator together)."""
    nvme_path: str | None = None
    """Directory for the swap file (nvme)."""
    segment_bytes: int | None = None
    """Bytes per host pool segment of the embedded store (a region never spans two); None: one segment."""
    slot_bytes: int | None = None
    """Every region of the embedded store padded to this in its pool ([Note: one slot a region])."""
    grad_itemsize: int = 4
    """Bytes per element of the grad regions (fp32 4, bf16 2: ``data_types.grad_accum_dtype``)."""


@dataclasses.dataclass
class Tier:
    """An open tier: the store (TierStore or TierClient), what it is, and what to clean up."""

    store: Any
    description: str
    swap_dir: str | None = None
    daemon: bool = False
    registration: Any = None
    """``offload.gpu.HostRegistration`` of the store's segments (a GPU model), undone before the store closes."""

    @property
    def placement(self) -> str:
        """Where the tier keeps its bytes, for the one log line that says so: the daemon's socket and
        session, or the store and its swap files' directory."""
        return f"{self.description}, swap files in {self.swap_dir}" if self.swap_dir else self.description

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
            shutil.rmtree(self.swap_dir, ignore_errors=True)
            self.swap_dir = None


def open_tier(plan: TierPlan, *, daemon_socket: str | None, job_id: str, rank: int, aio: Any,
              host_memory_bytes: int | None, swap_capacity_bytes: int | None, checksum: bool,
              huge_pages: str = "auto") -> Tier:
    """Open the daemon session or the embedded store for ``plan`` (``huge_pages``: the embedded pool's,
    ``offload.huge_pages``)."""
    host_bytes = host_memory_bytes or plan.resident_bytes
    if plan.slot_bytes and not daemon_socket:  # whole slots ([Note: one slot a region])
        host_bytes = max(plan.resident_bytes, host_bytes // plan.slot_bytes * plan.slot_bytes)
    if host_bytes < plan.resident_bytes:
        raise ConfigError(f"offload.host_memory_bytes ({host_bytes}) is below the {plan.resident_bytes} bytes "
                          "the optimizer state needs in host memory at once; raise it or lower sub_group_size")
    if daemon_socket:
        from daemon import TierClient, TierClientConfig

        from offload.resume import session_fixed_bytes

        resident = align_up(host_bytes + session_fixed_bytes(plan), PAGE)
        client = TierClient(TierClientConfig(socket_path=daemon_socket, job_id=job_id, rank=rank, quota_bytes=resident))
        packed = packed_quota_bytes(resident, max(plan.region_bytes, default=0), client.segment_bytes)
        if packed > client.quota_bytes and not client.reattached:
            client.close()  # [Note: quota in segments]: ask again for one that packs
            client = TierClient(TierClientConfig(socket_path=daemon_socket, job_id=job_id, rank=rank,
                                                 quota_bytes=packed))
        return Tier(client, f"daemon {daemon_socket} (job {job_id!r}, rank {rank})", daemon=True)
    config = TierStoreConfig(checksum="crc32c" if checksum else "none")
    if not plan.nvme:
        store = TierStore.create(host_capacity_bytes=align_up(host_bytes, PAGE), swap_paths=[],
                                 swap_capacity_bytes=0, segment_bytes=plan.segment_bytes, config=config,
                                 slot_bytes=plan.slot_bytes, huge_pages=huge_pages)
        return Tier(store, "embedded TierStore (host memory)")
    swap_bytes = swap_capacity_bytes or plan.swap_bytes
    if swap_bytes < plan.swap_bytes:
        raise ConfigError(f"offload.swap_capacity_bytes ({swap_bytes}) is below the {plan.swap_bytes} bytes "
                          "of optimizer state to place on NVMe")
    swap_dir = tempfile.mkdtemp(prefix=f"offload-rank{rank}-", dir=plan.nvme_path)
    try:
        engine_config = IoEngineConfig(block_size_bytes=aio.block_size, queue_depth=aio.queue_depth,
                                       num_threads=aio.intra_op_parallelism, probe_paths=(swap_dir,))
        store = TierStore.create(host_capacity_bytes=align_up(host_bytes, PAGE), swap_paths=[swap_dir],
                                 swap_capacity_bytes=align_up(swap_bytes, PAGE), engine_config=engine_config,
                                 segment_bytes=plan.segment_bytes, config=config,
                                 slot_bytes=plan.slot_bytes, huge_pages=huge_pages)
    except BaseException:
        shutil.rmtree(swap_dir, ignore_errors=True)
        raise
    return Tier(store, f"embedded TierStore ({store.engine.name}, swap in {plan.nvme_path})", swap_dir)


def packed_quota_bytes(resident_bytes: int, largest_region_bytes: int, segment_bytes: int) -> int:
    """[Note: quota in segments] The daemon lends a session whole segments, and a region never spans
    two, so the resident bytes alone can leave a region without a run long enough (1 MiB grads and
    3 MiB state blocks in 4 MiB segments: every segment keeps a hole too short for a block). With
    room for one more region in every segment, a region finds a place whenever the bytes held are
    within the quota: each segment where it does not fit has more than ``segment - largest`` in use.
    So: ``ceil(resident / (segment - largest))`` segments (the resident bytes when regions are small)."""
    usable = segment_bytes - largest_region_bytes
    if segment_bytes <= 0 or usable <= 0:
        return resident_bytes  # a region longer than a segment is the daemon's error to give
    return -(-resident_bytes // usable) * segment_bytes


def plan_bytes(numels: list[int], *, window: int, nvme: bool, nvme_path: str | None,
               state_bytes: list[int] | None = None, grads_nvme: bool = False, grad_itemsize: int = 4) -> TierPlan:
    """The plan for sub-groups of ``numels`` elements: an fp32 grad region (resident) and a state
    block per sub-group, fp32 three times that unless ``state_bytes`` gives each block's size
    (``offload.state_dtype``, ``offload.zero.state_format``); with nvme only ``window`` blocks are held.
    ``grad_itemsize``: 2 for bf16 accumulators.
    ``grads_nvme`` (``offload.gradient_tier``, [Note: gradient tier] in offload.zero.grad_tier): the grad
    regions go to NVMe too, ``window`` of them held. Then every region takes a slot of the largest one's
    size in the embedded pool ([Note: one slot a region]) and a place in the window is two slots (the
    plan's ``state_bytes`` are what one place holds)."""
    grads = [grad_itemsize * n for n in numels]
    states = list(state_bytes) if state_bytes is not None else [12 * n for n in numels]
    if grads_nvme and not nvme:
        raise ValueError("grads_nvme needs nvme")
    if grads_nvme:
        slot = max((align_up(b, PAGE) for b in grads + states), default=PAGE)
        per_item = [2 * slot for _ in numels]
        swap = sum(align_up(b, PAGE) for b in grads + states)
        return TierPlan(nvme=nvme, region_bytes=tuple(grads + states), resident_bytes=window * 2 * slot,
                        swap_bytes=swap, nvme_path=nvme_path, state_bytes=tuple(per_item), slot_bytes=slot,
                        grad_itemsize=grad_itemsize)
    per_item = [align_up(s, PAGE) for s in states]
    resident = sum(align_up(g, PAGE) for g in grads)
    if nvme:
        resident += sum(sorted(per_item, reverse=True)[:window])
    else:
        resident += sum(per_item)
    swap = sum(per_item) if nvme else 0
    return TierPlan(nvme=nvme, region_bytes=tuple(grads + states), resident_bytes=resident, swap_bytes=swap,
                    nvme_path=nvme_path, state_bytes=tuple(per_item), grad_itemsize=grad_itemsize)


# [Note: one slot a region]
# With the gradient tier on NVMe the window moves regions of two sizes (state blocks and gradient
# accumulators), and a first-fit pool sized to their sum fragments: the 5.03B GPT's first step failed
# with 16 MiB free in the pool but no run that long. So every region of the embedded pool is padded
# to one slot, the largest region's size, and a place in the window is two slots: blocks of one size
# leave holes any other fits, so with at most 2 x window regions held every allocation finds room
# (the cost: with int8 states, a 24 MiB block and a 16 MiB accumulator take 48 MiB a place, not 40).
# (Segments of one region each did the same, but hundreds of them overflow io_uring's table of
# registered buffers.)
