"""Mixed precision, loss scaling, clipping and accumulation against torch.

[Note: low-precision tolerance] The oracle for bf16 and fp16 is plain torch doing what
the engine promises (``harness.run_mixed``): a bf16/fp16 copy of the model computes
forward and backward, ``torch.optim.AdamW`` steps fp32 masters on the unscaled gradients,
the masters are rounded back. While both hold the same low-precision params, their
forward and backward are the same arithmetic, so the losses agree exactly; the fp32
masters differ only by Adam's fp32 rounding (about 1e-7 relative, test_equivalence).
Such a difference changes a low-precision param only where the master lies that close to
a rounding midpoint, and then by one ulp of the format: 2^-7 relative for bf16 (8
significant bits), 2^-10 for fp16 (11 bits). A flip moves the loss by about that much
relative; later steps carry it on without growing it much in 50 steps, as training
pulls the runs to the same minimum. So the test allows 4 ulps of the format: 2^-5 (bf16)
or 2^-8 (fp16) relative in the loss at every step, and in every param (relative to
max(|p|, 1)). A precision bug (no unscaling, a missing copy back, a step on the wrong
gradient) moves the loss by tens of percent.
"""
from __future__ import annotations

import math

import pytest
import torch

from offload.precision import LossScaler, LossScalerConfig, clip_coefficient
from tests.offload.harness import (
    assert_losses_close, engine_config, make_batches, overflowing, run_engine, run_mixed, run_torch,
    twin_models,
)

STEPS = 50
BATCH = 8
ULPS = 4
ULP = {"bf16": 2.0 ** -7, "fp16": 2.0 ** -10}
DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


class DeepSpeedScaler:
    """DeepSpeed's dynamic loss scaler, written out from its semantics (the oracle for
    ``offload.precision.LossScaler``): on overflow, halve the scale once ``hysteresis``
    overflows have been spent, else spend one; after ``window`` steps without overflow,
    double it and refill the hysteresis."""

    def __init__(self, power: int = 16, window: int = 1000, hysteresis: int = 2, min_scale: float = 1.0) -> None:
        self.scale = 2.0 ** power
        self.window, self.hysteresis, self.min_scale = window, hysteresis, min_scale
        self.left = hysteresis
        self.iteration, self.last_overflow = 0, -1

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.left == 1:
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.left -= 1
            self.last_overflow = self.iteration
        elif (self.iteration - self.last_overflow) % self.window == 0:
            self.left = self.hysteresis
            self.scale *= 2
        self.iteration += 1


def _assert_params_close(ours: dict, theirs: dict, tol: float) -> None:
    for name in theirs:
        diff = (ours[name] - theirs[name]).abs() / theirs[name].abs().clamp_min(1.0)
        assert diff.max().item() <= tol, f"{name}: {diff.max().item():.3g} > {tol:.3g}"


@pytest.mark.parametrize("stage,device", [(0, "none"), (1, "cpu"), (2, "nvme")])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_matches_torch_mixed_precision(precision, stage, device, tmp_path):
    """bf16, and fp16 with dynamic loss scaling from 2^16: this model's gradients overflow
    fp16 at the first scales, so the run also shows the engine skipping the same steps and
    lowering the scale exactly as DeepSpeed's scaler does."""
    batches = make_batches(STEPS, BATCH)
    model, ref = twin_models()
    scaler = DeepSpeedScaler() if precision == "fp16" else None
    ref_losses, ref_params, ref_scales = run_mixed(ref, batches, DTYPE[precision], scaler=scaler)
    scales_after = []
    config = engine_config(stage=stage, device=device, nvme_path=tmp_path, **{precision: {"enabled": True}})
    losses, params = run_engine(model, config, batches, on_step=lambda e, i: scales_after.append(e.loss_scale))

    tol = ULPS * ULP[precision]  # [Note: low-precision tolerance]
    assert_losses_close(losses, ref_losses, rel=tol)
    _assert_params_close(params, ref_params, tol)
    assert losses[-1] < 0.5 * losses[0]
    if precision == "fp16":
        assert scales_after == ref_scales[1:] + [scaler.scale]
        assert ref_scales[-1] < ref_scales[0], "the run should have lowered the scale"


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_fp16_overflow_skips_the_step_and_lowers_the_scale(device, tmp_path):
    """Overflows at steps 3 and 4 (hysteresis 2: the first is absorbed, the second halves)
    and at 6 (the hysteresis is not refilled before a window passes: halves at once)."""
    overflow_steps = {3, 4, 6}
    batches = overflowing(make_batches(12, BATCH), overflow_steps)
    model, ref = twin_models()
    power = 8  # low enough that nothing but the forced overflows overflows
    scaler = DeepSpeedScaler(power=power)
    ref_losses, ref_params, ref_scales = run_mixed(ref, batches, torch.float16, scaler=scaler)
    assert [i for i in range(1, len(ref_scales)) if ref_scales[i] < ref_scales[i - 1]] == [5, 7]

    before: dict = {}
    record = []

    def snapshot(engine):
        masters = torch.cat([state.clone() for _, state in engine.adam.iter_states()])
        stats = engine.offload_stats()
        return (engine.flat_params.clone(), masters, stats.optimizer_steps, stats.skipped_steps, engine.loss_scale,
                engine.global_steps)

    def on_step(engine, step):
        now = snapshot(engine)
        prev = before.get("state")
        if prev is not None and step in overflow_steps:
            assert torch.equal(now[0], prev[0]), f"step {step}: params changed on overflow"
            assert torch.equal(now[1], prev[1]), f"step {step}: optimizer state changed on overflow"
            assert now[2] == prev[2] and now[3] == prev[3] + 1
            assert math.isinf(engine.get_global_grad_norm())
        elif prev is not None:
            assert not torch.equal(now[0], prev[0]) and now[2] == prev[2] + 1 and now[3] == prev[3]
        assert now[5] == step + 1
        record.append(now[4])
        before["state"] = now

    config = engine_config(stage=2, device=device, nvme_path=tmp_path,
                           fp16={"enabled": True, "initial_scale_power": power})
    losses, params = run_engine(model, config, batches, on_step=on_step)
    assert record == ref_scales[1:] + [scaler.scale]
    assert_losses_close(losses, ref_losses, rel=ULPS * ULP["fp16"])
    _assert_params_close(params, ref_params, ULPS * ULP["fp16"])


