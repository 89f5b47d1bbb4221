"""Two nodes under torchrun (issue 44): a rank lost on the second node is restarted with the whole job, which
meets again on the job's store ([Note: attempt generation] in offload.runtime.rendezvous), resumes from
each node's daemon and ends bit-equal to one node of four ranks run through; no worker outlives the job.
The generation protocol itself is held on a real store with stale attempts left in it."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from csrc.errors import RendezvousError
from offload.runtime.rendezvous import GENERATION_KEY, attempt_store
from tests import child_pythonpath
from tests.daemon.conftest import STORE
from tests.offload.conftest import trainer_daemon
from tests.offload.resume_worker import read_losses

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "offload", "resume_worker.py")
STEPS = 30
WORLD = 4


def _meet(store, world, ranks, timeout_seconds=20.0, start_delays=None):
    """Ranks ``ranks`` of one attempt meet on ``store`` in threads; returns {rank: generation or exception}."""
    out = {}

    def one(rank):
        time.sleep((start_delays or {}).get(rank, 0.0))
        try:
            out[rank] = attempt_store(store, rank, world, timeout_seconds=timeout_seconds).generation
        except RendezvousError as exc:
            out[rank] = exc
    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_every_rank_of_one_attempt_meets_on_one_generation():
    store = dist.HashStore()
    assert _meet(store, 4, range(4)) == {r: 1 for r in range(4)}
    assert _meet(store, 4, range(4)) == {r: 2 for r in range(4)}  # the next attempt: a namespace of its own


def test_a_rank_that_reads_a_finished_attempts_generation_waits_for_the_new_one():
    """The late rank 0 of attempt 2 takes its generation after the others read attempt 1's, which is full:
    they must not form a group there (its peer addresses are dead)."""
    store = dist.HashStore()
    assert _meet(store, 3, range(3)) == {0: 1, 1: 1, 2: 1}
    assert _meet(store, 3, range(3), start_delays={0: 0.5}) == {0: 2, 1: 2, 2: 2}


def test_a_rank_that_joined_a_dead_attempt_moves_to_the_new_generation():
    """Attempt 1 died before every rank joined (rank 2 was lost during import): ranks of attempt 2 that
    read generation 1 before the new rank 0 took 2 join it, see no go, and move on."""
    store = dist.HashStore()
    dead = threading.Thread(target=lambda: _meet(store, 3, [0, 1], timeout_seconds=0.3))
    dead.start()
    dead.join()
    assert store.add(GENERATION_KEY, 0) == 1
    assert _meet(store, 3, range(3), start_delays={0: 0.5}) == {0: 2, 1: 2, 2: 2}


def test_a_rank_whose_peers_never_come_gets_an_error_naming_what_it_waited_for():
    out = _meet(dist.HashStore(), 3, [0, 1], timeout_seconds=0.5)
    assert isinstance(out[0], RendezvousError) and "1 of the other 2 ranks joined generation 1" in str(out[0])
    out = _meet(dist.HashStore(), 3, [2], timeout_seconds=0.5)
    assert isinstance(out[2], RendezvousError) and "rank 0 of this attempt did not open a generation" in str(out[2])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=child_pythonpath(ROOT), OMP_NUM_THREADS="1")
    env.pop("OFFLOAD_DAEMON_SOCKET", None)
    return {**env, **{k: str(v) for k, v in extra.items()}}


def _processes_naming(path: str) -> list[int]:
    """Live processes whose command line names ``path`` (the workers of a job run in ``path``)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if path.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


def _two_nodes(workdir, sockets, max_restarts, timeout=300, **env):
    """Two torchrun agents of two ranks each on loopback (c10d rendezvous), one daemon socket per node."""
    port = _free_port()
    agents = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
               "--max-restarts", str(max_restarts[node]), "--monitor-interval", "0.5", "--rdzv_backend", "c10d",
               "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", f"two-nodes-{port}", WORKER, "nvme",
               str(workdir), str(STEPS)]
        log = open(os.path.join(workdir, f"node{node}.log"), "w")
        agents.append(subprocess.Popen(cmd, env=_env(OFFLOAD_DAEMON_SOCKET=sockets[node], **env), stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True))
    try:
        deadline = time.monotonic() + timeout
        codes = [a.wait(max(1.0, deadline - time.monotonic())) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()
        for pid in _processes_naming(str(workdir)):  # a hung worker: kill it, and fail below
            os.kill(pid, signal.SIGKILL)
    logs = "".join(open(os.path.join(workdir, f"node{n}.log")).read() for n in range(2))
    return codes, logs


@pytest.mark.skipif(STORE != "swap", reason="needs the real swap layer in the daemon")
def test_a_rank_lost_on_the_second_node_restarts_the_job_which_ends_bit_equal(tmp_path):
    """The first node's ranks are busy (healthy) at the kill while the second node's agent re-rendezvous: their
    agent restarts them for the new round without counting a restart, so the two nodes' restart counts
    differ (a store prefix named by TORCHELASTIC_RESTART_COUNT split them: they did not meet, and failed or
    hung). The first node has no restart to spend: the job must meet again in the first round after the loss."""
    ref = tmp_path / "ref"
    ref.mkdir()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD),
                           "--standalone", WORKER, "nvme", str(ref), str(STEPS)],
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    run.mkdir()
    daemons = [trainer_daemon() for _ in range(2)]
    try:
        codes, logs = _two_nodes(run, [d.socket_path for d in daemons], [0, 1], FAULT="kill-forward",
                                 FAULT_STEP=12, FAULT_RANK=3, PAUSE=60, PAUSE_RANKS="0,1")
    finally:
        for d in daemons:
            d.stop()
    assert _processes_naming(str(run)) == [], "a worker outlived the job"
    assert codes == [0, 0], logs[-6000:]
    assert (run / "faulted-rank3").exists()
    for r in range(WORLD):
        assert f"rank {r} resumed from the daemon at step 12" in logs
        assert read_losses(run, r, STEPS) == read_losses(ref, r, STEPS)
        mine, theirs = (torch.load(d / f"final-rank{r}.pt") for d in (run, ref))
        assert mine["resumed_step"] == 12
        for p, q in zip(mine["params"], theirs["params"]):
            assert p.numel() > 0 and torch.equal(p, q)
