"""What an engine's tiers did: the record ``Engine.offload_stats()`` returns."""
from __future__ import annotations

import dataclasses

__all__ = ["EngineStats"]


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
