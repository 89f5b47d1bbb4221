"""``offload.overlap_step``: sub-groups stepped while backward runs ([Note: overlapped step] in
``offload.zero.overlap``), against torch and against the engine's ordinary step.

Two oracles: plain torch (fp32: ``run_torch``, the tolerances of test_equivalence; bf16/fp16:
``run_mixed``, those of test_precision), and the same engine with the overlap off, which the
overlapped step must match bit for bit (the speculation either holds with the very multiplier
and plan of the ordinary step, or is undone exactly). Every run also shows that the overlap
did something: sub-groups stepped early, and where the test is about it, early steps undone.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from csrc import ConfigError
from offload.builder import initialize
from tests.offload.harness import (
    assert_losses_close, engine_config, loss_fn, make_batches, overflowing, param_groups, run_engine, run_mixed,
    run_torch, twin_models,
)
from tests.offload.test_precision import ULP, ULPS, DeepSpeedScaler, _assert_params_close

STEPS = 20
BATCH = 8
# With this model's gradient norms (about 5 to 8.5 at batch 8, 3 to 6 at 16), these clip some steps
# and not others, and the first sub-groups' partial norm stays under them: some speculations
# hold, some are undone.
CLIP = 6.5
CLIP_GAS2 = 5.0
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def window_at_buffer_count(monkeypatch):
    """The NVMe window at buffer_count (2), as in test_equivalence: blocks are evicted and fetched
    within the step, and at most one is stepped early."""
    monkeypatch.setattr("offload.plan.budget.available_bytes", lambda: None)


def _run(overlap, *, stage=0, device="cpu", tmp_path=None, gas=1, clip=0.0, batches=None, hook=None, **top):
    model, _ = twin_models()
    if hook is not None:
        hook(model)
    config = engine_config(stage=stage, device=device, nvme_path=tmp_path, batch_size=BATCH, gas=gas,
                           gradient_clipping=clip, offload={"overlap_step": overlap}, **top)
    seen: dict = {"norms": []}

    def inspect(engine, step):
        seen["norms"].append(engine.get_global_grad_norm())
        seen["stats"] = engine.offload_stats()
        seen["overlap"] = engine.overlap

    batches = batches if batches is not None else make_batches(STEPS, BATCH * gas)
    losses, params = run_engine(model, config, batches, gas=gas, on_step=inspect)
    return losses, params, seen


def _assert_same(ours: dict, theirs: dict) -> None:
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), f"{name}: differs from the ordinary step"


@pytest.mark.parametrize("stage,device,gas,clip", [(0, "cpu", 1, 0.0), (1, "nvme", 1, 0.0), (2, "cpu", 2, 0.0),
                                                   (2, "nvme", 2, 0.0), (1, "cpu", 1, CLIP), (2, "nvme", 2, CLIP_GAS2)])
def test_fp32_matches_torch_and_the_ordinary_step(stage, device, gas, clip, tmp_path):
    batches = make_batches(STEPS, BATCH * gas)
    losses, params, seen = _run(True, stage=stage, device=device, tmp_path=tmp_path, gas=gas, clip=clip,
                                batches=batches)
    _, ref = twin_models()
    ref_norms: list[float] = []
    ref_losses, ref_params = run_torch(ref, batches, gas=gas, clip=clip, norms_out=ref_norms)
    assert_losses_close(losses, ref_losses, rel=1e-5)
    for name in ref_params:
        torch.testing.assert_close(params[name], ref_params[name], msg=lambda m: f"{name}: {m}")
    plain_losses, plain_params, _ = _run(False, stage=stage, device=device, tmp_path=tmp_path, gas=gas, clip=clip,
                                         batches=batches)
    assert losses == plain_losses
    _assert_same(params, plain_params)
    overlap, stats = seen["overlap"], seen["stats"]
    assert overlap.early_sub_groups > 0 and stats.step_seconds_under_backward_total > 0
    assert stats.sub_groups_stepped_early_total == overlap.early_sub_groups
    assert stats.optimizer_steps == STEPS and stats.skipped_steps == 0
    if clip:  # some steps clipped after sub-groups were stepped early: undone, and the result still exact
        clipped = sum(n > clip for n in ref_norms)
        assert 0 < clipped < STEPS
        assert overlap.rollbacks > 0 and stats.overlap_rollbacks == overlap.rollbacks
    else:
        assert overlap.rollbacks == 0


@pytest.mark.parametrize("clip", [0.0, CLIP])
@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_bf16_matches_torch_mixed_precision_and_the_ordinary_step(device, clip, tmp_path):
    batches = make_batches(STEPS, BATCH)
    losses, params, seen = _run(True, stage=1, device=device, tmp_path=tmp_path, clip=clip, batches=batches,
                                bf16={"enabled": True})
    _, ref = twin_models()
    ref_losses, ref_params, _ = run_mixed(ref, batches, torch.bfloat16, clip=clip)
    tol = ULPS * ULP["bf16"]  # [Note: low-precision tolerance] in test_precision
    assert_losses_close(losses, ref_losses, rel=tol)
    _assert_params_close(params, ref_params, tol)
    plain_losses, plain_params, _ = _run(False, stage=1, device=device, tmp_path=tmp_path, clip=clip,
                                         batches=batches, bf16={"enabled": True})
    assert losses == plain_losses
    _assert_same(params, plain_params)
    assert seen["overlap"].early_sub_groups > 0


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_fp16_overflow_steps_match_torch_and_the_ordinary_step(device, tmp_path):
    """Overflows at the model's output (the first bucket to land): the partial norm is not finite
    before any sub-group is complete, so those steps speculate nothing; the others do."""
    overflow_steps = {3, 4, 6}
    batches = overflowing(make_batches(12, BATCH), overflow_steps)
    fp16 = {"enabled": True, "initial_scale_power": 8}
    losses, params, seen = _run(True, stage=2, device=device, tmp_path=tmp_path, batches=batches, fp16=fp16)
    _, ref = twin_models()
    ref_losses, ref_params, _ = run_mixed(ref, batches, torch.float16, scaler=DeepSpeedScaler(power=8))
    assert_losses_close(losses, ref_losses, rel=ULPS * ULP["fp16"])
    _assert_params_close(params, ref_params, ULPS * ULP["fp16"])
    plain_losses, plain_params, _ = _run(False, stage=2, device=device, tmp_path=tmp_path, batches=batches, fp16=fp16)
    assert losses == plain_losses
    _assert_same(params, plain_params)
    assert seen["stats"].skipped_steps == len(overflow_steps)
    assert seen["overlap"].early_sub_groups > 0 and seen["overlap"].rollbacks == 0


def _poison_first_layer(at_steps: set[int]):
    """A hook that makes fc1.weight's gradient infinite at the backward of the given steps: fc1 is
    the last bucket to land, so sub-groups are stepped early before the overflow shows."""
    def install(model):
        calls = {"n": 0}

        def poison(param):
            if calls["n"] in at_steps:
                param.grad.fill_(float("inf"))
            calls["n"] += 1
        model.fc1.weight.register_post_accumulate_grad_hook(poison)  # before the engine's hooks
    return install


@pytest.mark.parametrize("precision,device", [("bf16", "cpu"), ("fp16", "cpu"), ("fp16", "nvme"), ("fp32", "nvme")])
def test_overflow_after_early_steps_is_rolled_back(precision, device, tmp_path):
    """The step is skipped after sub-groups were stepped under backward: they are undone exactly.
    Oracle for bf16/fp32: torch over the same batches without the skipped steps."""
    skipped = {2, 5}
    top = {precision: {"enabled": True, "initial_scale_power": 8}} if precision == "fp16" else \
        {precision: {"enabled": True}} if precision == "bf16" else {}
    batches = make_batches(10, BATCH)
    losses, params, seen = _run(True, device=device, tmp_path=tmp_path, batches=batches,
                                hook=_poison_first_layer(skipped), **top)
    plain_losses, plain_params, _ = _run(False, device=device, tmp_path=tmp_path, batches=batches,
                                         hook=_poison_first_layer(skipped), **top)
    assert losses == plain_losses
    _assert_same(params, plain_params)
    overlap, stats = seen["overlap"], seen["stats"]
    assert stats.skipped_steps == len(skipped) and overlap.rollbacks == len(skipped) > 0
    assert [i for i, n in enumerate(seen["norms"]) if n == float("inf")] == sorted(skipped)
    if precision == "fp16":
        return  # its oracle is the ordinary step above (the scale schedule differs from a run without the steps)
    kept = [b for i, b in enumerate(batches) if i not in skipped]
    _, ref = twin_models()
    if precision == "bf16":
        ref_losses, ref_params, _ = run_mixed(ref, kept, torch.bfloat16)
        tol = ULPS * ULP["bf16"]
        assert_losses_close([x for i, x in enumerate(losses) if i not in skipped], ref_losses, rel=tol)
        _assert_params_close(params, ref_params, tol)
    else:
        ref_losses, ref_params = run_torch(ref, kept)
        assert_losses_close([x for i, x in enumerate(losses) if i not in skipped], ref_losses, rel=1e-5)
        for name in ref_params:
            torch.testing.assert_close(params[name], ref_params[name], msg=lambda m: f"{name}: {m}")


def test_a_boundary_without_step_is_undone(tmp_path):
    """backward at a boundary, then a checkpoint load instead of step(): the early steps are undone."""
    model, _ = twin_models()
    config = engine_config(stage=1, device="cpu", batch_size=BATCH, offload={"overlap_step": True})
    engine, _, _, _ = initialize(model=model, config=config, model_parameters=param_groups(model))
    try:
        before = torch.cat([s.clone() for _, s in engine.adam.iter_states()])
        x, y = make_batches(1, BATCH)[0]
        engine.backward(loss_fn(engine(x), y))
        assert engine.overlap._eager, "sub-groups should have been stepped under backward"
        engine.overlap.cancel()
        after = torch.cat([s.clone() for _, s in engine.adam.iter_states()])
        assert torch.equal(before, after)
        assert engine.overlap.rollbacks == 1
    finally:
        engine.close()


def _lr_changed_between_backward_and_step(overlap):
    """A loop that sets a new LR after backward, before step(): the early steps used the old one."""
    model, _ = twin_models()
    config = engine_config(stage=1, device="cpu", batch_size=BATCH, offload={"overlap_step": overlap})
    engine, _, _, _ = initialize(model=model, config=config, model_parameters=param_groups(model))
    try:
        for i, (x, y) in enumerate(make_batches(6, BATCH)):
            engine.backward(loss_fn(engine(x), y))
            for g in engine.optimizer.param_groups:
                g["lr"] = 1e-2 / (i + 1)
            engine.step()
        return {n: p.detach().clone() for n, p in model.named_parameters()}, engine.overlap
    finally:
        engine.close()


def test_a_hyperparameter_changed_after_backward_undoes_the_early_steps():
    params, overlap = _lr_changed_between_backward_and_step(True)
    plain, _ = _lr_changed_between_backward_and_step(False)
    _assert_same(params, plain)
    # steps 1-5 undone; step 0 sets the LR it started with, so its early sub-groups are kept
    assert overlap.rollbacks == 5 and 0 < overlap.early_sub_groups <= overlap.max_copies


def test_rollback_copies_are_bounded_by_the_memory_available(monkeypatch):
    """Room for three sub-groups' copies in the window's share (1/2) of what is available: at most three
    sub-groups are stepped early in a step, and three buffers are all the copies ever held."""
    block = 3 * 4 * 512  # bytes of one sub-group's state (SUB_GROUP_NUMEL elements)
    monkeypatch.setattr("offload.plan.budget.available_bytes", lambda: 2 * 3 * block)
    early_per_step, seen = [], {}

    def inspect(engine, step):
        total = engine.overlap.early_sub_groups
        early_per_step.append(total - seen.get("total", 0))
        seen.update(total=total, overlap=engine.overlap, sub_groups=len(engine.layout.sub_groups))

    config = engine_config(stage=0, device="cpu", batch_size=BATCH, offload={"overlap_step": True})
    model, _ = twin_models()
    run_engine(model, config, make_batches(6, BATCH), on_step=inspect)
    assert seen["overlap"].max_copies == 3 < seen["sub_groups"] - 1
    assert max(early_per_step) == 3 and len(seen["overlap"]._copies) == 3


@pytest.mark.parametrize("buffer_count", [2, 3])
def test_with_nvme_the_early_steps_leave_one_slot_of_the_window(buffer_count, tmp_path):
    """With nvme the early sub-groups stay in host memory until the verdict: at most ``window - 1`` of
    them per step, so one slot is left for the rest of the step to pipeline through. The prefetch
    at the boundary fills the window, so that many are stepped early at every step (never the whole
    window); the result is the ordinary step's."""
    early_per_step, seen = [], {}

    def inspect(engine, step):
        total = engine.overlap.early_sub_groups
        early_per_step.append(total - seen.get("total", 0))
        seen.update(total=total, window=engine.adam.storage.window, sub_groups=len(engine.layout.sub_groups))

    batches = make_batches(6, BATCH)
    results = []
    for overlap in (True, False):
        config = engine_config(stage=1, device="nvme", nvme_path=tmp_path, batch_size=BATCH,
                               offload={"overlap_step": overlap})
        config["zero_optimization"]["offload_optimizer"]["buffer_count"] = buffer_count
        model, _ = twin_models()
        results.append(run_engine(model, config, batches, on_step=inspect if overlap else None))
    assert seen["window"] == buffer_count < seen["sub_groups"]
    assert early_per_step == [buffer_count - 1] * len(batches)
    assert results[0][0] == results[1][0]
    _assert_same(results[0][1], results[1][1])


