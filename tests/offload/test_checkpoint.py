"""Checkpoints: resume in a new process is bitwise the uninterrupted run (offload cpu and nvme, the
RNG included); 2 ranks save, 1 rank loads and continues as 2 ranks would; consolidate gives a plain
fp32 state dict that the model loads and that equals the trained weights; a save is one data file
per rank, with no warning; checkpoint.keep_last keeps that many tags; a full disk fails clearly."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.offload import ckpt_worker
from tests import child_pythonpath

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "offload", "ckpt_worker.py")
FULL_DISK_WORKER = os.path.join(ROOT, "tests", "offload", "full_disk_worker.py")
NO_WARNINGS = "error::FutureWarning,error::DeprecationWarning"  # a warning ends the process


def _run(args, *, ranks=1, env=None, timeout=240):
    full_env = dict(os.environ, PYTHONPATH=child_pythonpath(ROOT), OMP_NUM_THREADS="1", **(env or {}))
    if ranks == 1:
        cmd = [sys.executable, WORKER, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
               "--standalone", WORKER, *args]
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


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
    proc = _run(["run", "cpu", str(tmp_path), "0", "10"], ranks=2,
                env={"SAVE": "1", "DROPOUT": "0", "PYTHONWARNINGS": NO_WARNINGS})
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]
    tag = tmp_path / "ckpt" / "global_step10"  # one data file per rank, and DCP's metadata
    assert sorted(os.listdir(tag)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
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


def test_keep_last_keeps_that_many_tags(tmp_path):
    """checkpoint.keep_last 2 over four saves: the two newest tags stay (global_step10 after
    global_step9: saves are ordered by time, not name), 'latest' names the newest, and it loads."""
    from offload.builder import initialize

    cfg = dict(ckpt_worker.config("cpu", str(tmp_path), 2), checkpoint={"keep_last": 2})
    engine, _, _, _ = initialize(model=ckpt_worker.model(), config=cfg)
    x, y = ckpt_worker.batches(1)[0]
    try:
        for tag in ("global_step8", "global_step9", "global_step10", "global_step11"):
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            engine.save_checkpoint(str(tmp_path), tag=tag)
        assert sorted(os.listdir(tmp_path)) == ["global_step10", "global_step11", "latest"]
        assert (tmp_path / "latest").read_text() == "global_step11"
        path, _ = engine.load_checkpoint(str(tmp_path))
        assert path == str(tmp_path / "global_step11") and engine.global_steps == 4
    finally:
        engine.close()


def test_keep_last_never_removes_the_tag_latest_names(tmp_path):
    """checkpoint.keep_last 1, a save and then a save with save_latest=False: the tag 'latest' names is kept
    beside the new one, and loading the directory loads it."""
    from offload.builder import initialize

    cfg = dict(ckpt_worker.config("cpu", str(tmp_path), 2), checkpoint={"keep_last": 1})
    engine, _, _, _ = initialize(model=ckpt_worker.model(), config=cfg)
    x, y = ckpt_worker.batches(1)[0]
    try:
        for tag, save_latest in (("global_step1", True), ("global_step2", False)):
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            engine.save_checkpoint(str(tmp_path), tag=tag, save_latest=save_latest)
        assert sorted(os.listdir(tmp_path)) == ["global_step1", "global_step2", "latest"]
        assert (tmp_path / "latest").read_text() == "global_step1"
        path, _ = engine.load_checkpoint(str(tmp_path))
        assert path == str(tmp_path / "global_step1") and engine.global_steps == 1
    finally:
        engine.close()


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1) for a private tmpfs")
def test_a_full_disk_names_the_path_and_enospc_and_keeps_the_last_save(tmp_path):
    """A second save onto a tmpfs with room for one (mounted in a private mount namespace over
    tmp_path): CheckpointWriteError with errno ENOSPC naming the tag's path; the partial tag is
    gone and 'latest' still names the first save."""
    script = 'mount -t tmpfs -o size=140k tmpfs "$1" || exit 77; exec "$2" "$3" "$1"'
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", str(tmp_path), sys.executable, FULL_DISK_WORKER],
                          env=dict(os.environ, PYTHONPATH=child_pythonpath(ROOT), OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=240)
    if proc.returncode == 77 or "unshare failed" in proc.stderr:
        pytest.skip(f"no private tmpfs here: {proc.stderr.strip()[-200:]}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["raised"] == "CheckpointWriteError" and out["offload_error"], out
    assert out["errno"] == 28 and "ENOSPC" in out["message"], out
    assert f"{tmp_path}/second" in out["message"], out
    assert out["entries"] == ["first", "latest"] and out["latest"] == "first", out