@pytest.mark.parametrize("stage,device", [(0, "cpu"), (1, "nvme"), (2, "cpu"), (2, "nvme")])
def test_gradient_clipping_matches_clip_grad_norm(stage, device, tmp_path):
    clip = 1.0
    batches = make_batches(STEPS, BATCH)
    model, ref = twin_models()
    ref_norms: list[float] = []
    ref_losses, ref_params = run_torch(ref, batches, clip=clip, norms_out=ref_norms)
    norms = []
    config = engine_config(stage=stage, device=device, nvme_path=tmp_path, gradient_clipping=clip)
    losses, params = run_engine(model, config, batches, on_step=lambda e, i: norms.append(e.get_global_grad_norm()))

    assert sum(n > clip for n in ref_norms) >= STEPS // 2, "clipping should act on most steps"
    assert_losses_close(losses, ref_losses, rel=1e-5)
    assert_losses_close(norms, ref_norms, rel=1e-5)
    for name in ref_params:
        torch.testing.assert_close(params[name], ref_params[name], msg=lambda m: f"{name}: {m}")


def test_clipping_under_fp16_uses_the_unscaled_norm(tmp_path):
    clip = 1.0
    batches = make_batches(STEPS, BATCH)
    model, ref = twin_models()
    scaler = DeepSpeedScaler(power=8)
    ref_losses, ref_params, _ = run_mixed(ref, batches, torch.float16, scaler=scaler, clip=clip)
    config = engine_config(stage=2, device="cpu", fp16={"enabled": True, "initial_scale_power": 8},
                           gradient_clipping=clip)
    losses, params = run_engine(model, config, batches)
    assert_losses_close(losses, ref_losses, rel=ULPS * ULP["fp16"])
    _assert_params_close(params, ref_params, ULPS * ULP["fp16"])


@pytest.mark.parametrize("stage,device,clip", [(0, "none", 0.0), (1, "cpu", 0.0), (2, "cpu", 0.0), (2, "nvme", 0.0),
                                               (1, "nvme", 1.0), (2, "cpu", 1.0)])
def test_gradient_accumulation_matches_a_hand_accumulated_loop(stage, device, clip, tmp_path):
    """Adam barely sees a gradient's scale, so the gradient norm (the accumulated gradient's,
    before clipping) is checked too, and some runs clip by it."""
    gas, micro, steps = 4, 4, 20
    batches = make_batches(steps, gas * micro)
    model, ref = twin_models()
    ref_norms: list[float] = []
    ref_losses, ref_params = run_torch(ref, batches, gas=gas, clip=clip or math.inf, norms_out=ref_norms)
    norms, boundaries = [], []

    def on_step(engine, step):
        assert engine.global_steps == step + 1 and engine.offload_stats().optimizer_steps == step + 1
        boundaries.append(engine.is_gradient_accumulation_boundary())
        norms.append(engine.get_global_grad_norm())

    config = engine_config(stage=stage, device=device, nvme_path=tmp_path, batch_size=micro, gas=gas,
                           gradient_clipping=clip)
    losses, params = run_engine(model, config, batches, gas=gas, on_step=on_step)
    assert_losses_close(norms, ref_norms, rel=1e-5)
    assert_losses_close(losses, ref_losses, rel=1e-5)
    for name in ref_params:
        torch.testing.assert_close(params[name], ref_params[name], msg=lambda m: f"{name}: {m}")
    assert not any(boundaries), "after a boundary step the next micro-step is not a boundary"
    if clip:
        assert sum(n > clip for n in ref_norms) >= steps // 2, "clipping should act on most steps"


