"""Which sub-groups keep their optimizer state on the model's device (``offload_optimizer.ratio``).

[Note: GPU-resident share] DeepSpeed's ``offload_optimizer.ratio`` (its "Twin-Flow") offloads that share
of the optimizer state and keeps the rest on the GPU, stepped there. Which rest matters for the schedule:
sub-groups are cut in bucket order and buckets in the order backward produces them ([Note: flat layout]),
so the *last* sub-groups hold the first layers, the ones the next forward needs first and the ones whose
gradients backward produces last. Those stay on the device:
- their gradients land from the GPU's bucket into device accumulators (no copy to the host and back),
  their sum of squares is kept on the device and read once, at the step (no wait per bucket);
- at the step they are stepped first, by torch's fused AdamW, enqueued on the compute stream in a few
  calls; the host goes straight on to the CPU's share, whose params go back as each sub-group is done
  ([Note: publish as stepped] in offload.zero.optimizer), so the GPU's Adam runs under the CPU's;
- the CPU's share, the early sub-groups, is the one whose gradients are complete first, so the overlapped
  step ([Note: overlapped step] in offload.zero.overlap) steps it under backward, as before.
Exact: each sub-group is stepped once, by the one Adam its placement names, with the multiplier and
plan every other sub-group gets; the split with the overlapped step is bit for bit the split without.
The device's Adam is torch's and the host's ours: the two agree to rounding, not bit for bit, so a split
is compared with the same split.

The share is counted in elements: the last sub-groups whose elements come nearest ``1 - ratio`` of the
partition. ``"auto"`` takes what the device has free once the model, its flat buffers and the
optimizer's own device buffers are in place, less a reserve for activations and the allocator
(``AUTO_RESERVE_FRACTION`` of the device's memory): each element kept costs 16 bytes there (fp32 master
and moments, and its fp32 accumulator). On a CPU model nothing is kept: host and "device" are one memory,
and the offloaded path's own Adam is the faster.

At stage 3 (DeepSpeed's only place for the key) the kept share writes its params into their shards
(``params_out``; a copy to the host with ``offload_param`` cpu), and its units' gradients land from the
device; the accumulators stay off NVMe (``gradient_tier`` "auto" keeps them in host memory). Not supported
(``offload.config.combos``): ``gradient_tier`` "nvme", the delayed update, compressed states or masters,
and a node daemon (the device's share would not outlive the process for a restart to resume).
"""
from __future__ import annotations

import logging

import torch

from offload.zero.layout import FlatLayout

logger = logging.getLogger(__name__)

__all__ = ["AUTO_RESERVE_FRACTION", "WITH_DAEMON", "DEVICE_BYTES_PER_ELEMENT", "auto_ratio", "device_buckets", "device_share",
           "device_sub_groups"]

DEVICE_BYTES_PER_ELEMENT = 16
"""A device-resident element: fp32 master, exp_avg, exp_avg_sq and its fp32 gradient accumulator."""

WITH_DAEMON = ("zero_optimization.offload_optimizer.ratio below 1 is not supported with a node daemon (its socket "
               "is set): the device's share of the state would not outlive this process, and a restart could not "
               "resume it")

AUTO_RESERVE_FRACTION = 0.5
"""``ratio: "auto"`` leaves this share of the device's total memory free (activations, the allocator)."""


def device_sub_groups(layout: FlatLayout, ratio: float) -> frozenset[int]:
    """The sub-groups kept on the device for ``ratio`` (the share offloaded): the last ones, their elements
    nearest ``(1 - ratio)`` of the partition (ties keep fewer)."""
    target = (1.0 - ratio) * layout.partition_numel
    best, best_gap, kept = 0, target, 0
    for k, sg in enumerate(reversed(layout.sub_groups), start=1):
        kept += sg.numel
        gap = abs(kept - target)
        if gap < best_gap:
            best, best_gap = k, gap
    n = len(layout.sub_groups)
    return frozenset(range(n - best, n))


def device_buckets(layout: FlatLayout, on_device: frozenset[int]) -> frozenset[int]:
    """The buckets whose every piece in this rank's partition is in a device-resident sub-group: their
    gradients land from the device's buffer, not through the host."""
    pieces: dict[int, list[bool]] = {}
    for sg in layout.sub_groups:
        for p in sg.pieces:
            pieces.setdefault(p.bucket, []).append(sg.index in on_device)
    return frozenset(b for b, flags in pieces.items() if all(flags))


def auto_ratio(layout: FlatLayout, device: torch.device, *, free_bytes: int | None = None,
               total_bytes: int | None = None) -> float:
    """``ratio: "auto"``: the share offloaded so that the device's share fits in what it has free, less
    ``AUTO_RESERVE_FRACTION`` of its memory ([Note: GPU-resident share]). ``free_bytes``/``total_bytes``:
    the device's now (``torch.cuda.mem_get_info``) unless given. 1.0 on a CPU model."""
    if device.type != "cuda":
        logger.info("offload_optimizer.ratio auto: 1.0 (the model computes on the CPU: nothing to keep on a device)")
        return 1.0
    if free_bytes is None or total_bytes is None:
        free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    room = max(0, free_bytes - int(AUTO_RESERVE_FRACTION * total_bytes))
    numel = layout.partition_numel
    ratio = 1.0 - min(1.0, room / DEVICE_BYTES_PER_ELEMENT / numel) if numel else 1.0
    logger.info("offload_optimizer.ratio auto: %.3f (%.2f GB of the device's %.2f GB free kept for its share of the "
                "optimizer, %.0f%% of the device left for activations)", ratio, room / 1e9, free_bytes / 1e9,
                100 * AUTO_RESERVE_FRACTION)
    return ratio


def device_share(ratio: float | str, layout: FlatLayout, device: torch.device, *, rank: int = 0) -> frozenset[int]:
    """The sub-groups ``offload_optimizer.ratio`` keeps on the model's ``device``; ``"auto"`` is sized from the
    device's free memory now (``auto_ratio``)."""
    share = auto_ratio(layout, device) if ratio == "auto" else float(ratio)
    kept = device_sub_groups(layout, share)
    if kept:
        numel = sum(layout.sub_groups[i].numel for i in kept)
        logger.info("rank %d: offload_optimizer.ratio %s: %d of %d sub-groups (%.1f%% of the partition, %.2f GB) kept "
                    "on %s and stepped there", rank, ratio, len(kept), len(layout.sub_groups),
                    100 * numel / layout.partition_numel, numel * DEVICE_BYTES_PER_ELEMENT / 1e9, device)
    return kept