def test_wall_clock_breakdown_shows_the_step_under_backward(caplog):
    config = engine_config(stage=0, device="cpu", batch_size=BATCH, offload={"overlap_step": True},
                           wall_clock_breakdown=True, steps_per_print=5)
    model, _ = twin_models()
    with caplog.at_level(logging.INFO, logger="offload.engine"):
        run_engine(model, config, make_batches(5, BATCH))
    assert any("step under backward" in r.getMessage() for r in caplog.records)


# -- two ranks (gloo) -------------------------------------------------------------------------

RANK_RUNS = ["0:cpu:6.5", "1:nvme:0", "2:cpu:0", "2:nvme:6.5"]


def test_two_ranks_match_the_ordinary_step_and_torch(tmp_path):
    """Each rank's params with the overlap equal its params without (bit for bit), and torch's."""
    out, nvme = tmp_path / "out", tmp_path / "nvme"
    out.mkdir()
    nvme.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    env.pop("OFFLOAD_DAEMON_SOCKET", None)
    steps = 12
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(Path(__file__).with_name("overlap_worker.py")), str(out), str(nvme), str(steps), str(BATCH), *RANK_RUNS]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    for run in RANK_RUNS:
        clip = float(run.split(":")[2])
        _, ref = twin_models()
        _, ref_params = run_torch(ref, make_batches(steps, BATCH), clip=clip)
        for rank in (0, 1):
            on = torch.load(out / f"params_{run}_True_rank{rank}.pt")
            off = torch.load(out / f"params_{run}_False_rank{rank}.pt")
            _assert_same(on, off)
            for name in ref_params:
                torch.testing.assert_close(on[name], ref_params[name], msg=lambda m: f"{run} {name}: {m}")
    counters = [json.loads((out / f"counters_rank{r}.json").read_text()) for r in (0, 1)]
    assert all(c[run]["on"] for c in counters for run in RANK_RUNS)
    # stage 0's all-reduces landed during backward ([Note: landing early]), their sub-groups stepped early
    # (gloo's reduce-scatter says it is done only once waited for)
    assert sum(c["0:cpu:6.5"]["early"] for c in counters) > 0
    # and stages 1-2 land as the reducer's end waits for each reduce-scatter in turn: their sub-groups are
    # stepped early then, beside the later reductions, as a GPU's copies land ([Note: the host runs ahead])
    assert sum(c["2:cpu:0"]["early"] for c in counters) > 0 and sum(c["2:nvme:6.5"]["early"] for c in counters) > 0


