"""CPUAdam against torch.optim.AdamW / Adam: steps, groups, schedulers, state dicts."""
from __future__ import annotations

import copy
import io

import pytest
import torch

from cpu_adam import CPUAdam, CPUAdamW, available_isas
from csrc import ConfigError, OffloadError

ISAS = [isa.name.lower() for isa in available_isas()]


def _params(sizes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) for n in sizes]


def _grads(params, gen):
    return [torch.randn(p.shape, generator=gen) for p in params]


def _train(optimizers_and_params, steps, seed=1, schedulers=()):
    """Feed the same gradients to every (optimizer, params) pair for `steps` steps."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        grads = _grads(optimizers_and_params[0][1], gen)
        for opt, params in optimizers_and_params:
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
            opt.zero_grad()
        for s in schedulers:
            s.step()


def _groups(params, lrs, wds):
    return [{"params": [p], "lr": lr, "weight_decay": wd} for p, lr, wd in zip(params, lrs, wds)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("sizes", [[1, 15, 17], [1000003], [3000000, 7]])
def test_matches_torch_over_20_steps(isa, adamw_mode, sizes):
    ours, theirs = _params(sizes), _params(sizes)
    lrs, wds = [1e-2, 3e-3, 1e-3][: len(sizes)], [0.1, 0.0, 0.05][: len(sizes)]
    opt = CPUAdam(_groups(ours, lrs, wds), adamw_mode=adamw_mode, isa=isa)
    torch_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    ref = torch_cls(_groups(theirs, lrs, wds), foreach=False)
    _train([(opt, ours), (ref, theirs)], steps=20)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)
    for a, b in zip(ours, theirs):
        sa, sb = opt.state[a], ref.state[b]
        torch.testing.assert_close(sa["exp_avg"], sb["exp_avg"])
        torch.testing.assert_close(sa["exp_avg_sq"], sb["exp_avg_sq"])
        assert sa["step"].item() == sb["step"].item() == 20


def test_lr_scheduler_drives_each_group():
    ours, theirs = _params([1000, 33]), _params([1000, 33])
    opt = CPUAdam(_groups(ours, [1e-2, 5e-3], [0.01, 0.0]))
    ref = torch.optim.AdamW(_groups(theirs, [1e-2, 5e-3], [0.01, 0.0]))
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5) for o in (opt, ref)]
    _train([(opt, ours), (ref, theirs)], steps=10, schedulers=scheds)
    assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**3)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)


def test_params_without_grad_are_left_alone():
    params = _params([10, 10])
    before = params[1].clone()
    opt = CPUAdam(params, lr=0.1)
    params[0].grad = torch.ones(10)
    opt.step()
    assert torch.equal(params[1], before)
    assert params[1] not in opt.state
    assert opt.state[params[0]]["step"].item() == 1


def _roundtrip(state_dict):
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf)


def test_state_dict_round_trip_is_exact():
    straight, resumed = _params([1001, 5]), _params([1001, 5])
    opt_a = CPUAdam(straight, lr=1e-2, weight_decay=0.1)
    opt_b = CPUAdam(resumed, lr=1e-2, weight_decay=0.1)
    _train([(opt_a, straight), (opt_b, resumed)], steps=5)
    saved = _roundtrip(opt_b.state_dict())
    fresh = CPUAdam(resumed, lr=0.5)  # different hyperparameters: the state's must win
    fresh.load_state_dict(saved)
    _train([(opt_a, straight), (fresh, resumed)], steps=5, seed=2)
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)
    assert fresh.param_groups[0]["lr"] == 1e-2


@pytest.mark.parametrize("torch_cls,adamw_mode", [(torch.optim.AdamW, True), (torch.optim.Adam, False)])
def test_state_moves_between_torch_and_cpuadam(torch_cls, adamw_mode):
    ref_params, ours = _params([2000, 3]), _params([2000, 3])
    ref = torch_cls(ref_params, lr=1e-2, weight_decay=0.1)
    shadow = torch_cls(ours, lr=1e-2, weight_decay=0.1)
    _train([(ref, ref_params), (shadow, ours)], steps=4)
    opt = CPUAdam(ours, adamw_mode=not adamw_mode)  # the loaded state sets the mode
    opt.load_state_dict(_roundtrip(shadow.state_dict()))
    assert opt.param_groups[0]["decoupled_weight_decay"] is adamw_mode
    _train([(ref, ref_params), (opt, ours)], steps=4, seed=5)
    for a, b in zip(ref_params, ours):
        torch.testing.assert_close(a, b)

    back = torch_cls(ours, lr=1.0)  # and back into torch
    back.load_state_dict(_roundtrip(opt.state_dict()))
    _train([(ref, ref_params), (back, ours)], steps=3, seed=6)
    for a, b in zip(ref_params, ours):
        torch.testing.assert_close(a, b)


def test_unsupported_options_are_errors_not_ignored():
    params = _params([4])
    with pytest.raises(ConfigError, match="AMSGrad is not implemented"):
        CPUAdam(params, amsgrad=True)
    with pytest.raises(ValueError):  # ConfigError is also a ValueError
        CPUAdam(params, amsgrad=True)
    amsgrad_state = torch.optim.AdamW(params, amsgrad=True).state_dict()
    with pytest.raises(ConfigError, match="param group 0 of the state has amsgrad=True"):
        CPUAdam(params).load_state_dict(amsgrad_state)
    opt = CPUAdam([{"params": params, "maximize": True}])
    params[0].grad = torch.ones(4)
    with pytest.raises(ConfigError, match="maximize=True"):
        opt.step()
    with pytest.raises(ConfigError, match="lr must be >= 0"):
        CPUAdam(params, lr=-1.0)
    with pytest.raises(ConfigError, match="beta1 must be in"):
        CPUAdam(params, betas=(1.5, 0.9))


def test_non_float32_params_and_sparse_grads_are_refused():
    p = torch.zeros(4, dtype=torch.float64)
    p.grad = torch.ones(4, dtype=torch.float64)
    with pytest.raises(OffloadError, match="CPUAdam updates float32 or bfloat16 params; got a torch.float64 param"):
        CPUAdam([p]).step()
    q = torch.zeros(4)
    q.grad = torch.ones(4).to_sparse()
    with pytest.raises(ConfigError, match="sparse"):
        CPUAdam([q]).step()


def test_cpuadamw_is_torch_adamw_with_its_defaults():
    ours, theirs = _params([513]), _params([513])
    _train([(CPUAdamW(ours), ours), (torch.optim.AdamW(theirs), theirs)], steps=6)
    torch.testing.assert_close(ours[0], theirs[0])


def test_closure_and_group_keys():
    p = _params([8])[0]
    opt = CPUAdam([{"params": [p], "adamw_mode": False, "weight_decay": 0.1}], lr=1e-2)
    assert opt.param_groups[0]["decoupled_weight_decay"] is False
    ref_p = p.clone()
    ref = torch.optim.Adam([ref_p], lr=1e-2, weight_decay=0.1)

    def closure():
        p.grad = torch.full_like(p, 0.5)
        return 3.0

    assert opt.step(closure) == 3.0
    ref_p.grad = torch.full_like(ref_p, 0.5)
    ref.step()
    torch.testing.assert_close(p, ref_p)
    copy.deepcopy(opt.state_dict())  # plain data, copyable


@pytest.mark.parametrize("isa", ISAS)
def test_param_groups_each_match_the_float64_reference(isa):
    from tests.cpu_adam.reference import reference_steps

    sizes = [17, 1000003, 15]
    groups = [dict(lr=1e-2, weight_decay=0.1, adamw_mode=True, bias_correction=True),
              dict(lr=3e-3, weight_decay=0.05, adamw_mode=False, bias_correction=True),
              dict(lr=1e-3, weight_decay=0.0, adamw_mode=True, bias_correction=False)]
    params = _params(sizes, seed=4)
    start = [p.clone() for p in params]
    opt = CPUAdam([{"params": [p], **g} for p, g in zip(params, groups)], isa=isa)
    gen = torch.Generator().manual_seed(9)
    history = [[] for _ in sizes]
    for _ in range(20):
        for p, h in zip(params, history):
            p.grad = torch.randn(p.shape, generator=gen)
            h.append(p.grad.clone())
        opt.step()
    for p, p0, h, g in zip(params, start, history, groups):
        ref_p, _, _ = reference_steps(p0, torch.zeros_like(p0), torch.zeros_like(p0), h, beta1=0.9,
                                      beta2=0.999, eps=1e-8, **g)
        torch.testing.assert_close(p.double(), ref_p, rtol=2e-5, atol=2e-6)
