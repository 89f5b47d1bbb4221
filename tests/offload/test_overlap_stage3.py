"""[Note: early steps at stage 3] in offload.zero.overlap: ``offload.overlap_step`` true at stage 3 steps the
sub-groups whose units' gradients have all landed under backward, their new params held in buffers of their own
until the verdict, then written into the shards. Oracle: the same run with the overlap off, bit for bit, through
rollbacks (clipping); torch."""
from __future__ import annotations

import logging

import pytest
import torch

from offload.builder import initialize
from tests.offload.harness import (
    assert_matches_torch, engine_config, make_batches, param_groups, run_engine, twin_models,
)

STEPS = 12
BATCH = 8
CLIP = 6.5  # some steps of this model clip at batch 8, some do not (tests/offload/test_overlap.py)
CLIP_GAS2 = 5.0  # the same at 2 micro-batches of 8


@pytest.fixture(autouse=True)
def window_at_buffer_count(monkeypatch):
    monkeypatch.setattr("offload.plan.budget.available_bytes", lambda: None)


def _config(tmp_path, overlap, *, device, param, clip=0.0, gas=1, **offload):
    config = engine_config(stage=3, device=device, nvme_path=tmp_path, batch_size=BATCH, gas=gas,
                           gradient_clipping=clip, offload={"overlap_step": overlap, **offload})
    config["zero_optimization"]["sub_group_size"] = 300  # several sub-groups of the tiny model
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every param in a unit with shards
    if param != "none":
        config["zero_optimization"]["offload_param"] = {"device": param, **({"nvme_path": str(tmp_path)}
                                                                            if param == "nvme" else {})}
    return config


def _run(tmp_path, overlap, **kw):
    model, _ = twin_models()
    seen = {}
    gas = kw.get("gas", 1)
    losses, params = run_engine(model, _config(tmp_path, overlap, **kw), make_batches(STEPS, BATCH * gas), gas=gas,
                                on_step=lambda engine, step: seen.update(overlap=engine.overlap))
    return losses, params, seen["overlap"]


@pytest.mark.parametrize("device,param,clip,gas", [
    ("cpu", "none", 0.0, 1), ("cpu", "cpu", CLIP, 1), ("nvme", "cpu", 0.0, 2), ("cpu", "nvme", CLIP_GAS2, 2),
])
def test_stage_3_overlapped_is_the_serial_step_bit_for_bit(tmp_path, device, param, clip, gas):
    losses, params, overlap = _run(tmp_path, True, device=device, param=param, clip=clip, gas=gas)
    serial_losses, serial_params, serial = _run(tmp_path, False, device=device, param=param, clip=clip, gas=gas)
    assert serial is None and overlap is not None and overlap.early_sub_groups > 0
    if clip:
        assert overlap.rollbacks > 0  # undone speculations left the shards as they were
    assert losses == serial_losses
    for name in params:
        assert torch.equal(params[name], serial_params[name]), name
    if gas == 1:
        assert_matches_torch(losses, params, make_batches(STEPS, BATCH), clip=clip)


def test_with_the_accumulators_on_nvme_it_stays_off_and_says_so(tmp_path, caplog):
    model, _ = twin_models()
    config = _config(tmp_path, True, device="nvme", param="cpu", gradient_tier="nvme")
    with caplog.at_level(logging.WARNING):
        engine, _, _, _ = initialize(model=model, config=config, model_parameters=param_groups(model))
    try:
        assert engine.overlap is None and "gradient accumulators on NVMe" in caplog.text
    finally:
        engine.close()
