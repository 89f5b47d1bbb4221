"""Fixtures of the engine tests.

The models here are tiny, so torch's intra-op threads only spin against each other (and
against whatever else shares the cores): one thread makes a 50-step run about 30 times
faster on a loaded 2-core machine, and changes no result.
"""
from __future__ import annotations

import pytest
import torch

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
