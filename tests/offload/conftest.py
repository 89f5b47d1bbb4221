"""Fixtures of the engine tests.

The models here are tiny, so torch's intra-op threads only spin against each other (and
against whatever else shares the cores): one thread makes a 50-step run about 30 times
faster on a loaded 2-core machine, and changes no result.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from offload.zero import optimizer as optimizer_module
from tests.daemon.conftest import start_daemon


def trainer_daemon():
    """A node daemon sized for the small trainers of these tests (64 MiB pool, 8 MiB sessions, 60 s grace)."""
    return start_daemon(pool={"capacity_bytes": 64 << 20, "segment_bytes": 4 << 20},
                        sessions={"default_quota_bytes": 8 << 20, "reattach_grace_seconds": 60.0})


@pytest.fixture
def daemon():
    """A ``trainer_daemon`` for one test."""
    d = trainer_daemon()
    yield d
    d.stop()


@pytest.fixture(autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# [Note: the step under the next forward] (offload.zero.step_tail): what its tests, on the CPU and the GPU, share
FEW_EARLY = 3
SLOW_WORKER_SECONDS = 0.01


@pytest.fixture
def few_early(monkeypatch):
    """At most FEW_EARLY sub-groups stepped under backward (on one CPU rank every bucket lands in its hook, so all
    would be; on a GPU the first layers' are complete only as backward ends): the rest is the tail."""
    monkeypatch.setattr("offload.zero.overlap.copies_that_fit", lambda *args, **kwargs: FEW_EARLY)
    monkeypatch.setattr("offload.plan.budget.available_bytes", lambda: None)  # nvme: the window at buffer_count


@pytest.fixture
def slow_worker(monkeypatch):
    """Each Adam pass on the overlap's worker thread takes SLOW_WORKER_SECONDS longer."""
    step_one = optimizer_module.PartitionedAdam._step_sub_group

    def slowed(self, *args, **kwargs):
        if threading.current_thread().name.startswith("offload-overlap"):
            time.sleep(SLOW_WORKER_SECONDS)
        return step_one(self, *args, **kwargs)

    monkeypatch.setattr(optimizer_module.PartitionedAdam, "_step_sub_group", slowed)
