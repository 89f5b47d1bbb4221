"""The commit region's step record ([Note: restartable step] in offload.checkpoint.resume): which verdict a
restart reads from each moment of a step, over a plain in-memory store (the region is the unit)."""
from __future__ import annotations

from csrc import ConfigError
from offload.checkpoint.resume import FINISH, FRESH, RESUME, ROLLBACK, TORN, UNDO_NAME, CommitRegion, inspect_session


class _Store:
    """The three calls CommitRegion makes of a tier store, over bytearrays."""

    def __init__(self) -> None:
        self.regions: dict[str, bytearray] = {}

    def allocate(self, name: str, nbytes: int) -> None:
        self.regions[name] = bytearray(nbytes)

    def host_view(self, name: str) -> memoryview:
        return memoryview(self.regions[name])

    def info(self, name: str) -> None:
        if name not in self.regions:
            raise ConfigError(name)


RECORD = {"small": {"global_steps": 3}, "step_count": 3, "hypers": {0: "h"}, "multiplier": 0.5}


def _verdict(store):
    verdict, step, payload, _ = inspect_session(store)
    return verdict, step, payload


def test_each_moment_of_a_step_reads_as_what_a_restart_can_do():
    store = _Store()
    assert _verdict(store)[0] == FRESH  # no region
    region = CommitRegion(store, existing=False)
    assert _verdict(store)[:2] == (FRESH, -1)  # made, never committed
    region.begin_recorded_step(RECORD)
    assert _verdict(store)[:2] == (FRESH, -1)  # the first step cut: still never committed
    region.commit(3, {"last_checkpoint": "ckpt/global_step2"})
    assert _verdict(store)[:2] == (RESUME, 3)

    region.begin_recorded_step(RECORD)
    verdict, step, payload = _verdict(store)
    assert (verdict, step) == (FINISH, 4) and payload["step_record"] == (RECORD, 0, False)
    region.sub_group_started(0)
    assert _verdict(store)[0] == TORN  # inside a pass, with no undo log to finish it from
    store.allocate(UNDO_NAME, 64)
    verdict, step, payload = _verdict(store)
    assert (verdict, step) == (FINISH, 4) and payload["step_record"] == (RECORD, 0, True)  # from the undo log
    region.sub_group_done(1)
    region.sub_group_started(1)
    region.sub_group_done(2)
    verdict, step, payload = _verdict(store)
    assert (verdict, step) == (FINISH, 4) and payload["step_record"] == (RECORD, 2, False)
    assert payload["last_checkpoint"] == "ckpt/global_step2"  # the commit's small state beside it

    region.commit(4, {"last_checkpoint": None})
    assert _verdict(store)[:2] == (RESUME, 4)
    region.begin_step()  # a delayed step: no record, so the last step's must not be read as this one's
    assert _verdict(store)[0] == TORN


def test_an_overlapped_step_rolls_back_under_backward_and_finishes_after_its_verdict():
    """[Note: speculative step]: under backward the restart undoes the step (the copies recorded whole, and
    only those); once the step record names the early sub-groups, it finishes the step, skipping them."""
    store = _Store()
    region = CommitRegion(store, existing=False)
    region.begin_speculative_step()
    assert _verdict(store)[:2] == (FRESH, -1)  # nothing committed yet: a fresh start, as ever
    region.commit(4, {"last_checkpoint": None})

    region.begin_speculative_step()
    verdict, step, payload = _verdict(store)
    assert (verdict, step, payload["rollback"]) == (ROLLBACK, 4, [])  # no copy made yet: nothing to restore
    region.early_copied(0, 3)
    region.early_copied(1, 5)
    verdict, step, payload = _verdict(store)
    assert (verdict, step, payload["rollback"]) == (ROLLBACK, 4, [(0, 3), (1, 5)])
    assert "pending" not in payload
    pending = {"small": {"global_steps": 4}, "step_count": 4, "hypers": {0: "h"}}
    region.speculative_pending(pending)  # backward over, before the all-reduce ([Note: pending step])
    verdict, step, payload = _verdict(store)
    assert (verdict, step, payload["rollback"], payload["pending"]) == (ROLLBACK, 4, [(0, 3), (1, 5)], pending)
    region.begin_speculative_step()  # the next step's backward: the last one's copies are not its own
    assert _verdict(store)[2]["rollback"] == [] and "pending" not in _verdict(store)[2]
    region.speculative_pending(dict(pending, small={"global_steps": 3}))  # not the step after the committed one
    assert "pending" not in _verdict(store)[2]

    early = dict(RECORD, early=[0, 2])
    region.begin_recorded_step(early)  # the verdict held: the early sub-groups are done
    verdict, step, payload = _verdict(store)
    assert (verdict, step) == (FINISH, 5) and payload["step_record"] == (early, 0, False)
    region.speculative_pending(pending)  # only a speculative record takes them
    assert _verdict(store)[2]["step_record"] == (early, 0, False)
    store.allocate(UNDO_NAME, 64)
    region.sub_group_started(1)  # the first sub-group not stepped early: finished from the undo log
    assert _verdict(store)[2]["step_record"] == (early, 0, True)
    region.sub_group_done(2)
    region.sub_group_started(3)  # 2 was early: 3 is the next pass
    assert _verdict(store)[2]["step_record"] == (early, 2, True)
    region.sub_group_started(4)  # a pass that cannot be the one running: not finishable
    assert _verdict(store)[0] == TORN


def test_a_session_holds_its_commit_region_and_the_undo_log_or_with_compressed_states_the_undo_copy():
    """[Note: block undo]: beside the commit region a daemon session holds the undo log for its largest sub-group
    (fp32 states), or in its place the undo copy of the largest compressed block, page-rounded; what
    ``offload.checkpoint.resume.open_undo`` allocates."""
    from cpu_adam.undo import undo_bytes
    from offload.checkpoint.resume import COMMIT_BYTES, undo_slots
    from offload.plan.memory import session_fixed_bytes
    from offload.plan.tier_plan import plan_bytes
    from offload.zero.block_undo import block_undo_bytes

    numels = [1000, 3000, 2000]
    fp32 = session_fixed_bytes(plan_bytes(numels, window=2, nvme=False, nvme_path=None), compressed=False,
                               max_elems=3000)
    assert fp32 == COMMIT_BYTES + -(-undo_bytes(undo_slots(), 3000) // 4096) * 4096
    int8 = session_fixed_bytes(plan_bytes(numels, window=2, nvme=True, nvme_path="/x",
                                          state_bytes=[6 * n + 100 for n in numels]), compressed=True, max_elems=3000)
    assert int8 == COMMIT_BYTES + -(-block_undo_bytes(18100) // 4096) * 4096  # the largest block, 18100 bytes