# -- config ------------------------------------------------------------------------------------

@pytest.mark.parametrize("offload,zero,match", [
    ({"overlap_step": True, "delayed_update": True}, {}, "offload.overlap_step and offload.delayed_update"),
    ({"overlap_step": True}, {"offload_optimizer": {"device": "none"}}, "offload_optimizer.device cpu or nvme"),
    ({"overlap_step": "yes"}, {}, "overlap_step"),
])
def test_unsupported_combinations_are_config_errors(offload, zero, match):
    config = engine_config(stage=1, device="cpu", batch_size=BATCH, offload=offload)
    config["zero_optimization"].update(zero)
    model, _ = twin_models()
    with pytest.raises(ConfigError, match=match):
        initialize(model=model, config=config, model_parameters=param_groups(model))


@pytest.mark.parametrize("setting,on", [("auto", False), (False, False), (True, True)])
def test_auto_is_off_where_the_model_computes_on_the_cpu(setting, on):
    model, _ = twin_models()
    config = engine_config(stage=1, device="cpu", batch_size=BATCH, offload={"overlap_step": setting})
    engine, _, _, _ = initialize(model=model, config=config, model_parameters=param_groups(model))
    try:
        assert (engine.overlap is not None) == on
        assert (engine.reducer.land_early) == on
    finally:
        engine.close()


