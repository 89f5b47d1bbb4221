"""tools/bench/bench_fetch.py without a GPU: a clear message and status 0, nothing else."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the bench would measure")
def test_bench_fetch_exits_cleanly_without_a_gpu():
    out = subprocess.run([sys.executable, str(REPO / "tools/bench/bench_fetch.py"), "--rounds", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "no CUDA GPU here" in out.stdout and "nothing to measure" in out.stdout
    assert out.stderr == ""
