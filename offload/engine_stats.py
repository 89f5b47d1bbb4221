"""What an engine's tiers did: the record ``Engine.offload_stats()`` returns."""
from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["EngineStats", "stats_of"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineStats:
    """What the tiers did, for progress bars and summaries."""

    optimizer_device: str
    """"none", "cpu" or "nvme"."""
    tier: str
    """Which tier holds the state (the embedded store and its engine, or the daemon)."""
    state_bytes_by_tier: dict[str, int]
    """Bytes of master + moments (at their state and master dtypes) per tier now: "device", "host", "nvme"."""
    bytes_read_total: int
    """NVMe -> host bytes of this engine's tier."""
    bytes_written_total: int
    """Host -> NVMe bytes."""
    io_wait_seconds_total: float
    """Time ``step`` spent waiting on tier I/O."""
    step_seconds_total: float
    """Time spent in optimizer steps."""
    optimizer_steps: int
    """Steps taken (overflow-skipped steps not counted)."""
    skipped_steps: int
    """Steps skipped for a non-finite gradient."""
    step_seconds_under_backward_total: float = 0.0
    """Optimizer step time (wall time of its thread) that ran while backward still ran
    (offload.overlap_step); the time after backward is ``step_seconds_total``."""
    overlap_rollbacks: int = 0
    """Steps whose sub-groups stepped under backward were undone (clipping, overflow)."""
    sub_groups_stepped_early_total: int = 0
    """Sub-groups stepped under backward and kept (offload.overlap_step): over ``optimizer_steps`` x the
    sub-group count, the share of the CPU Adam the GPU's backward hid."""
    sub_groups_stepped_under_forward_total: int = 0
    """Sub-groups stepped under the next forward (offload.step_under_forward): handed to the worker as
    ``engine.step()`` returned."""
    forward_wait_seconds_total: float = 0.0
    """Host time the forwards' modules waited for their sub-groups' step (offload.step_under_forward)."""


def stats_of(engine: Any) -> EngineStats:
    """What ``engine`` (``offload.engine.Engine``) reports in ``offload_stats()``."""
    storage = engine.adam.storage
    tail = engine.overlap.tail if engine.overlap is not None else None
    stats = engine.tier.store.stats() if engine.tier is not None else None
    return EngineStats(
        optimizer_device=engine.config.zero.offload_optimizer.device.value,
        tier=engine.tier.description if engine.tier is not None else f"none (state on {engine.device})",
        state_bytes_by_tier=storage.bytes_by_tier(poll=not any(x is not None and x.busy for x in
                                                               (engine.delayed, engine.overlap))),
        bytes_read_total=stats.bytes_read_total if stats else 0,
        bytes_written_total=stats.bytes_written_total if stats else 0,
        io_wait_seconds_total=storage.io_wait_seconds,
        step_seconds_total=engine.step_seconds,
        optimizer_steps=engine.adam.step_count,
        skipped_steps=engine.skipped_steps,
        step_seconds_under_backward_total=engine.overlap.seconds_under_backward if engine.overlap else 0.0,
        overlap_rollbacks=engine.overlap.rollbacks if engine.overlap else 0,
        sub_groups_stepped_early_total=engine.overlap.early_sub_groups if engine.overlap else 0,
        sub_groups_stepped_under_forward_total=tail.sub_groups_under_forward if tail else 0,
        forward_wait_seconds_total=tail.wait_seconds if tail else 0.0,
    )
