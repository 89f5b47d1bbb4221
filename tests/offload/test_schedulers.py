"""The config's "scheduler" section against DeepSpeed's LR schedules, written out here.

DeepSpeed's engine builds the scheduler (which sets the optimizer's LR to the schedule's
value before its first step: ``last_batch_iteration`` -1) and calls ``scheduler.step()``
after every optimizer step that is not skipped for an fp16 overflow. So the LR that
optimizer step k (from 0) uses is ``lr(k - 1)`` below, with ``lr(-1)`` the start value.
Each test checks ``engine.get_lr()`` before every step against that, and that the LR
reaches Adam: the same run in plain torch with the LR set by hand matches to 1e-5.
"""
from __future__ import annotations

import math

import pytest

from tests.offload.harness import (
    LR, assert_losses_close, engine_config, make_batches, overflowing, run_engine, run_torch, twin_models,
)


def warmup_gamma(it: int, warmup: int, kind: str) -> float:
    """DeepSpeed's warmup progress after ``it`` scheduler steps (it < warmup)."""
    warmup = max(2, warmup)
    return math.log(it + 1) / math.log(warmup) if kind == "log" else it / warmup


def warmup_lr(it: int, p: dict) -> float:
    """WarmupLR: min -> max over the warmup, then max."""
    lo, hi, warmup = p["warmup_min_lr"], p["warmup_max_lr"], max(2, p["warmup_num_steps"])
    if it < 0:
        return lo
    gamma = warmup_gamma(it, warmup, p["warmup_type"]) if it < warmup else 1.0
    return lo + (hi - lo) * gamma


def warmup_decay_lr(it: int, p: dict) -> float:
    """WarmupDecayLR: WarmupLR, then linear from max to 0 at total_num_steps."""
    lo, hi, warmup, total = p["warmup_min_lr"], p["warmup_max_lr"], max(2, p["warmup_num_steps"]), p["total_num_steps"]
    if it < 0:
        return lo
    if it < warmup:
        gamma = warmup_gamma(it, warmup, p["warmup_type"])
    else:
        gamma = max(0.0, (total - it) / max(1.0, total - warmup))
    return lo + (hi - lo) * gamma


def warmup_cosine_lr(it: int, p: dict) -> float:
    """WarmupCosineLR: a ratio of the optimizer's LR, warmup_min_ratio -> 1, then a cosine to
    cos_min_ratio at total_num_steps (DeepSpeed counts the cosine from warmup - 1)."""
    warmup, total = max(2, p["warmup_num_steps"]), p["total_num_steps"]
    lo = p["warmup_min_ratio"]
    if it < 0:
        return LR * lo
    if it < warmup:
        return LR * (lo + (1.0 - lo) * warmup_gamma(it, warmup, p["warmup_type"]))
    cosine = (1 + math.cos(math.pi * (it - warmup + 1) / (total - warmup))) / 2
    return LR * max(0.0, p["cos_min_ratio"] + (1.0 - p["cos_min_ratio"]) * cosine)


SCHEDULES = {
    "WarmupLR log": ("WarmupLR", warmup_lr, 20, {"warmup_min_lr": 1e-4, "warmup_max_lr": 2e-2,
                                                 "warmup_num_steps": 10, "warmup_type": "log"}),
    "WarmupLR linear": ("WarmupLR", warmup_lr, 20, {"warmup_min_lr": 1e-4, "warmup_max_lr": 2e-2,
                                                    "warmup_num_steps": 10, "warmup_type": "linear"}),
    "WarmupDecayLR log": ("WarmupDecayLR", warmup_decay_lr, 24, {
        "warmup_min_lr": 0.0, "warmup_max_lr": 2e-2, "warmup_num_steps": 6, "warmup_type": "log",
        "total_num_steps": 20}),
    "WarmupDecayLR linear": ("WarmupDecayLR", warmup_decay_lr, 24, {
        "warmup_min_lr": 1e-3, "warmup_max_lr": 2e-2, "warmup_num_steps": 6, "warmup_type": "linear",
        "total_num_steps": 20}),
    "WarmupCosineLR log": ("WarmupCosineLR", warmup_cosine_lr, 21, {
        "warmup_min_ratio": 0.1, "warmup_num_steps": 5, "cos_min_ratio": 0.01, "warmup_type": "log",
        "total_num_steps": 20}),
    "WarmupCosineLR linear": ("WarmupCosineLR", warmup_cosine_lr, 21, {
        "warmup_min_ratio": 0.0, "warmup_num_steps": 5, "cos_min_ratio": 0.05, "warmup_type": "linear",
        "total_num_steps": 20}),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedule_matches_deepspeed(name, tmp_path):
    kind, formula, steps, params = SCHEDULES[name]
    expected = [formula(k - 1, params) for k in range(steps)]
    assert len(set(expected)) >= 5, "the schedule should move"
    model, ref = twin_models()
    batches = make_batches(steps, 8)
    lrs: list[list[float]] = []
    config = engine_config(stage=2, device="cpu", nvme_path=tmp_path, scheduler={"type": kind, "params": params})
    losses, params_out = run_engine(model, config, batches, lrs_out=lrs)

    for k, (got, want) in enumerate(zip(lrs, expected)):
        assert got == pytest.approx([want, want], rel=1e-12, abs=1e-15), f"step {k}: {got} != {want}"
    ref_losses, _ = run_torch(ref, batches, lr_at=lambda k: expected[k])
    assert_losses_close(losses, ref_losses, rel=1e-5)


def test_warmup_lr_defaults_to_the_optimizer_lr():
    """DeepSpeed's WarmupLR warms up to the optimizer's lr when warmup_max_lr is not given."""
    params = {"warmup_min_lr": 0.0, "warmup_num_steps": 4, "warmup_type": "linear"}
    model, _ = twin_models()
    lrs: list[list[float]] = []
    run_engine(model, engine_config(scheduler={"type": "WarmupLR", "params": params}), make_batches(6, 8), lrs_out=lrs)
    assert [lr[0] for lr in lrs] == pytest.approx([warmup_lr(k - 1, params | {"warmup_max_lr": LR})
                                                   for k in range(6)])


def test_skipped_steps_do_not_advance_the_schedule(tmp_path):
    """An fp16 overflow skips the step and, as in DeepSpeed, does not step the scheduler."""
    params = {"warmup_min_lr": 1e-4, "warmup_max_lr": 2e-2, "warmup_num_steps": 8, "warmup_type": "linear"}
    skipped = {2, 3, 6}
    batches = overflowing(make_batches(10, 8), skipped)
    lrs: list[list[float]] = []
    config = engine_config(stage=1, device="nvme", nvme_path=tmp_path, fp16={"enabled": True, "initial_scale_power": 8},
                           scheduler={"type": "WarmupLR", "params": params})
    model, _ = twin_models()
    run_engine(model, config, batches, lrs_out=lrs)
    taken = [sum(1 for j in range(k) if j not in skipped) for k in range(10)]  # steps taken before step k
    assert [lr[0] for lr in lrs] == pytest.approx([warmup_lr(t - 1, params) for t in taken], rel=1e-12)
