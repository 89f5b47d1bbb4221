"""The memory plan: every region a rank's tiers allocate, its bytes and where it lives.

[Note: memory plan] One module decides how many bytes go where, and both the engine and
``offload estimate`` read its answer, so they cannot drift apart:

- the layout: sub-groups capped at ``OFFLOAD_SUB_GROUP_CAP`` elements when offloaded, buckets no
  larger than a sub-group under the overlapped step (``flat_layout``, which the builder and stage 3
  build their ``FlatLayout`` with, and the estimate too);
- the optimizer's tier (``plan_optimizer``): a gradient accumulator and a state block per sub-group
  (``offload.plan.tier_plan.plan_bytes``, the blocks' bytes from ``offload.zero.state_format``), how
  many blocks the host holds at once with nvme (the window: as many of the largest as the budget
  holds, never fewer than ``buffer_count``), whether stage 3's accumulators go to NVMe
  (``offload.gradient_tier``), the embedded pool's capacity and swap space, and what a daemon
  session holds besides (the commit region, the undo log and, for compressed states, the undo copy
  of the largest block);
- stage 3's param tier (``plan_params``): the compute-dtype shards, all in host memory (cpu) or
  ``buffer_count`` segments of the largest shard (nvme).

The budget the window and "auto" choices are judged against is ``offload.host_memory_bytes``, else
1/FREE_SHARE of the memory available now (``offload.plan.budget``), else, through a daemon, the rank's
share of the daemon's pool as its STATUS gave it (``offload.plan.daemon_pool``); a daemon whose pool
cannot be read gets the window's floor. The builder opens its tiers from these plans
(``offload.tiers.open_tier``); the estimate lists their regions (``OptimizerPlan.regions``).
"""
from __future__ import annotations

import dataclasses
import enum
import logging
from typing import Any, Sequence

from csrc import ConfigError
from offload.plan.budget import budget_bytes, window_size
from offload.plan.daemon_pool import POOL_ERRORS, POOL_SHARE, DaemonPool, local_ranks_here, read_pool, reattached_window
from offload.plan.tier_plan import PAGE, TierPlan, plan_bytes
from offload.zero.grad_tier import gradients_on_nvme
from offload.zero.layout import FlatLayout, SubGroup
from offload.zero.state_format import StateFormat
from offload.checkpoint.resume import COMMIT_BYTES, undo_slots
from swap import align_up
from swap.space import DEFAULT_STRIPE_BYTES

logger = logging.getLogger(__name__)

__all__ = ["COMMIT_PART", "GRADS_ON_NVME_PART", "OFFLOAD_SUB_GROUP_CAP", "UNDO_COPY_PART", "UNDO_LOG_PART",
           "WINDOW_PART", "OptimizerPlan", "OptimizerSettings", "Place", "Region", "engine_optimizer_plan",
           "flat_layout", "plan_optimizer", "plan_params", "session_fixed_bytes", "sub_group_numel"]

OFFLOAD_SUB_GROUP_CAP = 1 << 22
"""Offloaded sub-groups hold at most this many elements, whatever ``sub_group_size`` says ([Note: sub-group cap])."""

# [Note: sub-group cap] A state block is 12 bytes per element and moves as one region, so
# an offloaded sub-group is capped at 4 Mi elements (48 MiB): NVMe I/O of one block then
# overlaps the step of another, and every block fits a daemon segment. DeepSpeed's default
# sub_group_size (1e9) would otherwise make the whole partition one unpipelined block.

GRADS_ON_NVME_PART = "fp32 gradient accumulators (offload.gradient_tier nvme)"
WINDOW_PART = "state window (host budget, buffer_count at least)"
COMMIT_PART = "commit region (daemon)"
UNDO_LOG_PART = "undo log (daemon)"
UNDO_COPY_PART = "undo copy of the largest state block (daemon)"

class Place(enum.StrEnum):
    """Where a region of the plan lives, and who owns that memory."""

    DEVICE = "device"  # the model's device (a GPU's memory; the CPU's own without one): torch's allocator
    HOST = "host"  # host memory: the embedded store's pool, or the daemon session's segments
    NVME = "nvme"  # the swap files under nvme_path (the daemon's own swap paths through a daemon)
    DAEMON = "daemon"  # host memory a node daemon's session holds; none without one
    RESERVED = "reserved"  # address space of the embedded pool that nothing touches: no memory until it is


