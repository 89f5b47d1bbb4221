"""``offload.delayed_update`` (the one-step delayed parameter update) against a torch loop that
applies the same delay by hand, and its config checks.

The oracle: torch's AdamW steps fp32 master params; the model computes with a copy of them.
During the warm-up each step's update goes into the model at once; after it, the model gets
the masters *before* each step (so step t's update reaches the model at step t+1's boundary and
is first computed with at step t+2). Same tolerances as the equivalence tests.
"""
from __future__ import annotations

import copy

import pytest
import torch

from csrc import ConfigError
from offload.builder import initialize
from tests.offload.harness import (
    accumulate, assert_losses_close, engine_config, loss_fn, make_batches, param_groups, run_engine, torch_optimizer,
    train_and_close, twin_models,
)

STEPS = 20
WARMUP = 3
BATCH = 8


def run_torch_delayed(model, batches, *, warmup: int, gas: int = 1, clip: float = 0.0, optimizer=None, loss_of=None):
    master = copy.deepcopy(model)
    opt = optimizer(master) if optimizer is not None else torch_optimizer("AdamW", param_groups(master), foreach=False)
    losses = []
    for step, (x, y) in enumerate(batches):
        model.zero_grad(set_to_none=True)
        losses.append(accumulate(model, x, y, gas, loss_of))
        for p, q in zip(master.parameters(), model.parameters()):
            p.grad = None if q.grad is None else q.grad.clone()
        if clip:
            torch.nn.utils.clip_grad_norm_([p for p in master.parameters() if p.grad is not None], clip)
        delayed = step >= warmup
        if delayed:  # the update started at the last boundary reaches the model now
            with torch.no_grad():
                for p, q in zip(master.parameters(), model.parameters()):
                    q.copy_(p)
        opt.step()
        if not delayed:
            with torch.no_grad():
                for p, q in zip(master.parameters(), model.parameters()):
                    q.copy_(p)
    # what the model holds at the end, and the masters (one update ahead)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, \
        {n: p.detach().clone() for n, p in master.named_parameters()}


def _config(stage, device, tmp_path, gas=1, warmup=WARMUP, **extra):
    offload = {"delayed_update": True, "delayed_update_warmup_steps": warmup, **extra}
    return engine_config(stage=stage, device=device, nvme_path=tmp_path, batch_size=BATCH, gas=gas, offload=offload)


@pytest.mark.parametrize("stage,device,gas", [(0, "cpu", 1), (1, "nvme", 1), (2, "cpu", 2), (2, "nvme", 2)])
def test_delayed_update_matches_a_hand_delayed_torch_loop(stage, device, gas, tmp_path):
    model, ref = twin_models()
    batches = make_batches(STEPS, BATCH * gas)
    seen = {}

    def inspect(engine, step):
        seen["delayed"] = engine.delayed.delayed_steps
        seen["stats"] = engine.offload_stats()

    losses, params = run_engine(model, _config(stage, device, tmp_path, gas), batches, gas=gas, on_step=inspect)
    ref_losses, ref_params, _ = run_torch_delayed(ref, batches, warmup=WARMUP, gas=gas)
    assert_losses_close(losses, ref_losses, rel=1e-5)
    for name in params:
        torch.testing.assert_close(params[name], ref_params[name], msg=lambda m: f"{name}: {m}")
    assert seen["delayed"] == STEPS - WARMUP
    assert seen["stats"].optimizer_steps == STEPS
    # the oracle is not the undelayed run: the delay is what the test sees
    _, plain = twin_models()
    plain_losses, _, _ = run_torch_delayed(plain, batches, warmup=STEPS, gas=gas)
    assert plain_losses[:WARMUP + 1] == pytest.approx(ref_losses[:WARMUP + 1], rel=1e-6)
    assert max(abs(a - b) / b for a, b in zip(plain_losses[WARMUP + 2:], ref_losses[WARMUP + 2:])) > 1e-3


def test_delayed_update_with_clipping_clips_each_step_by_its_own_norm(tmp_path):
    model, ref = twin_models()
    batches = make_batches(STEPS, BATCH)
    config = _config(2, "nvme", tmp_path)
    config["gradient_clipping"] = 0.5
    losses, params = run_engine(model, config, batches)
    ref_losses, ref_params, _ = run_torch_delayed(ref, batches, warmup=WARMUP, clip=0.5)
    _, unclipped = twin_models()
    unclipped_losses, _, _ = run_torch_delayed(unclipped, batches, warmup=WARMUP)
    assert_losses_close(losses, ref_losses, rel=1e-5)
    for name in params:
        torch.testing.assert_close(params[name], ref_params[name], msg=lambda m: f"{name}: {m}")
    assert max(abs(a - b) / b for a, b in zip(unclipped_losses, ref_losses)) > 1e-3, "clipping should bite"


