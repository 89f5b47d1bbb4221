"""[Note: host heap creep]: resident memory of a real training process (another process) stays
bounded when the engine trims the heap at the steps where it has crept."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from offload.runtime import host_heap
from offload.runtime.host_heap import HeapTrimmer, release_free_heap
from tests import child_pythonpath

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tools", "bench", "bench_host_heap.py")  # its --worker: one training process
MIB = 1 << 20


def _rss_per_step(steps: int, release: bool) -> list[int]:
    """A ~28M-parameter GPT (width 1536, one block) trained on the CPU at stage 1, offload cpu."""
    proc = subprocess.run([sys.executable, WORKER, "--worker", "trim" if release else "no trim", "--steps", str(steps),
                           "--dim", "1536", "--layers", "1"],
                          env=dict(os.environ, PYTHONPATH=child_pythonpath(ROOT)), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["rss"]


def test_release_free_heap_on_glibc():
    assert release_free_heap() is (platform.libc_ver()[0] == "glibc")


def test_trimmer_trims_at_the_first_step_then_only_past_the_slack(monkeypatch):
    rss = iter([900, 520, 563, 571, 400, 420])
    monkeypatch.setattr(host_heap, "resident_bytes", lambda: next(rss))
    trimmed = []
    monkeypatch.setattr(host_heap, "release_free_heap", lambda: trimmed.append(1) or True)
    t = HeapTrimmer(slack_bytes=50)
    # step 1 trims (start-up); step 2 settles at 520; 563 is within 50 of it, 571 is not: trim; resettle at 400
    assert [t.after_step() for _ in range(6)] == [True, False, False, True, False, False]
    assert t.trims == len(trimmed) == 2


def _floors(rss: list[int], window: int = 10) -> list[int]:
    """The lowest resident memory of each run of ``window`` steps: what the heap keeps, without a
    step's own transient peaks (which depend on how the machine schedules the step's threads)."""
    return [min(rss[i:i + window]) for i in range(0, len(rss), window)]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_resident_memory_stays_bounded_over_sixty_steps():
    """A ~28M-parameter GPT, stage 1, optimizer in host memory: the floor of resident memory (the
    lowest of every 10 steps) stays within 1.5 x the trimmer's slack of the first 10 steps' floor, the
    baseline measured in this same run. The trimmer resettles after each trim where the trimmed heap
    lands, a few to tens of MiB from that baseline, and a floor may sit up to the slack above its
    settle point: floors of +70 and +74 MiB were seen (on 58e5c56 too, about one run in five), against
    a slack of 64. Peaks are not compared: they move with the machine's load. Without the trim the
    floor climbs under glibc's dynamic mmap threshold (+155 to +685 MiB by steps 50-60 measured here;
    tools/bench/bench_host_heap.py: +126 MiB highest RSS over steps 10-60)."""
    rss = _rss_per_step(60, release=True)
    floors = _floors(rss)
    assert max(floors) - floors[0] <= HeapTrimmer().slack_bytes * 3 // 2, [r // MIB for r in rss]
