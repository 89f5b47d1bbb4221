"""The threads a rank's CPU work uses: affinity, cgroup quota, ranks per node ([Note: threads per rank])."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from csrc import ConfigError
from cpu_adam.cores import cgroup_cpu_limit, usable_cores

ALL = len(os.sched_getaffinity(0))
MINE = sorted(os.sched_getaffinity(0))
CAP = usable_cores(environ={})  # this machine's cores for one rank (a CI cgroup quota may cap them)
needs_two = pytest.mark.skipif(ALL < 2 or shutil.which("taskset") is None, reason="needs 2 CPUs and taskset")

CHILD = textwrap.dedent("""
    import os, torch
    from cpu_adam import AdamConfig, adam_step, default_num_threads, team_stats
    n = 1 << 20
    p, g, m, v = (torch.randn(n) for _ in range(4)); v.abs_()
    before = len(os.listdir("/proc/self/task"))
    adam_step([p], [g], [m], [v], [torch.zeros(())], config=AdamConfig(lr=1e-3))
    print(default_num_threads(), len(os.listdir("/proc/self/task")) - before, team_stats().calls)
""")


def _child(cpus: str, **env: str) -> tuple[int, int]:
    """(default_num_threads, threads the Adam step added) in a real process under ``taskset -c cpus``, the step
    on the kernels' own pool (on torch's OpenMP team it adds none: test_pool.py)."""
    threads, added, _ = _child_on(cpus, OFFLOAD_CPU_ADAM_THREADS="pool", **env)
    return threads, added


def _child_on(cpus: str, **env: str) -> tuple[int, int, int]:
    """(default_num_threads, threads the step added, its calls on the OpenMP team)."""
    e = {k: v for k, v in os.environ.items() if k not in ("LOCAL_WORLD_SIZE", "OFL_NUM_THREADS",
                                                           "OFFLOAD_CPU_ADAM_THREADS")}
    out = subprocess.run(["taskset", "-c", cpus, sys.executable, "-c", CHILD], capture_output=True, text=True,
                         env={**e, **env}, check=True, timeout=120).stdout.split()
    return int(out[0]), int(out[1]), int(out[2])


@needs_two
def test_a_process_pinned_to_one_cpu_steps_on_one_thread():
    threads, added = _child(str(MINE[0]))
    assert threads == 1
    assert added == 0  # no pool worker was started


@needs_two
def test_a_process_on_two_cpus_uses_both():
    threads, added = _child(f"{MINE[0]},{MINE[1]}")
    assert threads == min(2, CAP)
    assert added == threads - 1  # the caller and one worker
    if threads == 2:  # by default the step runs on torch's team: no thread of its own
        assert _child_on(f"{MINE[0]},{MINE[1]}")[1:] in ((0, 1), (1, 0))  # (1, 0): no single libgomp here


@needs_two
def test_two_ranks_sharing_the_node_take_half_each():
    assert _child(",".join(map(str, sorted(os.sched_getaffinity(0)))), LOCAL_WORLD_SIZE="2")[0] == max(1, CAP // 2)


@needs_two
def test_a_rank_pinned_by_its_launcher_keeps_its_cores():
    # Pinned to one CPU already: LOCAL_WORLD_SIZE does not divide it again (to zero).
    assert _child(str(MINE[0]), LOCAL_WORLD_SIZE="2")[0] == 1


def _tree(tmp_path, files: dict[str, str]):
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_cgroup_v2_quota_is_the_tightest_along_the_path(tmp_path):
    root = _tree(tmp_path, {"cpu.max": "max 100000\n", "job/cpu.max": "150000 100000\n",
                            "job/rank0/cpu.max": "max 100000\n"})
    assert cgroup_cpu_limit(root, "0::/job/rank0\n") == pytest.approx(1.5)
    assert usable_cores(environ={}, cgroup_root=root, proc_cgroup="0::/job/rank0\n") == min(ALL, 2)
    root2 = _tree(tmp_path / "b", {"job/cpu.max": "100000 100000\n"})
    assert usable_cores(environ={}, cgroup_root=root2, proc_cgroup="0::/job\n") == 1


@pytest.mark.parametrize("parent,child", [("50000 100000", "300000 100000"), ("300000 100000", "50000 100000")])
def test_a_tight_quota_wins_over_a_loose_one_above_or_below_it(tmp_path, parent, child):
    """Two quotas along the path, the tight one (0.5 CPU) in the parent or in the child: 0.5 applies."""
    root = _tree(tmp_path, {"job/cpu.max": parent + "\n", "job/rank0/cpu.max": child + "\n"})
    assert cgroup_cpu_limit(root, "0::/job/rank0\n") == pytest.approx(0.5)
    assert usable_cores(environ={}, cgroup_root=root, proc_cgroup="0::/job/rank0\n") == 1


def test_cgroup_v1_quota(tmp_path):
    root = _tree(tmp_path, {"cpu,cpuacct/slice/cpu.cfs_quota_us": "50000\n",
                            "cpu,cpuacct/slice/cpu.cfs_period_us": "100000\n"})
    text = "4:memory:/x\n3:cpu,cpuacct:/slice\n0::/\n"
    assert cgroup_cpu_limit(root, text) == pytest.approx(0.5)
    assert usable_cores(environ={}, cgroup_root=root, proc_cgroup=text) == 1


def test_no_quota_leaves_the_affinity(tmp_path):
    root = _tree(tmp_path, {"cpu.max": "max 100000\n"})
    assert cgroup_cpu_limit(root, "0::/\n") is None
    assert usable_cores(environ={}, cgroup_root=root, proc_cgroup="0::/\n") == ALL


def test_the_override_wins_and_a_bad_one_is_named(tmp_path):
    assert usable_cores(environ={"OFL_NUM_THREADS": "3", "LOCAL_WORLD_SIZE": "2"}) == 3
    with pytest.raises(ConfigError, match="OFL_NUM_THREADS"):
        usable_cores(environ={"OFL_NUM_THREADS": "zero"})
