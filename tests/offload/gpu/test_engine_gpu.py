"""The engine on a GPU: the equivalence tests' model and oracles with the model on CUDA, through the
GPU path (pinned-host registration, the copy streams, the delayed update). Skipped without a GPU.

Oracles run on the same GPU (so forward and backward are the same kernels): plain torch for fp32
(tolerances of ``test_equivalence``), ``run_mixed`` for bf16 (those of ``test_precision``).
"""
from __future__ import annotations

import pytest
import torch

from tests.offload.harness import (
    assert_losses_close, engine_config, make_batches, run_engine, run_mixed, run_torch, twin_models,
)
from tests.offload.test_delayed import run_torch_delayed

pytestmark = pytest.mark.cuda

STEPS = 30
BATCH = 8
BF16_TOL = 4 * 2.0 ** -7  # [Note: low-precision tolerance] in tests/offload/test_precision.py


def _cuda_batches(steps=STEPS):
    return [(x.cuda(), y.cuda()) for x, y in make_batches(steps, BATCH)]


@pytest.mark.parametrize("stage,device", [(0, "none"), (0, "cpu"), (1, "nvme"), (2, "cpu"), (2, "nvme")])
def test_fp32_on_the_gpu_matches_torch(stage, device, tmp_path):
    model, ref = twin_models()
    batches = _cuda_batches()
    engine_seen = {}
    losses, params = run_engine(model, engine_config(stage=stage, device=device, nvme_path=tmp_path), batches,
                                on_step=lambda e, i: engine_seen.setdefault("device", e.device))
    ref_losses, ref_params = run_torch(ref.cuda(), batches)
    assert engine_seen["device"].type == "cuda"
    assert_losses_close(losses, ref_losses, rel=1e-5)
    for name in params:
        torch.testing.assert_close(params[name], ref_params[name], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("stage,device", [(0, "cpu"), (2, "nvme")])
def test_bf16_on_the_gpu_matches_torch_mixed_precision(stage, device, tmp_path):
    model, ref = twin_models()
    batches = _cuda_batches()
    config = engine_config(stage=stage, device=device, nvme_path=tmp_path, bf16={"enabled": True})
    losses, params = run_engine(model, config, batches)
    ref_losses, ref_params, _ = run_mixed(ref.cuda(), batches, torch.bfloat16)
    assert_losses_close(losses, ref_losses, rel=BF16_TOL)
    for name in ref_params:
        diff = (params[name] - ref_params[name]).abs() / ref_params[name].abs().clamp_min(1.0)
        assert diff.max().item() <= BF16_TOL, name


@pytest.mark.parametrize("stage,device", [(0, "cpu"), (2, "nvme")])
def test_delayed_update_on_the_gpu_matches_the_hand_delayed_loop(stage, device, tmp_path):
    model, ref = twin_models()
    batches = _cuda_batches()
    config = engine_config(stage=stage, device=device, nvme_path=tmp_path,
                           offload={"delayed_update": True, "delayed_update_warmup_steps": 3})
    losses, params = run_engine(model, config, batches)
    ref_losses, ref_params, _ = run_torch_delayed(ref.cuda(), batches, warmup=3)
    assert_losses_close(losses, ref_losses, rel=1e-5)
    for name in params:
        torch.testing.assert_close(params[name], ref_params[name], msg=lambda m: f"{name}: {m}")


def test_the_tier_is_registered_and_the_copies_use_the_streams(tmp_path):
    from offload.builder import initialize

    model, _ = twin_models()
    engine, _, _, _ = initialize(model=model, config=engine_config(stage=2, device="cpu"))
    try:
        assert engine.tier.registration is not None and engine.tier.registration.active
        assert sum(engine.tier.registration.ranges.values()) >= sum(n for _, n in engine.tier.store.host_ranges())
        assert engine.reducer._fetcher is not None and engine.adam._fetcher is engine.reducer._fetcher
    finally:
        engine.close()