HOST, NVME, DAEMON, RESERVED = Place.HOST, Place.NVME, Place.DAEMON, Place.RESERVED


@dataclasses.dataclass(frozen=True)
class Region:
    """One line of the plan: what, where, how many bytes."""

    what: str
    where: Place
    nbytes: int


def sub_group_numel(sub_group_size: int, *, offloaded: bool) -> int:
    """Elements per optimizer sub-group: ``zero_optimization.sub_group_size``, capped when offloaded."""
    return min(sub_group_size, OFFLOAD_SUB_GROUP_CAP) if offloaded else sub_group_size


def flat_layout(params: Sequence[tuple[str, tuple[int, ...], int]], *, stage: int, reduce_bucket_size: int,
                world_size: int, rank: int, sub: int, overlap: bool = False,
                bucket_plan: Sequence[Sequence[int]] | None = None) -> FlatLayout:
    """The rank's ``FlatLayout`` as the engine cuts it: ``params`` (name, shape, param group) in registration
    order, sub-groups of ``sub`` elements (``sub_group_numel``), buckets of ``reduce_bucket_size`` (no larger
    than a sub-group under the overlapped step); ``bucket_plan``: stage 3's units
    (``offload.zero.units.plan_units``), one bucket each."""
    if bucket_plan is not None:
        return FlatLayout(params, world_size=world_size, rank=rank, bucket_numel=reduce_bucket_size,
                          sub_group_numel=sub, bucket_plan=bucket_plan)
    shard = stage >= 1 and world_size > 1
    bucket = min(reduce_bucket_size, sub) if overlap else reduce_bucket_size  # [Note: overlapped step]
    return FlatLayout(params, world_size=world_size if shard else 1, rank=rank if shard else 0, bucket_numel=bucket,
                      sub_group_numel=sub)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerSettings:
    """What the optimizer tier's plan reads of the config (``from_config``)."""

    device: str
    """offload_optimizer.device: "none", "cpu" or "nvme"."""
    stage: int = 2
    """zero_optimization.stage (the gradient tier is stage 3's)."""
    nvme_path: str | None = None
    """offload_optimizer.nvme_path."""
    buffer_count: int = 4
    """offload_optimizer.buffer_count: the window's floor."""
    state_dtype: str = "fp32"
    """offload.state_dtype."""
    master_dtype: str = "fp32"
    """offload.master_dtype."""
    grad_accum_dtype: str = "fp32"
    """data_types.grad_accum_dtype: the accumulators' dtype."""
    gradient_tier: str = "auto"
    """offload.gradient_tier."""
    host_memory_bytes: int | None = None
    """offload.host_memory_bytes: the budget, and the embedded pool's capacity."""
    swap_capacity_bytes: int | None = None
    """offload.swap_capacity_bytes: the embedded swap space (None: what the plan needs)."""
    daemon: bool = False
    """A node daemon serves the session (``offload.daemon_socket`` or OFFLOAD_DAEMON_SOCKET)."""

    @classmethod
    def from_config(cls, cfg: Any) -> "OptimizerSettings":
        """From an ``EngineConfig``."""
        from offload.config import resolve_daemon_socket

        z, off = cfg.zero, cfg.offload
        return cls(device=z.offload_optimizer.device.value, stage=z.stage, nvme_path=z.offload_optimizer.nvme_path,
                   buffer_count=z.offload_optimizer.buffer_count, state_dtype=off.state_dtype,
                   master_dtype=off.master_dtype, grad_accum_dtype=cfg.data_types.grad_accum_dtype,
                   gradient_tier=off.gradient_tier, host_memory_bytes=off.host_memory_bytes,
                   swap_capacity_bytes=off.swap_capacity_bytes, daemon=bool(resolve_daemon_socket(off)))

    @property
    def nvme(self) -> bool:
        return self.device == NVME

    @property
    def grad_itemsize(self) -> int:
        return 2 if self.grad_accum_dtype == "bf16" else 4

    @property
    def compressed(self) -> bool:
        return self.state_dtype != "fp32"

    @property
    def through_pool(self) -> bool:
        """The budget is the daemon's pool: a daemon without ``host_memory_bytes``."""
        return self.daemon and self.host_memory_bytes is None


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerPlan:
    """The optimizer state's tier: its regions (``tier``), the window, and the gradient tier's choice."""

    settings: OptimizerSettings
    tier: TierPlan
    """The regions and sizes ``offload.tiers.open_tier`` opens (host capacity, swap, a session's extra)."""
    window: int
    """State blocks (with the gradient tier on NVMe, places of a block and its accumulator) held in host
    memory at once; ``buffer_count`` with the state in host memory (cpu), where it is not used."""
    grads_nvme: bool
    """``offload.gradient_tier`` resolved: stage 3's accumulators on NVMe."""
    floor: int
    """The least window: ``buffer_count``, or with the gradient tier on NVMe the sub-groups one bucket
    lands into, plus one."""
    fixed_bytes: int
    """What the tier holds in host memory whatever the window (nvme): the resident accumulators."""

    def regions(self) -> list[Region]:
        """What the tier holds where, for ``offload estimate``: the host side adds up to what the store is
        created with (the embedded pool's capacity; a daemon session's bytes beside its fixed ones)."""
        s, tier = self.settings, self.tier
        half = len(tier.region_bytes) // 2  # the grad regions, then the state blocks (plan_bytes)
        grads = sum(align_up(b, PAGE) for b in tier.region_bytes[:half])
        states = sum(align_up(b, PAGE) for b in tier.region_bytes[half:])
        what = f"{s.master_dtype} master + moments" + ("" if not s.compressed else f" ({s.state_dtype})")
        accumulators = f"{s.grad_accum_dtype} gradient accumulators"
        if not s.nvme and self.grads_nvme:  # [Note: accumulators alone on NVMe] in offload.plan.tier_plan
            out = [Region(GRADS_ON_NVME_PART.replace("fp32", s.grad_accum_dtype), NVME, tier.swap_bytes),
                   Region(what, HOST, states),
                   Region(f"{s.grad_accum_dtype} gradient accumulators' window ({self.window} held)", HOST,
                          tier.resident_bytes - states)]
        elif not s.nvme:
            out = [Region(accumulators, HOST, grads), Region(what, HOST, states)]
        elif self.grads_nvme:
            out = [Region(GRADS_ON_NVME_PART.replace("fp32", s.grad_accum_dtype), NVME, grads), Region(what, NVME, states),
                   Region(WINDOW_PART + ", with the gradient accumulators", HOST, tier.resident_bytes)]
        else:
            out = [Region(accumulators, HOST, grads), Region(WINDOW_PART, HOST, tier.resident_bytes - grads),
                   Region(what, NVME, states)]
        if tier.host_capacity_bytes > tier.resident_bytes:
            out.append(Region("rest of the pool (offload.host_memory_bytes; its pages untouched)", RESERVED,
                              tier.host_capacity_bytes - tier.resident_bytes))
        if tier.swap_capacity_bytes > tier.swap_bytes:
            out.append(Region("rest of the swap file (whole stripes; offload.swap_capacity_bytes)", NVME,
                              tier.swap_capacity_bytes - tier.swap_bytes))
        where = HOST if s.daemon else DAEMON  # [Note: memory plan]: counted in a daemon's sizes either way
        out.append(Region(COMMIT_PART, where, COMMIT_BYTES))
        out.append(Region(UNDO_COPY_PART if s.compressed else UNDO_LOG_PART, where, tier.session_fixed_bytes - COMMIT_BYTES))
        return out

    def check(self) -> None:
        """The configured capacities hold what the plan needs, or an error that names the setting."""
        tier = self.tier
        if tier.host_capacity_bytes < tier.resident_bytes:
            raise ConfigError(f"offload.host_memory_bytes ({self.settings.host_memory_bytes}) is below the "
                              f"{tier.resident_bytes} bytes the optimizer state needs in host memory at once; raise it "
                              "or lower sub_group_size")
        swap = self.settings.swap_capacity_bytes  # as configured: the file is then rounded up to whole stripes
        if tier.nvme and not self.settings.daemon and swap is not None and swap < tier.swap_bytes:
            raise ConfigError(f"offload.swap_capacity_bytes ({self.settings.swap_capacity_bytes}) is below the "
                              f"{tier.swap_bytes} bytes of optimizer state to place on NVMe")

    def reattached_window(self, store: Any) -> int:
        """The window of a reattached daemon session: what the quota it was opened with holds."""
        return reattached_window(store, self.tier.state_bytes, self.window, floor=self.floor,
                                 fixed_bytes=self.fixed_bytes + self.tier.session_fixed_bytes,
                                 largest_region_bytes=max(self.tier.region_bytes, default=0))


