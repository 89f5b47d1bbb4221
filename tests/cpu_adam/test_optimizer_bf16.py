"""CPUAdam over bfloat16 params ([Note: bfloat16 params] in cpu_adam/optimizer.py): each step equal
to a float32 CPUAdam step of the widened params followed by the reference rounding of the param's
seed (its place among the optimizer's params); updates below the last place kept where torch's AdamW
loses them; a mixed group; a state dict that resumes bit for bit; and the errors."""
from __future__ import annotations

import copy

import pytest
import torch

from cpu_adam import CPUAdam, CPUAdamW
from cpu_adam.quant import bf16_round_sr
from csrc import ConfigError

SHAPES = [(300,), (17, 33), (1,), (2049,)]  # tails, a 2-d param, one element, past a block boundary


def _params(dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=gen).to(torch.bfloat16) for s in SHAPES]


@pytest.mark.parametrize("sd", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("make", [CPUAdamW, CPUAdam])
def test_each_step_is_the_fp32_step_of_the_widened_params_then_rounded(sd, make):
    """The oracle: a float32 CPUAdam over the widened params (the same moments, the same float32
    arithmetic, the bfloat16 gradients widened exactly), its result rounded by ``bf16_round_sr``
    with the param's place as its seed and the step count after the step."""
    ours = _params(torch.bfloat16)
    wide = [torch.nn.Parameter(p.detach().float()) for p in ours]
    kw = dict(lr=3e-2, weight_decay=0.1, state_dtype=sd)
    # two groups: the seeds run on across them
    opt = make([{"params": ours[:1]}, {"params": ours[1:], "lr": 1e-2}], **kw)
    oracle = make([{"params": wide[:1]}, {"params": wide[1:], "lr": 1e-2}], **kw)
    for step in range(1, 6):
        for p, w, g in zip(ours, wide, _grads(step)):
            p.grad, w.grad = g, g.float()
            w.data.copy_(p.detach().float())  # the oracle starts each step from our rounded params
        opt.step()
        oracle.step()
        for seed, (p, w) in enumerate(zip(ours, wide)):
            want = bf16_round_sr(w.detach().reshape(-1), seed=seed, step=step).reshape(p.shape)
            assert torch.equal(p.detach().view(torch.int16), want.view(torch.int16)), (step, seed)
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(opt.state[p][key], oracle.state[w][key]), (step, seed, key)


def test_a_param_without_gradient_keeps_the_seeds_of_the_others():
    """A param skipped for want of a gradient does not shift its neighbours' seeds."""
    ours = _params(torch.bfloat16)
    wide = [torch.nn.Parameter(p.detach().float()) for p in ours]
    opt = CPUAdamW(ours, lr=1e-2, state_dtype="int8")
    oracle = CPUAdamW(wide, lr=1e-2, state_dtype="int8")
    grads = _grads(1)
    for i in (1, 2, 3):  # param 0 has no gradient
        ours[i].grad, wide[i].grad = grads[i], grads[i].float()
    before = ours[0].detach().clone()
    opt.step()
    oracle.step()
    assert torch.equal(ours[0].detach(), before)
    for seed in (1, 2, 3):
        want = bf16_round_sr(wide[seed].detach().reshape(-1), seed=seed, step=1).reshape(ours[seed].shape)
        assert torch.equal(ours[seed].detach(), want)


def test_updates_below_the_last_place_add_up_where_torch_loses_them():
    """lr 1e-4 at 1.0 is 1/78th of bf16's spacing there: torch's AdamW over a bfloat16 param
    rounds every update away; ours moves the mean by the updates' sum."""
    n, steps = 8192, 100
    ours = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    theirs = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    opt = CPUAdamW([ours], lr=1e-4, weight_decay=0.0, state_dtype="int8")
    torch_opt = torch.optim.AdamW([theirs], lr=1e-4, weight_decay=0.0)
    for _ in range(steps):
        ours.grad = torch.ones(n, dtype=torch.bfloat16)
        theirs.grad = torch.ones(n, dtype=torch.bfloat16)
        opt.step()
        torch_opt.step()
    assert torch.equal(theirs.detach(), torch.ones(n, dtype=torch.bfloat16))  # torch: not a place moved
    # Adam's step with a constant gradient is lr each time
    assert abs(ours.detach().float().mean().item() - (1.0 - 1e-4 * steps)) < 1e-3


@pytest.mark.parametrize("sd", ["fp32", "bf16"])
def test_a_group_may_mix_float32_and_bfloat16_params(sd):
    """The float32 params of a mixed group step exactly as without the bfloat16 ones (with float32
    moments: as through the plan), and those as in a bfloat16-only optimizer that gives them the
    same places."""
    f32 = _params(torch.float32, seed=3)[:2]
    b16 = _params(torch.bfloat16, seed=4)[2:]
    f32_alone = [torch.nn.Parameter(p.detach().clone()) for p in f32]
    b16_alone = [torch.nn.Parameter(p.detach().clone()) for p in b16]
    mixed = CPUAdamW(f32 + b16, lr=1e-2, state_dtype=sd)
    only_f32 = CPUAdamW(f32_alone, lr=1e-2, state_dtype=sd)
    # the bfloat16 params are places 2 and 3 in the mixed optimizer: two params before them here too
    pad = [torch.nn.Parameter(torch.zeros(1)) for _ in range(2)]
    only_b16 = CPUAdamW(pad + b16_alone, lr=1e-2, state_dtype=sd)
    for step in range(1, 4):
        grads = _grads(step)
        for p, q, g in zip(f32 + b16, f32_alone + b16_alone, grads):
            p.grad = g.to(p.dtype)
            q.grad = g.to(q.dtype)
        mixed.step()
        only_f32.step()
        only_b16.step()
    for p, q in zip(f32 + b16, f32_alone + b16_alone):
        assert p.dtype == q.dtype and torch.equal(p.detach(), q.detach())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sd", ["fp32", "bf16", "int8"])
def test_a_saved_state_resumes_bit_for_bit(sd, dtype):
    """3 steps, a state dict saved and loaded into a fresh optimizer over copies of the params, 3
    more: the same bits as 6 steps straight. torch's loader alone would round the int8 block
    scales to bfloat16, the params' dtype; a bf16 state (no scales) once failed to load at all."""
    straight = _params(dtype)
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in straight]
    opt = CPUAdamW(straight, lr=1e-2, weight_decay=0.01, state_dtype=sd)
    first = CPUAdamW(resumed, lr=1e-2, weight_decay=0.01, state_dtype=sd)
    for step in range(1, 7):
        if step == 4:
            saved = copy.deepcopy(first.state_dict())
            resumed = [torch.nn.Parameter(p.detach().clone()) for p in resumed]
            first = CPUAdamW(resumed, lr=1e-2, weight_decay=0.01, state_dtype=sd)
            first.load_state_dict(saved)
            st = first.state[resumed[0]]
            if sd == "int8":
                assert st["exp_avg"].dtype == torch.uint8 and st["exp_avg_scale"].dtype == torch.float32
                assert torch.equal(st["exp_avg_scale"], saved["state"][0]["exp_avg_scale"])
        for p, q, g in zip(straight, resumed, _grads(step)):
            p.grad, q.grad = g.to(dtype), g.to(dtype)
        opt.step()
        first.step()
    for p, q in zip(straight, resumed):
        assert torch.equal(p.detach(), q.detach())
    for p, q in zip(straight, resumed):
        for key, value in opt.state[p].items():
            assert torch.equal(value, first.state[q][key]), key


