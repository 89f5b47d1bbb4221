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