def test_auto_decision():
    from offload.zero.overlap import overlap_wanted

    gpu = {"device_type": "cuda", "stage": 2, "offloaded": True, "delayed": False}
    assert overlap_wanted("auto", **gpu)
    assert not overlap_wanted("auto", **{**gpu, "device_type": "cpu"})
    assert not overlap_wanted("auto", **{**gpu, "stage": 3})
    assert not overlap_wanted("auto", **{**gpu, "offloaded": False})
    assert not overlap_wanted("auto", **{**gpu, "delayed": True})
    assert not overlap_wanted(False, **gpu)


# -- through the daemon -------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_through_the_daemon_matches_the_ordinary_step(device, tmp_path, monkeypatch):
    """The daemon's regions take the early steps, their copies and (nvme) their unwritten drops as
    the embedded store does: bit for bit the ordinary step, with clipping undoing some steps."""
    from tests.daemon.conftest import STORE, start_daemon

    if STORE != "swap":
        pytest.skip("needs the real swap layer in the daemon")
    daemon = start_daemon(pool={"capacity_bytes": 64 << 20, "segment_bytes": 4 << 20},
                          sessions={"default_quota_bytes": 8 << 20})
    try:
        monkeypatch.setenv("OFFLOAD_DAEMON_SOCKET", daemon.socket_path)
        losses, params, seen = _run(True, stage=2, device=device, tmp_path=tmp_path, clip=CLIP)
        assert seen["stats"].tier.startswith("daemon ")
    finally:
        monkeypatch.delenv("OFFLOAD_DAEMON_SOCKET", raising=False)
        daemon.stop()
    plain_losses, plain_params, plain_seen = _run(False, stage=2, device=device, tmp_path=tmp_path, clip=CLIP)
    assert not plain_seen["stats"].tier.startswith("daemon")
    assert losses == plain_losses
    _assert_same(params, plain_params)
    assert seen["overlap"].early_sub_groups > 0 and seen["overlap"].rollbacks > 0
