"""torch's OpenMP workers stop spinning between regions once the engine's helper team runs ([Note: OpenMP waits]).

The oracle is the CPU time of the process's other threads, read by the kernel: a fresh interpreter runs one
parallel torch op, then 100 short sleeps of its main thread with a tiny parallel op between them. A worker
that spins burns its spin count at every gap; one that sleeps burns nearly nothing.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offload.omp_wait import helper_team_size, loaded_libgomp

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import sys, time, torch
from offload import initialize
from offload.omp_wait import quiet_omp_waits
a = torch.randn(1 << 20)
a.mul_(2)  # torch's team exists
if sys.argv[1] == "engine":
    model = torch.nn.Linear(4, 4)
    initialize(model=model, config={"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                    "zero_optimization": {"stage": 0}}, dist_init_required=False)
elif sys.argv[1] == "call":
    print("team", quiet_omp_waits())
t0, m0 = time.process_time(), time.thread_time()
for _ in range(100):
    a.mul_(1.0001)
    time.sleep(0.005)
print("workers", (time.process_time() - t0) - (time.thread_time() - m0))
"""


def _workers_cpu(mode: str, **env: str) -> float:
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OFL_OMP_SPIN")}
    environ.update(env, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env=environ, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return float(out.strip().splitlines()[-1].split()[1])


needs_gomp = pytest.mark.skipif(
    loaded_libgomp() is None or "OpenMP" not in torch.__config__.parallel_info() or len(os.sched_getaffinity(0)) < 2,
    reason="torch's kernels run on one libgomp team here only with libgomp loaded and two CPUs or more")


@needs_gomp
def test_the_engine_stops_torchs_workers_spinning_between_ops():
    plain = _workers_cpu("plain")
    if plain < 0.05:
        pytest.skip(f"torch's workers spun only {plain:.3f} s here: nothing to stop")
    engine = _workers_cpu("engine")
    assert engine < 0.25 * plain, f"workers' CPU with the engine {engine:.3f} s, without {plain:.3f} s"


@needs_gomp
@pytest.mark.parametrize("env", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "300000"}, {"OFL_OMP_SPIN": "1"}])
def test_a_users_own_wait_policy_is_left_alone(env):
    plain = _workers_cpu("plain", **env)
    if plain < 0.05:
        pytest.skip(f"torch's workers spun only {plain:.3f} s here under {env}")
    assert _workers_cpu("call", **env) > 0.5 * plain


def test_the_helper_team_tips_libgomps_count_over_the_cpus():
    # libgomp counts 1 + (torch_threads - 1) + (team - 1) and throttles when that exceeds the CPUs
    for cpus, threads in ((2, 2), (16, 16), (32, 16), (8, 3), (64, 2)):
        team = helper_team_size(cpus, threads, environ={})
        assert team >= 2 and threads + team - 1 > cpus, (cpus, threads, team)
        assert threads + team - 2 <= cpus or team == 2, "no more threads than it takes"
    assert helper_team_size(8, 1, environ={}) == 0
    assert helper_team_size(8, 8, environ={"OFL_OMP_SPIN": "1"}) == 0
    assert helper_team_size(8, 8, environ={"OFL_OMP_SPIN": "0"}) == 2
    assert helper_team_size(8, 8, environ={"OMP_WAIT_POLICY": "passive"}) == 0


def test_loaded_libgomp_reads_the_maps(tmp_path):
    maps = tmp_path / "maps"
    line = "7f00-7f10 r-xp 00000000 08:01 123 {}\n"
    maps.write_text(line.format("/x/torch/lib/libgomp.so.1") * 2 + line.format("/usr/lib/libc.so.6"))
    assert loaded_libgomp(str(maps)) == "/x/torch/lib/libgomp.so.1"
    maps.write_text(line.format("/x/torch/lib/libgomp.so.1") + line.format("/usr/lib/libgomp.so.1"))
    assert loaded_libgomp(str(maps)) is None
    maps.write_text(line.format("/usr/lib/libc.so.6"))
    assert loaded_libgomp(str(maps)) is None
    assert loaded_libgomp(str(tmp_path / "none")) is None
