"""Fixtures of the engine tests.

The models here are tiny, so torch's intra-op threads only spin against each other (and
against whatever else shares the cores): one thread makes a 50-step run about 30 times
faster on a loaded 2-core machine, and changes no result.
"""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
