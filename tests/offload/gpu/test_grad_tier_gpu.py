"""The gradient tier and bf16 accumulators with the model on a GPU: each unit's gradient comes back on
the D2H stream and lands in an accumulator that is on NVMe between steps (offload.gradient_tier nvme)
or 2 bytes an element (data_types.grad_accum_dtype bf16); training matches torch on the same GPU.
Skipped without a GPU (the same paths run on the CPU in tests/offload/test_grad_tier.py)."""
from __future__ import annotations

import contextlib

import pytest
import torch

from offload import initialize
from tests.offload import stage3_worker as w
from tests.offload.test_stage3 import _engine_run, _torch_run

pytestmark = pytest.mark.cuda

STEPS = 12


def _gathered(engine):
    return engine.stage3.coordinator.gathered() if engine.stage3 is not None else contextlib.nullcontext()


@pytest.mark.parametrize("stage,tier,accum", [(3, "nvme", "fp32"), (3, "nvme", "bf16"), (2, "host", "bf16")])
def test_gradient_tier_and_bf16_accumulators_on_the_gpu_match_torch(tmp_path, stage, tier, accum):
    data = [(x.cuda(), y.cuda()) for x, y in w.batches(STEPS)]
    ref = w.model().cuda()
    want = _torch_run(ref, data, bf16_grads=accum == "bf16")
    config = w.config("nvme", "cpu" if stage == 3 else "none", str(tmp_path))
    config["zero_optimization"]["stage"] = stage
    if stage != 3:
        del config["zero_optimization"]["offload_param"]
    config["data_types"] = {"grad_accum_dtype": accum}
    config["offload"] = {"gradient_tier": tier}
    net = w.model()
    engine, _, _, _ = initialize(model=net, config=config)
    try:
        assert engine.device.type == "cuda"
        storage = engine.adam.storage
        assert (storage.grads_tier is not None) == (tier == "nvme")
        losses = _engine_run(engine, data)
        for sg in engine.layout.sub_groups:
            assert storage.tier.info(f"grad.{sg.index}").nbytes == (2 if accum == "bf16" else 4) * sg.numel
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5, atol=0)
        with _gathered(engine):
            ours = torch.cat([p.detach().reshape(-1).cpu() for p in net.parameters()])
        theirs = torch.cat([q.detach().reshape(-1).cpu() for q in ref.parameters()])
        if accum == "fp32":
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        else:  # as in test_grad_tier: a gradient one ulp off torch's may round to the next bf16 value
            apart = ~torch.isclose(ours, theirs, rtol=1e-5, atol=1e-6)
            assert int(apart.sum()) <= ours.numel() // 200, int(apart.sum())
            torch.testing.assert_close(ours, theirs, rtol=2e-3, atol=1e-4)
    finally:
        engine.close()


def test_a_second_micro_batch_adds_to_accumulators_written_back_to_nvme_on_the_gpu(tmp_path):
    """Two micro-batches per step: the second micro-step's landings read back what the first wrote to NVMe
    (a skipped write-back trains on stale gradients); 6 steps match torch on the same GPU to 1e-5."""
    from tests.offload.test_stage3_more import _config, _data, _engine_losses, _gpt, _torch_losses

    data = [ids.cuda() for ids in _data(6)]
    ref = _torch_losses(_gpt().cuda(), data, micro=2)
    config = _config("nvme", "cpu", str(tmp_path))
    config["gradient_accumulation_steps"] = 2
    config["offload"] = {"gradient_tier": "nvme"}
    engine, _, _, _ = initialize(model=_gpt(), config=config)
    try:
        assert engine.device.type == "cuda" and engine.adam.storage.grads_tier is not None
        losses = _engine_losses(engine, data, micro=2)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=0)
    finally:
        engine.close()
