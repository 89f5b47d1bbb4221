"""What a tier is asked for: its regions' bytes, what it holds in host memory at once and on NVMe.

``plan_bytes`` lays out the optimizer state's regions (a gradient accumulator and a state block per
sub-group) for a window of state blocks in host memory; stage 3's param shards have a plan of their
own (``offload.plan.memory.plan_params``). ``packed_quota_bytes`` is what a daemon session must be
lent for its regions to pack into whole segments ([Note: quota in segments]).
"""
from __future__ import annotations

import dataclasses

from swap import align_up

__all__ = ["PAGE", "TierPlan", "packed_quota_bytes", "plan_bytes"]

PAGE = 4096


@dataclasses.dataclass(frozen=True, kw_only=True)
class TierPlan:
    """What the engine asks of its tier: sizes derived from the layout, and where to put files."""

    nvme: bool
    """Swap space on NVMe (offload_optimizer nvme, or cpu with the gradient tier on NVMe) or host only (cpu)."""
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
    host_capacity_bytes: int = 0
    """The embedded store's pool (``offload.host_memory_bytes`` in whole slots, at least the resident
    bytes; through a daemon, the session's bytes beside ``session_fixed_bytes``); 0: ``resident_bytes``."""
    swap_capacity_bytes: int = 0
    """The embedded store's swap space (``offload.swap_capacity_bytes``, at least ``swap_bytes``); 0: ``swap_bytes``."""
    session_fixed_bytes: int = 0
    """What a daemon session holds besides the regions: the commit region and the undo log
    (``offload.plan.memory.session_fixed_bytes``); an embedded store has no such thing."""

    def session_bytes(self) -> int:
        """The quota a daemon session of this plan asks for first: its host bytes and its fixed ones."""
        return align_up((self.host_capacity_bytes or self.resident_bytes) + self.session_fixed_bytes, PAGE)

    def quota_bytes(self, segment_bytes: int) -> int:
        """``session_bytes`` packed in a daemon's ``segment_bytes`` segments ([Note: quota in segments])."""
        return packed_quota_bytes(self.session_bytes(), max(self.region_bytes, default=0), segment_bytes)


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
    if grads_nvme and not nvme:  # [Note: accumulators alone on NVMe]
        slot = align_up(max(grads, default=PAGE), PAGE)
        per_item = [align_up(b, PAGE) for b in states]
        return TierPlan(nvme=True, region_bytes=tuple([slot] * len(grads) + states),
                        resident_bytes=sum(per_item) + window * slot, swap_bytes=len(grads) * slot,
                        nvme_path=nvme_path, state_bytes=tuple(per_item), grad_itemsize=grad_itemsize)
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


# [Note: accumulators alone on NVMe]
# Stage 3 with offload_optimizer cpu and offload.gradient_tier nvme: the state blocks stay in host memory
# for good, and only the gradient accumulators go to NVMe, a window of them held (the largest models a
# node trains are bound by host memory: at 30B, bf16 master and int8 moments take 114 GiB, bf16
# accumulators 57 more). Every accumulator is given the largest one's size, page-rounded: the state
# blocks are allocated once and never freed, so the only regions that come and go are of one size, and
# the pool (the blocks and ``window`` such slots) never holds a hole too short for the next one.

# [Note: one slot a region]
# With the gradient tier on NVMe the window moves regions of two sizes (state blocks and gradient
# accumulators), and a first-fit pool sized to their sum fragments: the 5.03B GPT's first step failed
# with 16 MiB free in the pool but no run that long. So every region of the embedded pool is padded
# to one slot, the largest region's size, and a place in the window is two slots: blocks of one size
# leave holes any other fits, so with at most 2 x window regions held every allocation finds room
# (the cost: with int8 states, a 24 MiB block and a 16 MiB accumulator take 48 MiB a place, not 40).
# (Segments of one region each did the same, but hundreds of them overflow io_uring's table of
# registered buffers.)