def session_fixed_bytes(tier: TierPlan, *, compressed: bool, max_elems: int) -> int:
    """What a daemon session holds besides the optimizer state's regions, page-aligned: the commit region, and
    the undo log for sub-groups of up to ``max_elems`` elements, or with compressed states in its place the undo
    copy of the largest block ([Note: block undo] in offload.zero.block_undo; ``offload.checkpoint.resume.open_undo``)."""
    return COMMIT_BYTES + _undo_bytes(tier, compressed=compressed, max_elems=max_elems)


def _undo_bytes(tier: TierPlan, *, compressed: bool, max_elems: int) -> int:
    if compressed:
        from offload.zero.block_undo import block_undo_bytes

        states = tier.region_bytes[len(tier.region_bytes) // 2:]  # the grad regions, then the state blocks
        return align_up(block_undo_bytes(max(states, default=0)), PAGE)
    from cpu_adam.undo import undo_bytes

    return align_up(undo_bytes(undo_slots(), max_elems), PAGE)


def _floor(sgs: Sequence[SubGroup], buffer_count: int, grads_nvme: bool) -> int:
    floor = buffer_count
    if grads_nvme:  # a bucket's pieces land in one pass, so all its sub-groups' accumulators are in at once
        spans: dict[int, set[int]] = {}
        for sg in sgs:
            for piece in sg.pieces:
                spans.setdefault(piece.bucket, set()).add(sg.index)
        floor = max(floor, 1 + max((len(s) for s in spans.values()), default=1))
    return floor


def _tier(sgs: Sequence[SubGroup], s: OptimizerSettings, *, window: int, grads_nvme: bool) -> TierPlan:
    fmt = StateFormat(s.state_dtype, s.master_dtype)
    plan = plan_bytes([sg.numel for sg in sgs], window=window, nvme=s.nvme,
                      nvme_path=s.nvme_path if s.nvme or grads_nvme else None, grads_nvme=grads_nvme, grad_itemsize=s.grad_itemsize,
                      state_bytes=[fmt.state_bytes(sg) for sg in sgs])
    return dataclasses.replace(plan, session_fixed_bytes=session_fixed_bytes(
        plan, compressed=s.compressed, max_elems=max((sg.numel for sg in sgs), default=0)))


def plan_optimizer(layout: FlatLayout, settings: OptimizerSettings, *, pool: DaemonPool | None = None,
                   local_ranks: int = 1, log: bool = True, available: int | None = None,
                   on_device: frozenset[int] = frozenset()) -> OptimizerPlan:
    """The optimizer tier's plan for ``layout`` (offloaded: ``settings.device`` cpu or nvme). ``pool``: the
    daemon's, where ``settings.through_pool`` (None: it could not be read, and the window takes its floor);
    ``local_ranks``: the job's ranks on the node, sharing the pool or the memory available; ``available``:
    the host memory available in bytes (None: this machine's now; ``offload estimate --host-gib`` gives
    the machine's it asks about); ``on_device``: sub-groups kept on the model's device, not the tier's
    ([Note: GPU-resident share] in offload.zero.device_share)."""
    s = settings
    sgs = [sg for sg in layout.sub_groups if sg.index not in on_device]
    if s.device not in ("cpu", NVME):
        raise ConfigError(f"the optimizer's tier is planned for offload_optimizer.device cpu or nvme, got {s.device!r}")
    numel = sum(sg.numel for sg in sgs)

    def budget() -> tuple[int | None, str]:  # asked only where gradient_tier "auto" has to judge
        if not s.through_pool:
            return budget_bytes(s.host_memory_bytes, available=available, local_ranks=local_ranks)
        if pool is None:
            return None, "nothing (the daemon's pool could not be read)"
        return pool.rank_budget_bytes(local_ranks), f"1/{POOL_SHARE} of the daemon's pool"

    grads_nvme = s.stage == 3 and not on_device and gradients_on_nvme(  # [Note: gradient tier] in offload.zero.grad_tier
        s.gradient_tier, stage=s.stage, optimizer_nvme=s.nvme, partition_numel=numel, budget=budget, log=log,
        host_memory_bytes=s.host_memory_bytes, grad_itemsize=s.grad_itemsize)
    floor = _floor(sgs, s.buffer_count, grads_nvme)
    window, fixed = s.buffer_count, 0
    if s.nvme:
        bare = _tier(sgs, s, window=0, grads_nvme=grads_nvme)
        fixed = bare.resident_bytes  # what stays resident with no block held: the accumulators (none on NVMe)
        if s.through_pool and pool is not None:
            window, got = pool.window(bare.state_bytes, floor=floor, local_ranks=local_ranks,
                                      fixed_bytes=fixed + bare.session_fixed_bytes,
                                      largest_region_bytes=max(bare.region_bytes, default=0))
            if log:
                logger.info("optimizer state window: %d of %d blocks in host memory (buffer_count %d; budget %.2f GB: "
                            "1/%d of the daemon's %s, over %d ranks)", min(window, len(bare.state_bytes)),
                            len(bare.state_bytes), floor, got / 1e9, POOL_SHARE, pool.describe(), local_ranks)
        elif s.through_pool:
            window = floor
            if log:
                logger.info("optimizer state window: %d (buffer_count; the daemon's pool could not be read)", floor)
        else:
            window = window_size(bare.state_bytes, floor=floor, fixed_bytes=fixed,
                                 host_memory_bytes=s.host_memory_bytes, what="optimizer state", log=log,
                                 available=available, local_ranks=local_ranks)
    elif grads_nvme:  # the state in host memory, the accumulators' window its least ([Note: accumulators alone on NVMe])
        window = floor
    tier = _tier(sgs, s, window=window, grads_nvme=grads_nvme)
    return OptimizerPlan(settings=s, tier=_sized(tier, s), window=window, grads_nvme=grads_nvme, floor=floor,
                         fixed_bytes=fixed)


def engine_optimizer_plan(cfg: Any, layout: FlatLayout, *, log: bool = True,
                          on_device: frozenset[int] = frozenset()) -> OptimizerPlan:
    """The plan the builder opens the optimizer's tier from: ``plan_optimizer`` for an ``EngineConfig``,
    the daemon's pool read (STATUS) where it is the budget, over LOCAL_WORLD_SIZE ranks."""
    from offload.config import resolve_daemon_socket

    settings = OptimizerSettings.from_config(cfg)
    pool = None
    if settings.through_pool and settings.nvme:
        try:
            pool = read_pool(resolve_daemon_socket(cfg.offload))
        except POOL_ERRORS as exc:
            logger.info("the daemon's pool could not be read (%s): the window takes buffer_count", exc)
    plan = plan_optimizer(layout, settings, pool=pool, local_ranks=local_ranks_here(), log=log, on_device=on_device)
    plan.check()
    return plan


def _sized(tier: TierPlan, s: OptimizerSettings) -> TierPlan:
    """The host and swap capacities the tier is opened with: ``host_memory_bytes`` (whole slots in the
    embedded pool, [Note: one slot a region]) or the resident bytes; ``swap_capacity_bytes`` or the swap
    the state needs (either below what the plan needs: ``OptimizerPlan.check``)."""
    host = s.host_memory_bytes or tier.resident_bytes
    if tier.slot_bytes and not s.daemon:
        host = max(tier.resident_bytes, host // tier.slot_bytes * tier.slot_bytes)
    swap = 0
    if tier.nvme and not s.daemon:
        swap = align_up(s.swap_capacity_bytes or tier.swap_bytes, DEFAULT_STRIPE_BYTES)  # one swap file
    return dataclasses.replace(tier, host_capacity_bytes=align_up(host, PAGE), swap_capacity_bytes=swap)


def plan_params(layout: FlatLayout, itemsize: int, *, device: str, buffer_count: int,
                nvme_path: str | None) -> TierPlan:
    """Stage 3's param tier: the compute-dtype shards (``itemsize`` bytes an element), all in host memory
    (cpu), or (nvme) ``max(3, buffer_count)`` segments each as large as the largest shard, sized from the
    layout so no unit is too large for it. One segment per shard held: shards of mixed sizes come and go,
    and a run of free bytes large enough could otherwise be missing though the bytes are there."""
    sizes = sorted((align_up(b.shard_numel * itemsize, PAGE) for b in layout.buckets), reverse=True)
    nvme = device == NVME
    resident = max(3, buffer_count) * sizes[0] if nvme else sum(sizes)
    return TierPlan(nvme=nvme, region_bytes=tuple(sizes), resident_bytes=resident,
                    swap_bytes=sum(sizes) if nvme else 0, nvme_path=nvme_path, segment_bytes=sizes[0] if nvme else None,
                    host_capacity_bytes=resident,
                    swap_capacity_bytes=align_up(sum(sizes), DEFAULT_STRIPE_BYTES) if nvme else 0)
