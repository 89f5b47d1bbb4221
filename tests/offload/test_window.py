"""The NVMe window's size: from the host memory budget, buffer_count as the floor; the engine with a
window of every sub-group and with one of buffer_count, both against torch; and ``arrived``, the
window's look at a prefetch that never waits."""
from __future__ import annotations

import enum
import logging

import pytest
import torch

from offload.plan.tier_plan import plan_bytes
from offload.plan import budget as window_mod
from offload.plan.budget import window_size
from offload.zero.window import HostWindow
from tests.offload.harness import (
    BUFFER_COUNT, assert_losses_close, engine_config, make_batches, overflowing, run_engine, run_torch, twin_models,
)

MIB = 1 << 20


def test_budget_from_host_memory_bytes_holds_the_largest_blocks_that_fit():
    blocks = [3 * MIB, 5 * MIB, 5 * MIB, 2 * MIB, 1 * MIB]
    fixed = 4 * MIB
    # 4 MiB fixed + 5 + 5 + 3 = 17 MiB: three blocks; the fourth (2 MiB) would need 19
    assert window_size(blocks, floor=1, fixed_bytes=fixed, host_memory_bytes=18 * MIB, what="t") == 3
    assert window_size(blocks, floor=1, fixed_bytes=fixed, host_memory_bytes=19 * MIB, what="t") == 4
    assert window_size(blocks, floor=1, fixed_bytes=fixed, host_memory_bytes=1 << 40, what="t") == 5
    # buffer_count is the floor, even where the budget holds fewer (open_tier then says it is short)
    assert window_size(blocks, floor=4, fixed_bytes=fixed, host_memory_bytes=10 * MIB, what="t") == 4
    assert window_size(blocks, floor=7, fixed_bytes=fixed, host_memory_bytes=1 << 40, what="t") == 7
    assert window_size([], floor=3, fixed_bytes=0, host_memory_bytes=None, what="t") == 3


def test_budget_without_a_setting_is_a_share_of_the_available_memory(monkeypatch, caplog):
    blocks = [MIB] * 100
    monkeypatch.setattr(window_mod, "available_bytes", lambda: 40 * MIB)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with caplog.at_level(logging.INFO, logger="offload.plan.budget"):
        got = window_size(blocks, floor=4, fixed_bytes=2 * MIB, host_memory_bytes=None, what="optimizer state")
    assert got == 40 // window_mod.FREE_SHARE - 2
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "optimizer state window: 18 of 100 blocks" in lines[0] and "buffer_count 4" in lines[0]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks on the node share it
    assert window_size(blocks, floor=4, fixed_bytes=2 * MIB, host_memory_bytes=None, what="t") == 8
    monkeypatch.setattr(window_mod, "available_bytes", lambda: None)
    assert window_size(blocks, floor=4, fixed_bytes=0, host_memory_bytes=None, what="t") == 4


def test_available_bytes_reads_meminfo():
    with open("/proc/meminfo", encoding="ascii") as f:
        line = next(x for x in f if x.startswith("MemAvailable:"))
    got = window_mod.available_bytes()
    assert got is not None and abs(got - int(line.split()[1]) * 1024) < 1 << 30  # it moves a little


@pytest.mark.parametrize("stage", [1, 2])
def test_engine_with_a_full_and_a_buffer_count_window_matches_torch(stage, tmp_path):
    """Without offload.host_memory_bytes the small model's window holds every sub-group; with a
    budget of the gradients plus BUFFER_COUNT blocks it holds BUFFER_COUNT. Both follow torch."""
    steps, batch = 12, 8
    _, ref_model = twin_models()
    ref_losses, ref_params = run_torch(ref_model, make_batches(steps, batch))
    seen = {}

    def inspect(engine, step):
        storage = engine.adam.storage
        seen["window"], seen["sub_groups"] = storage.window, len(engine.layout.sub_groups)
        seen["numels"] = [sg.numel for sg in engine.layout.sub_groups]
        stats = engine.offload_stats()
        seen["moved"] = (stats.bytes_read_total, stats.bytes_written_total, sum(stats.state_bytes_by_tier.values()))

    for budget in (None, "buffer_count"):
        cfg = engine_config(stage=stage, device="nvme", nvme_path=tmp_path)
        if budget is not None:
            plan = plan_bytes(seen["numels"], window=BUFFER_COUNT, nvme=True, nvme_path=None)
            cfg["offload"] = {"host_memory_bytes": plan.resident_bytes + 4096}  # less than one more block
        model, _ = twin_models()
        losses, params = run_engine(model, cfg, make_batches(steps, batch), on_step=inspect)
        assert_losses_close(losses, ref_losses, rel=1e-5)
        for name in params:
            torch.testing.assert_close(params[name], ref_params[name], msg=lambda m: f"{name}: {m}")
        read, written, state = seen["moved"]
        assert seen["sub_groups"] > BUFFER_COUNT
        assert read >= (steps - 1) * state and written >= steps * state  # back to NVMe and in again every step
        assert seen["window"] == (seen["sub_groups"] if budget is None else BUFFER_COUNT)


class _Tier:
    """Prefetches that finish when the test says so; a zero-timeout wait on an unfinished one times out."""

    def __init__(self):
        self.done: set[str] = set()

    def prefetch(self, names):
        return names[0]

    def wait_for_prefetch(self, handle, timeout_seconds=None):
        if handle not in self.done:
            if timeout_seconds == 0:
                raise TimeoutError(handle)
            self.done.add(handle)


def test_arrived_retires_a_finished_prefetch_without_waiting():
    Place = enum.Enum("Place", "NVME IN_FLIGHT RESIDENT")
    places = [Place.NVME] * 3
    tier = _Tier()
    window = HostWindow(tier, places, Place, size=3, name=lambda i: f"x{i}", label=str, noun="items")
    assert not window.arrived(0)  # on NVMe, nothing started
    window.prefetch([0, 1])
    assert not window.arrived(0) and places[0] == Place.IN_FLIGHT  # started, not finished: no wait
    tier.done.add("x0")
    assert window.arrived(0) and places[0] == Place.RESIDENT and 0 not in window.handles
    assert window.arrived(0) and not window.arrived(1)
    window.bring_in(1)  # the blocking path still works after polls
    assert places[1] == Place.RESIDENT


@pytest.mark.parametrize("overlap", [False, True])
def test_an_overflow_gives_the_prefetched_blocks_back(overlap, tmp_path):
    """With nvme the boundary's backward prefetches the window's blocks for the step; a step skipped
    for an fp16 overflow must give them back, as a step that ran does: after every step (its evicts
    waited for), offload_stats shows every state byte on NVMe and none held in host memory."""
    overflow_steps = {2, 3, 6}
    batches = overflowing(make_batches(9, 8), overflow_steps)
    seen = []

    def inspect(engine, step):
        engine.adam.storage.drain()
        stats = engine.offload_stats()
        seen.append((step, stats.skipped_steps, dict(stats.state_bytes_by_tier)))

    model, _ = twin_models()
    cfg = engine_config(stage=2, device="nvme", nvme_path=tmp_path, fp16={"enabled": True, "initial_scale_power": 8},
                        offload={"overlap_step": overlap})
    run_engine(model, cfg, batches, on_step=inspect)
    assert [skipped for _, skipped, _ in seen] == [sum(s <= i for s in overflow_steps) for i in range(9)]
    total = sum(seen[0][2].values())
    for step, _, by_tier in seen:
        assert by_tier.get("host", 0) == 0 and by_tier.get("in_flight", 0) == 0 and by_tier["nvme"] == total, \
            f"after step {step}: {by_tier}"
