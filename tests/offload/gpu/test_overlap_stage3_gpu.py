"""``offload.overlap_step`` true at stage 3 with the model on a GPU ([Note: early steps at stage 3] in
offload.zero.overlap): the units' gradients come back on the D2H stream and land as they do; the early sub-groups'
params wait in buffers of their own until the verdict. Against the serial step bit for bit, and torch. Skipped
without a GPU; whether any sub-group is stepped early with this tiny model depends on the GPU's speed, so the
test counts them without requiring them."""
from __future__ import annotations

import pytest
import torch

from tests.offload.harness import assert_matches_torch, make_batches, run_engine, twin_models
from tests.offload.test_overlap_stage3 import CLIP, STEPS, BATCH, _config

pytestmark = pytest.mark.cuda


def _run(tmp_path, overlap, **kw):
    model, _ = twin_models()
    seen = {}
    losses, params = run_engine(model, _config(tmp_path, overlap, **kw),
                                [(x.cuda(), y.cuda()) for x, y in make_batches(STEPS, BATCH)],
                                on_step=lambda engine, step: seen.update(overlap=engine.overlap))
    return losses, params, seen["overlap"]


@pytest.mark.parametrize("device,param,clip", [("cpu", "cpu", CLIP), ("nvme", "cpu", 0.0), ("cpu", "none", 0.0)])
def test_stage_3_overlapped_on_the_gpu_is_the_serial_step(tmp_path, device, param, clip):
    losses, params, overlap = _run(tmp_path, True, device=device, param=param, clip=clip)
    serial_losses, serial_params, _ = _run(tmp_path, False, device=device, param=param, clip=clip)
    assert overlap is not None
    assert losses == serial_losses
    for name in params:
        assert torch.equal(params[name], serial_params[name]), name
    assert_matches_torch(losses, params, make_batches(STEPS, BATCH), clip=clip, device="cuda")
    print(f"early sub-groups {overlap.early_sub_groups}, rollbacks {overlap.rollbacks}")