def test_a_float32_state_loads_into_bfloat16_params():
    """A torch AdamW state over float32 params loads into CPUAdamW over bfloat16 copies: bf16
    moments rounded from their float32 values once, float32 ones exactly (torch's loader alone
    would round them to the params' bfloat16)."""
    gen = torch.Generator().manual_seed(5)
    w = torch.nn.Parameter(torch.randn(1000, generator=gen))
    theirs = torch.optim.AdamW([w], lr=1e-2)
    for _ in range(3):
        w.grad = torch.randn(1000, generator=gen)
        theirs.step()
    saved = theirs.state_dict()
    b = torch.nn.Parameter(w.detach().to(torch.bfloat16))
    ours = CPUAdamW([b], lr=1e-2, state_dtype="bf16")
    ours.load_state_dict(saved)
    st = ours.state[b]
    assert torch.equal(st["exp_avg"], saved["state"][0]["exp_avg"].to(torch.bfloat16))
    assert torch.equal(st["exp_avg_sq"], saved["state"][0]["exp_avg_sq"].to(torch.bfloat16))
    b.grad = torch.randn(1000, generator=gen).to(torch.bfloat16)
    ours.step()  # and it steps on from there
    assert float(st["step"]) == 4.0
    exact = CPUAdamW([torch.nn.Parameter(w.detach().to(torch.bfloat16))], lr=1e-2)  # float32 moments
    exact.load_state_dict(saved)
    st = next(iter(exact.state.values()))
    assert st["exp_avg"].dtype == torch.float32 and torch.equal(st["exp_avg"], saved["state"][0]["exp_avg"])


def test_training_a_bfloat16_model_tracks_a_float32_one():
    """A small regression in bfloat16 with int8 moments (about 4 bytes a param in all) against the
    same model in float32 with torch's AdamW: the loss after 300 steps within 10%; torch's AdamW
    over the bfloat16 model ends further off."""
    gen = torch.Generator().manual_seed(0)
    x, w_true = torch.randn(512, 64, generator=gen), torch.randn(64, 32, generator=gen)
    y = torch.tanh(x @ w_true) + 0.05 * torch.randn(512, 32, generator=gen)

    def train(dtype, make):
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 32)).to(dtype)
        opt = make(model.parameters())
        for _ in range(300):
            loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return loss.item()

    fp32 = train(torch.float32, lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01))
    ours = train(torch.bfloat16, lambda ps: CPUAdamW(ps, lr=1e-3, weight_decay=0.01, state_dtype="int8"))
    torch_bf16 = train(torch.bfloat16, lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01))
    assert abs(ours - fp32) <= 0.10 * fp32, (ours, fp32, torch_bf16)
    assert abs(torch_bf16 - fp32) > abs(ours - fp32), (ours, fp32, torch_bf16)


def test_bad_params_name_what_is_wrong():
    h = torch.nn.Parameter(torch.zeros(10, dtype=torch.float16))
    h.grad = torch.zeros(10, dtype=torch.float16)
    with pytest.raises(ConfigError, match="float16 param of shape"):
        CPUAdamW([h], state_dtype="int8").step()


def test_a_bf16_state_saved_with_empty_scales_loads():
    """States saved before this fix hold ``exp_avg_scale: None`` for bf16 moments; they load."""
    p = torch.nn.Parameter(torch.randn(300))
    opt = CPUAdamW([p], lr=1e-2, state_dtype="bf16")
    p.grad = torch.ones(300)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][0].update(exp_avg_scale=None, exp_avg_sq_scale=None)
    again = CPUAdamW([torch.nn.Parameter(p.detach().clone())], lr=1e-2, state_dtype="bf16")
    again.load_state_dict(saved)
    st = next(iter(again.state.values()))
    assert "exp_avg_scale" not in st and torch.equal(st["exp_avg"], opt.state[p]["exp_avg"])
