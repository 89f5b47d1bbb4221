"""Shared test settings: GPU tests are marked ``cuda`` and skip without a GPU."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU; none here")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
