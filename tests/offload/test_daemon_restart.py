"""Issue 42: a node daemon restarted under running jobs. Two ranks under torchrun (no restarts allowed:
a trainer that fails fails the run) train through a real daemon, stage 2 with the optimizer on nvme and
stage 3 with the params on cpu too; the daemon is stopped with SIGTERM and started again (an upgrade's
``systemctl restart``), or killed with SIGKILL at random moments and started again, through a player of
systemd's fd store. Every run finishes bit-equal to the uninterrupted run, and each rank says how long
it went without the daemon."""
from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import time

import pytest

from tests import child_pythonpath
from tests.daemon.conftest import STORE
from tests.daemon.restarts import RestartableDaemon
from tests.offload.test_crash_resume import _reference
from tests.offload.test_resume import ROOT, STEPS, WORKER, _final, _same

pytestmark = pytest.mark.skipif(STORE != "swap", reason="needs the real swap layer in the daemon")

REATTACHED = re.compile(r"reattached session \d+ after ([0-9.]+) s without the daemon")


@pytest.fixture
def restartable():
    d = RestartableDaemon(pool={"capacity_bytes": 64 << 20, "segment_bytes": 4 << 20},
                          sessions={"default_quota_bytes": 8 << 20, "reattach_grace_seconds": 60.0})
    d.start()
    yield d
    d.close()


def _steps_done(workdir, rank: int = 0) -> int:
    try:
        with open(os.path.join(workdir, f"losses-rank{rank}.txt")) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def _train_through_restarts(workdir, d: RestartableDaemon, plan: list[tuple[int, str, float]], **env):
    """Two ranks under torchrun (no restarts) through ``d``; at each (step, how, delay) of ``plan``: once rank 0
    logged ``step`` steps, wait ``delay`` s, then stop (``"term"``) or kill (``"kill"``) the daemon and start
    it again. Returns the finished run and how long each restart took (stop to serving)."""
    full = dict(os.environ, PYTHONPATH=child_pythonpath(ROOT), OMP_NUM_THREADS="1",
                OFFLOAD_DAEMON_SOCKET=d.socket_path, **{k: str(v) for k, v in env.items()})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts", "0",
           "--monitor-interval", "0.5", "--standalone", WORKER, "nvme", str(workdir), str(STEPS)]
    proc = subprocess.Popen(cmd, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    restarts = []
    try:
        for step, how, delay in plan:
            deadline = time.monotonic() + 240
            while _steps_done(workdir) < step and proc.poll() is None:
                assert time.monotonic() < deadline, "the trainers stalled"
                time.sleep(0.005)
            time.sleep(delay)
            t0 = time.monotonic()
            if how == "kill":
                d.kill()
            else:
                assert d.term() == 0, d.log()[-3000:]
            d.start()
            restarts.append(time.monotonic() - t0)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, err, restarts


def _finished_alike(code, err, ref, workdir, d, restarts, count):
    errors = "\n".join(line for line in err.splitlines() if "Error" in line or "error" in line)
    assert code == 0, errors[-6000:] + "\n--- daemon ---\n" + d.log()[-6000:]
    pauses = [float(x) for x in REATTACHED.findall(err)]
    assert pauses, err[-3000:]  # the ranks reattached, and said after how long
    assert "Traceback" not in d.log()
    assert d.log().count("took over job") >= count  # each start took the sessions over
    for r in range(2):
        assert _final(workdir, r)["resumed_step"] is None  # no trainer restarted: the same process went on
    _same(ref, workdir, ranks=2)
    print(f"restarts (stop to serving) {[round(s, 2) for s in restarts]} s; "
          f"pauses without the daemon {sorted(round(p, 2) for p in pauses)} s")


@pytest.mark.parametrize("stage,env", [(2, {}), (3, {"PARAM_DEVICE": "cpu"})], ids=["stage2-nvme", "stage3-params-cpu"])
def test_sigterm_restarts_under_training_change_nothing(tmp_path, tmp_path_factory, restartable, stage, env):
    ref = _reference(tmp_path_factory, stage, **env)
    plan = [(6, "term", 0.0), (17, "term", 0.05)]
    code, err, restarts = _train_through_restarts(tmp_path, restartable, plan, STAGE=stage, **env)
    _finished_alike(code, err, ref, tmp_path, restartable, restarts, 2)
    assert "stopped (drained), keeping the journal and segments in the fd store" in restartable.log()


@pytest.mark.parametrize("stage,env,seed", [(2, {}, 1), (2, {}, 2), (3, {"PARAM_DEVICE": "cpu"}, 3)],
                         ids=["stage2-nvme-a", "stage2-nvme-b", "stage3-params-cpu"])
def test_sigkill_at_random_moments_changes_nothing(tmp_path, tmp_path_factory, restartable, stage, env, seed):
    """Killed 0-150 ms after a step boundary: between steps, in forward or backward, inside the optimizer step
    and its evicts; three kills a run."""
    ref = _reference(tmp_path_factory, stage, **env)
    rng = random.Random(seed)
    plan = [(step, "kill", rng.uniform(0.0, 0.15)) for step in sorted(rng.sample(range(3, STEPS - 3), 3))]
    code, err, restarts = _train_through_restarts(tmp_path, restartable, plan, STAGE=stage, **env)
    _finished_alike(code, err, ref, tmp_path, restartable, restarts, 3)


@pytest.mark.parametrize("stage,env", [(2, {}), (3, {"PARAM_DEVICE": "cpu"})], ids=["stage2-nvme", "stage3-params-cpu"])
def test_without_an_fd_store_the_trainers_hand_their_memory_back(tmp_path, tmp_path_factory, stage, env):
    """``[server] keep_state = "state_dir"`` (no systemd): the journal in the state directory, the segments
    handed back by the trainers that map them ([Note: hand-back] in daemon.handback); killed twice and
    stopped once a run."""
    d = RestartableDaemon(keep="state_dir", pool={"capacity_bytes": 64 << 20, "segment_bytes": 4 << 20},
                          sessions={"default_quota_bytes": 8 << 20, "reattach_grace_seconds": 60.0}).start()
    try:
        ref = _reference(tmp_path_factory, stage, **env)
        rng = random.Random(stage)
        steps = sorted(rng.sample(range(3, STEPS - 8), 3))
        plan = [(steps[0], "kill", rng.uniform(0, 0.15)), (steps[1], "term", 0.0), (steps[2], "kill", rng.uniform(0, 0.15))]
        code, err, restarts = _train_through_restarts(tmp_path, d, plan, STAGE=stage, **env)
        _finished_alike(code, err, ref, tmp_path, d, restarts, 0)
        assert d.log().count("handed its") >= 2 * 2  # each rank's session(s), at each start it was still training
    finally:
        d.close()
