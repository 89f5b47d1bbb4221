"""``offload_optimizer.ratio`` 0.5 with the model on a GPU ([Note: GPU-resident share] in
offload.zero.device_share): the kept half's state on the GPU, its buckets never copied to the host, stepped by
torch's fused AdamW; against torch, and the overlapped split against the serial one bit for bit. Skipped
without a GPU."""
from __future__ import annotations

import pytest
import torch

from offload.gpu.transfers import Fetcher
from tests.offload.harness import assert_matches_torch, engine_config, make_batches, run_engine, twin_models

pytestmark = pytest.mark.cuda

STEPS = 20
BATCH = 8
CLIP = 6.5  # as in tests/offload/test_overlap.py: some steps clip, some do not


def _run(monkeypatch, overlap, stage, device, tmp_path, clip, param="none"):
    offloaded: list[int] = []
    start = Fetcher.start_offload

    def logged(self, pairs):
        offloaded.extend(src.data_ptr() for _, src in pairs)
        return start(self, pairs)

    monkeypatch.setattr(Fetcher, "start_offload", logged)
    model, _ = twin_models()
    batches = [(x.cuda(), y.cuda()) for x, y in make_batches(STEPS, BATCH)]
    config = engine_config(stage=stage, device=device, nvme_path=tmp_path, gradient_clipping=clip,
                           offload={"overlap_step": overlap})
    config["zero_optimization"]["offload_optimizer"]["ratio"] = 0.5
    if param != "none":
        config["zero_optimization"]["offload_param"] = {"device": param}
    seen = {}

    def inspect(engine, step):
        storage = engine.adam.storage
        seen["kept"] = storage.on_device
        seen["on_gpu"] = all(storage.state(i).is_cuda and storage.grad(i).is_cuda for i in storage.on_device)
        kept_buckets = {p.bucket for i in storage.on_device for p in engine.layout.sub_groups[i].pieces}
        whole = {b for b in kept_buckets if all(sg.index in storage.on_device for sg in engine.layout.sub_groups
                                                 for p in sg.pieces if p.bucket == b)}
        seen["offloaded_units"] = len(engine.layout.buckets) - len(whole)  # what one backward sends to the host
        if stage < 3:
            grads = engine.reducer.flat_grads
            seen["kept_ptrs"] = {grads[engine.layout.buckets[b].start:].data_ptr() for b in whole}

    losses, params = run_engine(model, config, batches, on_step=inspect)
    return losses, params, seen, offloaded


@pytest.mark.parametrize("stage,device,clip", [(1, "cpu", 0.0), (2, "cpu", CLIP), (2, "nvme", 0.0)])
def test_the_split_on_the_gpu_matches_torch_and_the_serial_split(monkeypatch, stage, device, clip, tmp_path):
    losses, params, seen, offloaded = _run(monkeypatch, "auto", stage, device, tmp_path, clip)
    assert seen["kept"] and seen["on_gpu"]
    assert offloaded and seen["kept_ptrs"] and not seen["kept_ptrs"] & set(offloaded)  # the kept never leave
    assert_matches_torch(losses, params, make_batches(STEPS, BATCH), clip=clip, device="cuda")
    serial_losses, serial_params, _, _ = _run(monkeypatch, False, stage, device, tmp_path, clip)
    assert losses == serial_losses
    for name in params:
        assert torch.equal(params[name], serial_params[name]), name


def test_auto_on_a_gpu_with_room_keeps_the_whole_state_there(tmp_path):
    """The tiny model's state fits many times in what an H100/H200 has free beyond half of it: "auto" keeps all
    of it, which is offload_optimizer none (no tier opened)."""
    model, _ = twin_models()
    config = engine_config(stage=1, device="cpu", batch_size=BATCH)
    config["zero_optimization"]["offload_optimizer"]["ratio"] = "auto"
    seen = {}
    run_engine(model, config, [(x.cuda(), y.cuda()) for x, y in make_batches(2, BATCH)],
               on_step=lambda e, i: seen.update(tier=e.tier, device=e.adam.storage.bytes_by_tier()["device"]))
    assert seen["tier"] is None and seen["device"] > 0


@pytest.mark.parametrize("device,param", [("cpu", "none"), ("cpu", "cpu"), ("nvme", "cpu")])
def test_the_split_at_stage_3_on_the_gpu_matches_torch(monkeypatch, device, param, tmp_path):
    """DeepSpeed's place for the key: the kept units' gradients land from the GPU (one D2H copy a backward for
    each other unit only), their params written into their shards (on the host with offload_param cpu)."""
    losses, params, seen, offloaded = _run(monkeypatch, "auto", 3, device, tmp_path, 0.0, param=param)
    assert seen["kept"] and seen["on_gpu"]
    assert 0 < seen["offloaded_units"] and len(offloaded) == STEPS * seen["offloaded_units"]
    assert_matches_torch(losses, params, make_batches(STEPS, BATCH), device="cuda")
