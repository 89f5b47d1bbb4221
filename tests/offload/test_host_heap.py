"""[Note: host heap creep]: resident memory of a real training process (another process) stays
at what is live when the engine trims the heap at each step."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from offload.host_heap import release_free_heap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "offload", "heap_worker.py")
MIB = 1 << 20


def _rss_per_step(steps: int, release: bool) -> list[int]:
    proc = subprocess.run([sys.executable, WORKER, str(steps), "1" if release else "0"],
                          env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["rss"]


def test_release_free_heap_on_glibc():
    assert release_free_heap() is (platform.libc_ver()[0] == "glibc")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_resident_memory_stays_flat_over_forty_steps():
    """A ~28M-parameter GPT, stage 1, optimizer in host memory: after the first ten steps, resident
    memory moves by less than 32 MiB (about 3%) over the next thirty. Without the trim the same run
    grows by hundreds of MiB under glibc's dynamic mmap threshold (measured 1.17 -> 1.43 GiB)."""
    rss = _rss_per_step(40, release=True)
    settled = rss[9]
    assert max(rss[10:]) - settled < 32 * MIB, [r // MIB for r in rss]
