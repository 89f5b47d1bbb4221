"""Two ranks under torchrun (gloo, on this machine's CPU) against one rank with the same global batch.

Each rank trains on its half of every global batch, with gradient clipping (so the global
norm, summed over the ranks' partitions, decides every step); the mean of the two ranks'
losses is the global batch's loss, and must match, within 1e-5 relative at every step, both
plain torch (``clip_grad_norm_``) and the engine on one rank over the whole batch. Both ranks must end with bit-identical params
(the all-gather), within the fp32 tolerance of test_equivalence of torch's. One torchrun runs
every configuration in turn, so the cost of starting two processes is paid once.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.offload.harness import assert_losses_close, engine_config, make_batches, run_engine, run_torch, twin_models

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("ranks_worker.py")
STEPS = 30
BATCH = 8
CLIP = 1.0
RUNS = ["0:none", "1:cpu", "1:nvme", "2:cpu", "2:nvme"]
# the same through the process group's collectives (no node-shared buffers), and with accumulation
TWINS = [("1:cpu", "1:cpu:gloo"), ("2:cpu", "2:cpu:gloo"), ("2:cpu:gas2", "2:cpu:gas2:gloo")]
HALF = ["2:cpu:half", "2:nvme:gloo:half"]  # half of the optimizer kept on the device, each rank its partition's
TIMEOUT_SECONDS = 300


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    nvme = tmp_path_factory.mktemp("nvme")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    env.pop("OFFLOAD_DAEMON_SOCKET", None)
    runs = RUNS + [r for pair in TWINS for r in pair if r not in RUNS] + HALF
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
           str(out), str(nvme), str(STEPS), str(BATCH), str(CLIP), *runs]
    shm_before = _node_files()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_SECONDS)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert not list(nvme.iterdir()), "the engines left swap files behind"
    assert not _node_files() - shm_before, "the engines left their node-shared buffers in /dev/shm"
    with open(out / "losses.json") as f:
        return out, json.load(f)


def _node_files() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("offload-ranks-*")} if shm.is_dir() else set()


@pytest.fixture(scope="module")
def torch_oracle():
    torch.set_num_threads(1)
    _, model = twin_models()
    norms: list[float] = []
    losses, params = run_torch(model, make_batches(STEPS, BATCH), clip=CLIP, norms_out=norms)
    assert sum(n > CLIP for n in norms) >= STEPS // 2, "clipping should act on most steps"
    return losses, params, norms


@pytest.mark.parametrize("run", RUNS)
def test_two_ranks_match_one(run, two_ranks, torch_oracle, tmp_path):
    out, results = two_ranks
    losses, layout = results[run]["losses"], results[run]["layout"]
    stage, device = run.split(":")
    assert layout["engine_world_size"] == 2
    if stage != "0":  # stages 1-2 partition the state: each rank owns half
        assert layout["world_size"] == 2 and 2 * layout["partition_numel"] == layout["total_numel"]
    assert layout["node_shared"] == (stage != "0"), "stages 1-2 on one node share their buffers by default"
    model, _ = twin_models()
    config = engine_config(stage=int(stage), device=device, nvme_path=tmp_path, batch_size=BATCH,
                           gradient_clipping=CLIP)
    one_losses, one_params = run_engine(model, config, make_batches(STEPS, BATCH))
    ref_losses, ref_params, ref_norms = torch_oracle

    assert_losses_close(results[run]["norms"], ref_norms, rel=1e-5)
    assert_losses_close(losses, ref_losses, rel=1e-5)
    assert_losses_close(losses, one_losses, rel=1e-5)
    rank0 = torch.load(out / f"params_{stage}_{device}_rank0.pt")
    rank1 = torch.load(out / f"params_{stage}_{device}_rank1.pt")
    for name in ref_params:
        assert torch.equal(rank0[name], rank1[name]), f"{name}: the ranks disagree"
        torch.testing.assert_close(rank0[name], ref_params[name], msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(rank0[name], one_params[name], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("shared,gloo", TWINS, ids=[t[0] for t in TWINS])
def test_node_shared_buffers_give_the_process_groups_bits(shared, gloo, two_ranks):
    """The ranks' shared param buffer and summed gradient shards ([Note: node-shared buffers]) give
    exactly the losses, gradient norms and params of gloo's reduce-scatter and all-gather, with and
    without accumulation (every micro-step reduced, the shards zeroed for the next)."""
    out, results = two_ranks
    assert results[shared]["layout"]["node_shared"] and not results[gloo]["layout"]["node_shared"]
    assert results[shared]["losses"] == results[gloo]["losses"]
    assert results[shared]["norms"] == results[gloo]["norms"]
    tag = lambda run, rank: out / f"params_{run.replace(':', '_')}_rank{rank}.pt"  # noqa: E731
    for rank in (0, 1):
        mine, theirs = torch.load(tag(shared, rank)), torch.load(tag(gloo, rank))
        for name in theirs:
            assert torch.equal(mine[name], theirs[name]), f"rank {rank}, {name}: differs from the process group's"


@pytest.mark.parametrize("run", HALF)
def test_two_ranks_with_half_of_the_state_kept_match_torch(run, two_ranks, torch_oracle):
    """offload_optimizer.ratio 0.5 on two ranks: each keeps the last half of its own partition's sub-groups, and
    the gathered params are torch's ([Note: GPU-resident share] in offload.zero.device_share)."""
    out, results = two_ranks
    ref_losses, ref_params, ref_norms = torch_oracle
    assert results[run]["layout"]["kept"] > 0
    assert_losses_close(results[run]["losses"], ref_losses, rel=1e-5)
    assert_losses_close(results[run]["norms"], ref_norms, rel=1e-5)
    name_of = run.replace(":", "_")
    rank0, rank1 = (torch.load(out / f"params_{name_of}_rank{r}.pt") for r in (0, 1))
    for name in ref_params:
        assert torch.equal(rank0[name], rank1[name]), f"{name}: the ranks disagree"
        torch.testing.assert_close(rank0[name], ref_params[name], msg=lambda m: f"{name}: {m}")
