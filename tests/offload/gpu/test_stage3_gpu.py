"""Stage 3 on a GPU: the units' shards reach the device through the Fetcher, from the param tier's
segments registered with CUDA, started ahead of use ([Note: unit fetches]); training matches plain
torch on the same GPU. Skipped without a GPU (the scheduling is tested on the CPU in
tests/offload/test_unit_fetch.py)."""
from __future__ import annotations

import pytest
import torch

from offload import initialize
from tests.offload import stage3_worker as w
from tests.offload.test_stage3 import _engine_run, _torch_run

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("param_device", ["cpu", "nvme"])
def test_stage3_through_the_fetcher_matches_torch(tmp_path, param_device):
    data = [(x.cuda(), y.cuda()) for x, y in w.batches(20)]
    ref = w.model().cuda()
    ref_losses = _torch_run(ref, data)
    net = w.model()
    engine, _, _, _ = initialize(model=net, config=w.config("cpu", param_device, str(tmp_path)))
    try:
        coordinator = engine.stage3.coordinator
        assert engine.device.type == "cuda" and coordinator._device is not None
        registration = engine.stage3.param_tier.registration
        assert registration is not None and registration.active and registration.ranges
        losses = _engine_run(engine, data)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        assert coordinator.stats().device_prefetches > 0
        with coordinator.gathered():
            for p, q in zip(net.parameters(), ref.parameters()):
                torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
    finally:
        engine.close()


@pytest.mark.parametrize("param_device", ["cpu", "nvme"])
def test_stage3_gradient_accumulation_on_the_gpu_matches_torch(tmp_path, param_device):
    """Two micro-batches per step on the GPU: each unit's gradient goes to the host on the D2H stream and
    the second micro-batch's is added to the first's in the fp32 accumulators (the first H100 run failed
    here adding a GPU tensor to a host one); 6 steps match torch on the same GPU to 1e-5."""
    from tests.offload.test_stage3_more import _config, _data, _engine_losses, _gpt, _torch_losses

    data = [ids.cuda() for ids in _data(6)]
    ref = _torch_losses(_gpt().cuda(), data, micro=2)
    config = _config("cpu", param_device, str(tmp_path))
    config["gradient_accumulation_steps"] = 2
    engine, _, _, _ = initialize(model=_gpt(), config=config)
    try:
        assert engine.device.type == "cuda" and engine.reducer._fetcher is not None
        losses = _engine_losses(engine, data, micro=2)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=0)
        assert engine.reducer._offloading == [] and len(engine.reducer._spare_hosts) >= 1
    finally:
        engine.close()
