"""``initialize(optimizer=...)``: a client optimizer read as the config's "optimizer" section.

The oracle is the same run with the optimizer named in the config instead (itself held to torch's
AdamW and Adam by test_equivalence.py): losses and params bit for bit, for CPUAdamW, CPUAdam with
L2 decay, torch's AdamW and Adam, with two param groups of different weight decay and lr."""
from __future__ import annotations

import pytest
import torch

from cpu_adam import CPUAdam, CPUAdamW
from csrc import ConfigError
from offload.builder import initialize
from tests.offload.harness import (BETAS, EPS, LR, engine_config, loss_fn, make_batches, param_groups,
                                   train_and_close, twin_models)

STEPS = 6


def _groups(model):
    groups = param_groups(model)
    groups[1]["lr"] = LR / 2  # a second lr, so each group's own hyperparameters must reach the engine
    return groups


def _train(model, config, **init):
    engine, optimizer, _, scheduler = initialize(model=model, config=config, **init)
    losses, lrs = [], []
    try:
        for x, y in make_batches(STEPS, 8):
            lrs.append(engine.get_lr())
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        engine.close()
    return losses, params, lrs, optimizer


CLIENTS = {
    "CPUAdamW": (lambda g: CPUAdamW(g, lr=LR, betas=BETAS, eps=EPS), "AdamW", None),
    "CPUAdam L2": (lambda g: CPUAdam(g, lr=LR, betas=BETAS, eps=EPS, adamw_mode=False), "Adam", False),
    "torch AdamW": (lambda g: torch.optim.AdamW(g, lr=LR, betas=BETAS, eps=EPS), "AdamW", None),
    "torch Adam": (lambda g: torch.optim.Adam(g, lr=LR, betas=BETAS, eps=EPS), "Adam", False),
}


@pytest.mark.parametrize("stage,device", [(2, "cpu"), (1, "none")])
@pytest.mark.parametrize("client", list(CLIENTS))
def test_a_client_optimizer_trains_as_the_config_section_does(client, stage, device):
    make, kind, adam_w_mode = CLIENTS[client]
    ours, theirs = twin_models()
    want = _train(theirs, engine_config(stage=stage, device=device, optimizer=kind, adam_w_mode=adam_w_mode),
                  model_parameters=_groups(theirs))
    config = engine_config(stage=stage, device=device)
    del config["optimizer"]
    got = _train(ours, config, optimizer=make(_groups(ours)))
    assert got[0] == want[0]
    for name, p in want[1].items():
        assert torch.equal(got[1][name], p), name
    assert got[2] == want[2] == [[LR, LR / 2]] * STEPS
    assert [g["lr"] for g in got[3].param_groups] == [LR, LR / 2]  # the engine's optimizer is returned


def test_a_warmup_scheduler_warms_up_to_the_client_lr():
    """DeepSpeed's WarmupLR without warmup_max_lr warms up to the optimizer's lr: the client's here."""
    model, _ = twin_models()
    config = engine_config(stage=2, device="cpu", scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 4}})
    del config["optimizer"]
    _, _, lrs, _ = _train(model, config, optimizer=CPUAdamW(model.parameters(), lr=3e-3))
    assert lrs[-1] == [3e-3]
    assert lrs[0][0] < 3e-3


def test_bad_client_optimizers_are_named():
    model, _ = twin_models()
    config = engine_config(stage=2, device="cpu")
    with pytest.raises(ConfigError, match="keep one of the two"):
        initialize(model=model, config=config, optimizer=CPUAdamW(model.parameters()))
    del config["optimizer"]
    with pytest.raises(ConfigError, match=r"got a torch\.optim\.sgd\.SGD; this engine runs Adam or AdamW"):
        initialize(model=model, config=config, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match="amsgrad=True"):
        initialize(model=model, config=config, optimizer=torch.optim.AdamW(model.parameters(), amsgrad=True))
    groups = param_groups(model)
    groups[1]["bias_correction"] = False
    with pytest.raises(ConfigError, match="differ in weight decay mode or bias correction"):
        initialize(model=model, config=config, optimizer=CPUAdamW(groups))
    with pytest.raises(ConfigError, match=r"no \"optimizer\" section.*initialize\(optimizer=CPUAdam"):
        initialize(model=model, config=config)


def test_a_scheduler_built_over_the_client_optimizer_drives_the_engines_lr():
    """A torch scheduler made over the optimizer passed to initialize (as Accelerate and most scripts build it)
    steps the engine's lr, as one made by a function of the engine's optimizer does."""
    ours, theirs = twin_models()
    config = engine_config(stage=2, device="cpu")
    del config["optimizer"]
    step_lr = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)  # noqa: E731
    want = _train(theirs, config, optimizer=torch.optim.AdamW(_groups(theirs), lr=LR, betas=BETAS, eps=EPS),
                  lr_scheduler=step_lr)
    client = torch.optim.AdamW(_groups(ours), lr=LR, betas=BETAS, eps=EPS)
    got = _train(ours, config, optimizer=client, lr_scheduler=step_lr(client))
    assert [lrs[0] for lrs in want[2]] == [LR, LR, LR / 2, LR / 2, LR / 4, LR / 4]
    assert got[2] == want[2] and got[0] == want[0]


def test_a_client_optimizer_over_a_model_built_under_init_context(tmp_path):
    """Stage 3 with the model built under init_context (its params are meta placeholders, replaced at
    initialize): the client optimizer's groups, which name the placeholders, follow them to the engine's
    params, and training is the config-named optimizer's, bit for bit (as DeepSpeed keeps its objects)."""
    from offload.hf.init_context import init_context
    from tests.offload import stage3_worker as w

    def run(config, client):
        torch.manual_seed(0)
        with init_context(config):
            net = w.Tiny()
        opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.01) if client else None
        engine, _, _, _ = initialize(model=net, config=config, optimizer=opt)
        return train_and_close(engine, w.batches(4), lambda e, x, y: e(x, y))

    config = w.config("cpu", "cpu", str(tmp_path))
    want = run(config, client=False)
    del config["optimizer"]
    assert run(config, client=True) == want
