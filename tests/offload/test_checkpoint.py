"""Checkpoints: resume in a new process is bitwise the uninterrupted run (offload cpu and nvme, the
RNG included); 2 ranks save, 1 rank loads and continues as 2 ranks would; consolidate gives a plain
fp32 state dict that the model loads and that equals the trained weights."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.offload import ckpt_worker
from tests import child_pythonpath

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "offload", "ckpt_worker.py")


def _run(args, *, ranks=1, env=None, timeout=240):
    full_env = dict(os.environ, PYTHONPATH=child_pythonpath(ROOT), OMP_NUM_THREADS="1", **(env or {}))
    if ranks == 1:
        cmd = [sys.executable, WORKER, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
               "--standalone", WORKER, *args]
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _result(workdir, mode, rank=0):
    return torch.load(os.path.join(workdir, f"{mode}-rank{rank}.pt"))


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_resume_in_a_new_process_is_bitwise_the_uninterrupted_run(tmp_path, device):
    """Save at step 20, end the process, load in a new one, go on to 40: the same losses and params
    bit for bit as one run to 40 (fp32; dropout on, so the RNG state must come back too)."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    whole.mkdir(), split.mkdir()
    _run(["run", device, str(whole), "0", "40"])
    _run(["run", device, str(split), "0", "20"], env={"SAVE": "1"})
    _run(["resume", device, str(split), "20", "40"])
    a, b = _result(whole, "run"), _result(split, "resume")
    assert b["losses"] == a["losses"][20:]
    assert b["steps"] == a["steps"] == 40 and b["lr"] == a["lr"]
    for p, q in zip(a["params"], b["params"]):
        assert torch.equal(p, q)
    if device == "nvme":  # the swap directories were removed at close
        assert not [n for n in os.listdir(split) if n.startswith("offload-rank")]


def test_two_ranks_save_and_one_rank_continues(tmp_path):
    """Stage 2 over 2 ranks (partitioned state, sharded in the checkpoint) saved at 20, loaded onto
    1 rank and run to 40, matches the 2-rank run to 40 (same global batch) to 1e-5."""
    two, moved = tmp_path / "two", tmp_path / "moved"
    two.mkdir(), moved.mkdir()
    env = {"DROPOUT": "0"}
    _run(["run", "nvme", str(two), "0", "40"], ranks=2, env=env)
    _run(["run", "nvme", str(moved), "0", "20"], ranks=2, env=dict(env, SAVE="1"))
    _run(["resume", "cpu", str(moved), "20", "40"], env=env)
    a, b = _result(two, "run"), _result(moved, "resume")
    both = (torch.tensor(a["losses"]) + torch.tensor(_result(two, "run", rank=1)["losses"])) / 2  # equal halves
    torch.testing.assert_close(torch.tensor(b["losses"]), both[20:], rtol=1e-5, atol=0)
    for p, q in zip(a["params"], b["params"]):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


def test_consolidate_writes_a_state_dict_the_model_loads(tmp_path):
    """`offload consolidate CKPT OUT.pt` from a 2-rank stage-2 checkpoint: model.load_state_dict
    accepts it (strict), and its weights are the trained fp32 weights of the run that saved it."""
    _run(["run", "cpu", str(tmp_path), "0", "10"], ranks=2, env={"SAVE": "1", "DROPOUT": "0"})
    out = tmp_path / "consolidated.pt"
    proc = subprocess.run([sys.executable, "-m", "offload.cli", "consolidate", str(tmp_path / "ckpt" / "global_step10"),
                           str(out)], env=dict(os.environ, PYTHONPATH=child_pythonpath(ROOT)), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = torch.load(out)
    net = ckpt_worker.model()
    net.load_state_dict(state, strict=True)
    trained = _result(tmp_path, "run")["params"]
    for p, q in zip(net.parameters(), trained):
        assert p.dtype == torch.float32
        assert torch.equal(p.detach(), q)