# (overflow?, the scale after the update), window 3, hysteresis 2, from 2^4, by DeepSpeed's rule: the
# scale doubles at the window-th clean step since the last overflow (or since the start), refilling the
# hysteresis; an overflow spends one hysteresis, and halves the scale when only one is left.
SCHEDULE = [(False, 16), (False, 16), (False, 32),  # the third clean step since the start doubles
            (True, 32),  # hysteresis 2 -> 1: kept
            (False, 32), (False, 32), (False, 64),  # the third clean step after the overflow doubles, refills
            (True, 64), (True, 32),  # 2 -> 1 kept, then halved
            (False, 32), (False, 32), (False, 64), (False, 64), (False, 64), (False, 128)]


def test_loss_scale_follows_deepspeeds_schedule_step_by_step():
    """The dynamic scale after every update, against the schedule written out by hand and the
    DeepSpeed scaler above; a window of 3 so that the doubling's step is pinned several times."""
    ours = LossScaler(LossScalerConfig(initial_scale_power=4, window_steps=3, hysteresis=2))
    oracle = DeepSpeedScaler(power=4, window=3, hysteresis=2)
    for i, (overflow, expected) in enumerate(SCHEDULE):
        ours.update(overflow)
        oracle.update(overflow)
        assert (ours.scale, oracle.scale) == (expected, expected), f"after update {i} (overflow {overflow})"


def test_loss_scale_window_counts_from_the_last_overflow_after_a_resume():
    """The schedule carries across state_dict / load_state_dict: a scaler restored mid-window doubles
    at the same step as the one that ran on."""
    config = LossScalerConfig(initial_scale_power=4, window_steps=3, hysteresis=2)
    ran, restored = LossScaler(config), LossScaler(config)
    for overflow, _ in SCHEDULE[:8]:
        ran.update(overflow)
    restored.load_state_dict(ran.state_dict())
    for i, (overflow, expected) in enumerate(SCHEDULE[8:], start=8):
        ran.update(overflow)
        restored.update(overflow)
        assert (ran.scale, restored.scale) == (expected, expected), f"after update {i}"


@pytest.mark.parametrize("norm", [0.0, 0.25, 0.999, 1.0, 1.5, 40.0, math.inf, math.nan])
def test_clip_coefficient_is_clip_grad_norms(norm):
    """Against torch's clip_grad_norm_ on a gradient of that norm: under the limit it scales by 1
    (never up), over it by max_norm / (norm + 1e-6); a non-finite norm leaves the step to the overflow check."""
    max_norm = 1.0
    coefficient = clip_coefficient(norm, max_norm)
    if not math.isfinite(norm):
        assert coefficient == 1.0
        return
    grad = torch.zeros(4, dtype=torch.float64)
    grad[0] = norm
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    p.grad = grad.clone()
    torch.nn.utils.clip_grad_norm_([p], max_norm)
    assert coefficient <= 1.0
    assert math.isclose(p.grad[0].item(), norm * coefficient, rel_tol=1e-12, abs_tol=1e-300)


@pytest.mark.parametrize("stage,device", [(2, "cpu"), (1, "nvme")])
def test_clipping_that_never_binds_changes_nothing(stage, device, tmp_path):
    """A limit above every step's norm: the run equals torch with the same (idle) clip_grad_norm_."""
    clip = 50.0
    batches = make_batches(20, BATCH)
    model, ref = twin_models()
    ref_norms: list[float] = []
    ref_losses, ref_params = run_torch(ref, batches, clip=clip, norms_out=ref_norms)
    assert max(ref_norms) < clip / 2, "the limit should never bind"
    config = engine_config(stage=stage, device=device, nvme_path=tmp_path, gradient_clipping=clip)
    losses, params = run_engine(model, config, batches)
    assert_losses_close(losses, ref_losses, rel=1e-5)
    for name in ref_params:
        torch.testing.assert_close(params[name], ref_params[name], msg=lambda m: f"{name}: {m}")