def test_the_demo_gpt_with_its_tied_head_matches_too():
    """The GPT of the demo (a head tied to the token embedding, clipping, AdamW at its lr), small."""
    from offload.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=2, n_embd=32), seed=0)
    ref = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 40, (4, 16), generator=gen), torch.randint(0, 40, (4, 16), generator=gen))
               for _ in range(STEPS)]
    hyper = {"lr": 3e-3, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.01}
    config = {"train_batch_size": 4, "steps_per_print": 1000, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {**hyper, "betas": list(hyper["betas"])}},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
              "offload": {"delayed_update": True, "delayed_update_warmup_steps": WARMUP}}
    engine, _, _, _ = initialize(model=model, config=config)
    losses = train_and_close(engine, batches, lambda e, x, y: e(x, y))
    oracle = {"clip": 1.0, "loss_of": lambda m, x, y: m(x, y),
              "optimizer": lambda m: torch.optim.AdamW(m.parameters(), **hyper)}
    undelayed, _, _ = run_torch_delayed(copy.deepcopy(ref), batches, warmup=STEPS, **oracle)
    ref_losses, _, _ = run_torch_delayed(ref, batches, warmup=WARMUP, **oracle)
    assert_losses_close(losses, ref_losses, rel=1e-5)
    assert max(abs(a - b) / b for a, b in zip(undelayed, ref_losses)) > 1e-4, "the delay must show in the losses"


def test_warmup_longer_than_the_run_changes_nothing(tmp_path):
    model, ref = twin_models()
    batches = make_batches(8, BATCH)
    losses, params = run_engine(model, _config(2, "cpu", tmp_path, warmup=100), batches)
    ref_losses, ref_params, _ = run_torch_delayed(ref, batches, warmup=100)
    assert_losses_close(losses, ref_losses, rel=1e-5)
    for name in params:
        torch.testing.assert_close(params[name], ref_params[name])


def test_checkpoint_waits_for_the_step_in_flight(tmp_path):
    """The checkpoint's masters are all 10 steps' (the step in flight finished first); its module
    entries are the params the model holds, one update behind, as the oracle's model is."""
    from offload.checkpoint import consolidate

    model, ref = twin_models()
    batches = make_batches(10, BATCH)
    engine, _, _, _ = initialize(model=model, config=_config(1, "nvme", tmp_path, warmup=0),
                                 model_parameters=param_groups(model))
    try:
        for x, y in batches:
            engine.backward(loss_fn(engine(x), y))
            engine.step()
        assert engine.delayed.busy
        path = engine.save_checkpoint(str(tmp_path / "ckpt"))
        assert not engine.delayed.busy
    finally:
        engine.close()
    _, ref_params, ref_masters = run_torch_delayed(ref, batches, warmup=0)
    saved = consolidate(path, str(tmp_path / "fp32.pt"))
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(saved[name], ref_masters[name], msg=lambda m: f"{name}: {m}")
            torch.testing.assert_close(p.detach(), ref_params[name], msg=lambda m: f"{name}: {m}")
            assert not torch.allclose(ref_masters[name], ref_params[name]) or name == "unused"


def test_a_failing_background_step_raises_at_the_next_boundary(tmp_path, monkeypatch):
    model, _ = twin_models()
    engine, _, _, _ = initialize(model=model, config=_config(0, "cpu", tmp_path, warmup=0),
                                 model_parameters=param_groups(model))
    batches = make_batches(3, BATCH)
    try:
        x, y = batches[0]
        engine.backward(loss_fn(engine(x), y))

        def boom(*args, **kwargs):
            raise OSError(5, "injected I/O error")

        monkeypatch.setattr(engine.adam, "step_states", boom)
        engine.step()  # started in the background: no error yet
        x, y = batches[1]
        engine.backward(loss_fn(engine(x), y))
        with pytest.raises(OSError, match="injected"):
            engine.step()
    finally:
        engine.close()


@pytest.mark.parametrize("offload,zero,match", [
    ({"delayed_update": 1}, {}, "delayed_update must be true or false"),
    ({"delayed_update": True, "delayed_update_warmup_steps": -1}, {}, "delayed_update_warmup_steps"),
    ({"delayed_update": True, "delayed_update_warmup_steps": 2.5}, {}, "delayed_update_warmup_steps"),
    ({"delayed_update": True}, {"offload_optimizer": {"device": "none"}}, "offload_optimizer.device cpu or nvme"),
    ({"delayed_update": True}, {"stage": 3, "offload_optimizer": {"device": "cpu"}}, "stage 3"),
    ({"delayed_updates": True}, {}, "delayed_update"),
])
def test_bad_values_fail_before_anything_is_built(offload, zero, match):
    from offload.config import read_config

    config = engine_config(stage=2, device="cpu", offload=offload)
    config["zero_optimization"].update(zero)
    with pytest.raises(ConfigError, match=match):
        read_config(config, world_size=1)


def test_off_by_default():
    from offload.config import read_config

    cfg = read_config(engine_config(stage=2, device="cpu"), world_size=1)
    assert cfg.offload.delayed_update is False and cfg.offload.delayed_update_warmup_steps == 40


def test_demo_flag_turns_it_on():
    from offload.cli.demo import DemoConfig, ds_config

    assert "offload" not in ds_config(DemoConfig(offload_device="cpu"), None)
    ds = ds_config(DemoConfig(offload_device="cpu", delayed_update_warmup_steps=7), None)
    assert ds["offload"] == {"delayed_update": True, "delayed_update_warmup_steps": 7}
    with pytest.raises(ConfigError, match="delayed_update_warmup_steps"):
        DemoConfig(delayed_update_warmup_steps=-1)
