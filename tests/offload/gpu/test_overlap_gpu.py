"""``offload.overlap_step`` with the model on a GPU (where "auto" turns it on): the equivalence
tests' model and oracles on CUDA, the overlapped step against torch and against the ordinary
step bit for bit. Skipped without a GPU.

On a GPU the reduced buckets reach the host on the D2H stream and land from the hooks once their
event says so ([Note: landing early] in ``offload.zero.overlap``); whether any has landed before
backward ends depends on the GPU's speed with this tiny model, so the tests count early steps
without requiring them.
"""
from __future__ import annotations

import pytest
import torch

from tests.offload.harness import assert_matches_torch, engine_config, make_batches, run_engine, twin_models

pytestmark = pytest.mark.cuda

STEPS = 20
BATCH = 8
CLIP = 6.5  # as in tests/offload/test_overlap.py: some steps clip, some do not


def _run(overlap, stage, device, tmp_path, clip):
    model, _ = twin_models()
    batches = [(x.cuda(), y.cuda()) for x, y in make_batches(STEPS, BATCH)]
    config = engine_config(stage=stage, device=device, nvme_path=tmp_path, gradient_clipping=clip,
                           offload={"overlap_step": overlap})
    seen = {}
    losses, params = run_engine(model, config, batches, on_step=lambda e, i: seen.update(overlap=e.overlap))
    return losses, params, seen


@pytest.mark.parametrize("stage,device,clip", [(0, "cpu", 0.0), (1, "nvme", 0.0), (2, "cpu", CLIP), (2, "nvme", CLIP)])
def test_overlapped_step_on_the_gpu_matches_torch_and_the_ordinary_step(stage, device, clip, tmp_path):
    losses, params, seen = _run("auto", stage, device, tmp_path, clip)
    assert seen["overlap"] is not None, '"auto" is on where the model computes on a GPU'
    assert_matches_torch(losses, params, make_batches(STEPS, BATCH), clip=clip, device="cuda")
    plain_losses, plain_params, plain_seen = _run(False, stage, device, tmp_path, clip)
    assert plain_seen["overlap"] is None
    assert losses == plain_losses
    for name in params:
        assert torch.equal(params[name], plain_params[name]), name
    print(f"early sub-groups {seen['overlap'].early_sub_groups}, rollbacks {seen['overlap'].rollbacks}")
