"""AdamPlan against the functional step it stands for, and mixed step counts in one call."""
from __future__ import annotations

import pytest
import torch

from cpu_adam import AdamConfig, AdamPlan, adam_step, grad_sumsq
from csrc import ConfigError
from tests.cpu_adam.reference import reference_steps

SIZES = [17, 100003, 5, 65536 * 2 + 1]


def _buffers(seed, grad_dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=gen) for n in SIZES]
    grads = [torch.empty(n, dtype=grad_dtype) for n in SIZES]
    return gen, params, [torch.zeros(n) for n in SIZES], [torch.zeros(n) for n in SIZES], grads


def test_bound_plan_gives_the_bits_of_adam_step():
    gen, params, ms, vs, grads = _buffers(0)
    _, params2, ms2, vs2, grads2 = _buffers(0)
    steps, steps2 = [torch.zeros(()) for _ in SIZES], [torch.zeros(()) for _ in SIZES]
    outs = [torch.empty(n, dtype=torch.bfloat16) for n in SIZES]
    outs2 = [torch.empty(n, dtype=torch.bfloat16) for n in SIZES]
    plan = AdamPlan(params, ms, vs, steps, grads=grads, params_out=outs)
    for k in range(4):
        config = AdamConfig(lr=1e-2 / (k + 1), weight_decay=0.1, num_threads=2)
        for g, g2 in zip(grads, grads2):  # new contents, same storage, as an engine's buffers
            g.copy_(torch.randn(g.numel(), generator=gen))
            g2.copy_(g)
        assert plan.grad_sumsq(num_threads=2) == grad_sumsq(grads2, num_threads=1)
        assert plan.step(config=config, grad_scale=0.25) is False
        adam_step(params2, grads2, ms2, vs2, steps2, config=config, grad_scale=0.25, params_out=outs2)
    for a, b in zip(params + ms + vs + outs + steps, params2 + ms2 + vs2 + outs2 + steps2):
        assert torch.equal(a, b)


def test_plan_takes_other_grads_and_flags_nonfinite_ones():
    _, params, ms, vs, grads = _buffers(1, torch.float32)
    plan = AdamPlan(params, ms, vs, [torch.zeros(()) for _ in SIZES])
    with pytest.raises(ConfigError, match="no gradients bound"):
        plan.step(config=AdamConfig())
    with pytest.raises(ConfigError, match="no gradients bound"):
        plan.grad_sumsq()
    grads = [torch.ones(n) for n in SIZES]
    assert plan.step(grads, config=AdamConfig()) is False
    grads[3][-1] = float("nan")
    assert plan.step(grads, config=AdamConfig()) is True
    with pytest.raises(ConfigError, match=r"grads\[1\] has 7 elements, its param has 100003"):
        plan.step([grads[0], torch.zeros(7), *grads[2:]], config=AdamConfig())
    with pytest.raises(ConfigError, match=r"grads has 3 tensors, the plan has 4 params"):
        plan.step(grads[:3], config=AdamConfig())


def test_plan_checks_what_it_binds():
    _, params, ms, vs, grads = _buffers(2)
    steps = [torch.zeros(()) for _ in SIZES]
    with pytest.raises(ConfigError, match=r"params_out\[2\] is not contiguous"):
        outs = [torch.empty(n, dtype=torch.bfloat16) for n in SIZES]
        outs[2] = torch.empty(SIZES[2], 2, dtype=torch.bfloat16)[:, 0]
        AdamPlan(params, ms, vs, steps, grads=grads, params_out=outs)
    with pytest.raises(ConfigError, match=r"grads has 3 tensors, params has 4"):
        AdamPlan(params, ms, vs, steps, grads=grads[:3])


def test_tensors_at_different_steps_in_one_call():
    # The constants of a step are derived once per step count: tensors whose counts
    # differ, in any order, must each get their own.
    gen = torch.Generator().manual_seed(3)
    sizes = [33, 70000, 1, 33, 9]
    first = [0, 4, 4, 0, 11]
    params = [torch.randn(n, generator=gen) for n in sizes]
    ms = [torch.randn(n, generator=gen).abs() * 1e-2 for n in sizes]
    vs = [torch.randn(n, generator=gen).abs() * 1e-3 for n in sizes]
    start = [(p.clone(), m.clone(), v.clone()) for p, m, v in zip(params, ms, vs)]
    steps = [torch.tensor(float(s)) for s in first]
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw_mode=True,
                 bias_correction=True)
    history = [[] for _ in sizes]
    for _ in range(3):
        grads = [torch.randn(n, generator=gen) for n in sizes]
        for h, g in zip(history, grads):
            h.append(g)
        adam_step(params, grads, ms, vs, steps, config=AdamConfig(**hyper, num_threads=2))
    for i, (p0, m0, v0) in enumerate(start):
        assert steps[i].item() == first[i] + 3
        ref_p, ref_m, ref_v = reference_steps(p0, m0, v0, history[i], first_step=first[i] + 1, **hyper)
        torch.testing.assert_close(params[i].double(), ref_p, rtol=2e-5, atol=2e-6)
        torch.testing.assert_close(ms[i].double(), ref_m, rtol=2e-5, atol=2e-6)
        torch.testing.assert_close(vs[i].double(), ref_v, rtol=2e-5, atol=2e-7)
