"""The functional step and the gradient norm against oracles, on every ISA path this CPU runs."""
from __future__ import annotations

import math

import pytest
import torch

from cpu_adam import AdamConfig, Isa, adam_step, available_isas, grad_sumsq, resolve_isa
from csrc import ConfigError
from tests.cpu_adam.reference import reference_steps

ISAS = [isa.name.lower() for isa in available_isas()]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _state(sizes, seed):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=gen) for n in sizes]
    return gen, params, [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes]


def _run_and_check(sizes, isa, *, steps, adamw_mode, bias_correction, grad_dtype=torch.float32,
                   out_dtype=None, grad_scale=1.0, num_threads=None):
    gen, params, ms, vs = _state(sizes, seed=sum(sizes) + steps)
    start = [p.clone() for p in params]
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                 adamw_mode=adamw_mode, bias_correction=bias_correction)
    config = AdamConfig(**hyper, isa=isa, num_threads=num_threads)
    counters = [torch.zeros((), dtype=torch.float32) for _ in sizes]
    outs = [torch.empty(n, dtype=out_dtype) for n in sizes] if out_dtype else None
    history = [[] for _ in sizes]
    for _ in range(steps):
        grads = [torch.randn(n, generator=gen).to(grad_dtype) for n in sizes]
        for h, g in zip(history, grads):
            h.append(g)
        bad = adam_step(params, grads, ms, vs, counters, config=config, grad_scale=grad_scale,
                        params_out=outs)
        assert bad is False
    for i, n in enumerate(sizes):
        assert counters[i].item() == steps
        ref_p, ref_m, ref_v = reference_steps(start[i], torch.zeros(n), torch.zeros(n), history[i],
                                              grad_scale=grad_scale, **hyper)
        torch.testing.assert_close(ms[i].double(), ref_m, rtol=2e-5, atol=2e-6)
        torch.testing.assert_close(vs[i].double(), ref_v, rtol=2e-5, atol=2e-7)
        torch.testing.assert_close(params[i].double(), ref_p, rtol=2e-5, atol=2e-6)
        if outs is not None:  # the copy is exactly the updated master, rounded as torch rounds
            assert torch.equal(outs[i], params[i].to(out_dtype))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("size", [1, 15, 17, 1000003, 3000000])
@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_fp32_matches_float64_reference(isa, size, adamw_mode, bias_correction):
    _run_and_check([size], isa, steps=20, adamw_mode=adamw_mode, bias_correction=bias_correction)


@pytest.mark.parametrize("isa", ISAS)
def test_many_tensors_in_one_call(isa):
    _run_and_check([1, 15, 17, 64, 1000003, 3, 65536 * 3 + 5], isa, steps=20, adamw_mode=True,
                   bias_correction=True)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16, torch.float32])
def test_fused_low_precision_variants(isa, grad_dtype, out_dtype):
    _run_and_check([17, 300007], isa, steps=5, adamw_mode=True, bias_correction=True,
                   grad_dtype=grad_dtype, out_dtype=out_dtype, grad_scale=0.37)


@pytest.mark.parametrize("isa", ISAS)
def test_thread_count_does_not_change_results(isa):
    sizes = [5, 70001, 1, 200003, 64, 131071]
    results = []
    for threads in (1, 2, 3, 7):
        gen, params, ms, vs = _state(sizes, seed=7)
        steps = [torch.zeros(()) for _ in sizes]
        for _ in range(3):
            grads = [torch.randn(n, generator=gen) for n in sizes]
            adam_step(params, grads, ms, vs, steps, config=AdamConfig(isa=isa, num_threads=threads))
        results.append(torch.cat(params + ms + vs))
    for other in results[1:]:
        assert torch.equal(results[0], other)


def _all_bit_patterns(dtype):
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


def _same_bits_or_both_nan(a, b, *, zero_sign=True):
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(b))
    assert torch.equal(a[~nan], b[~nan])
    signed = ~nan if zero_sign else ~nan & (a != 0)
    assert torch.equal(torch.signbit(a[signed]), torch.signbit(b[signed]))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_gradient_conversion_is_exact_for_every_bit_pattern(isa, grad_dtype):
    # With beta1 = 0 the first moment after one step is the converted gradient itself
    # (but 0 * m + (-0.0) is +0.0, so the sign of a zero cannot be seen this way; the
    # param-copy test below checks signed zeros).
    grads = _all_bit_patterns(grad_dtype)
    n = grads.numel()
    m = torch.zeros(n)
    adam_step([torch.zeros(n)], [grads], [m], [torch.zeros(n)], [torch.zeros(())],
              config=AdamConfig(beta1=0.0, isa=isa))
    _same_bits_or_both_nan(m, grads.float(), zero_sign=False)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_param_copy_rounds_like_torch(isa, out_dtype):
    # lr = 0 leaves the master unchanged, so the copy is the conversion of chosen values:
    # every float32 whose upper half is any pattern, plus halfway and near-halfway cases.
    gen = torch.Generator().manual_seed(3)
    upper = torch.arange(0, 2**16, dtype=torch.int64) << 16
    low = torch.tensor([0, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x1000], dtype=torch.int64)
    bits = (upper[:, None] | low[None, :]).flatten()
    bits = torch.cat([bits, torch.randint(0, 2**32, (100003,), generator=gen)])
    params = bits.to(torch.int64).sub(2**32 * (bits >= 2**31)).to(torch.int32).view(torch.float32)
    params = params.contiguous()
    n = params.numel()
    out = torch.empty(n, dtype=out_dtype)
    adam_step([params.clone()], [torch.zeros(n)], [torch.zeros(n)], [torch.zeros(n)],
              [torch.zeros(())], config=AdamConfig(lr=0.0, isa=isa), params_out=[out])
    _same_bits_or_both_nan(out.float(), params.to(out_dtype).float())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("where", [0, 16 * 5 + 3, -1])
@pytest.mark.parametrize("bad_value", [float("inf"), float("nan"), -float("inf")])
def test_nonfinite_gradient_is_flagged(isa, grad_dtype, where, bad_value):
    n = 16 * 7 + 5  # a masked or scalar tail after whole vectors
    grads = torch.randn(n).to(grad_dtype)
    clean = adam_step([torch.zeros(n)], [grads], [torch.zeros(n)], [torch.zeros(n)],
                      [torch.zeros(())], config=AdamConfig(isa=isa))
    assert clean is False
    grads[where] = bad_value
    assert adam_step([torch.zeros(n)], [grads], [torch.zeros(n)], [torch.zeros(n)],
                     [torch.zeros(())], config=AdamConfig(isa=isa)) is True
    assert not math.isfinite(grad_sumsq([grads], isa=isa))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
def test_grad_sumsq_matches_float64(isa, grad_dtype):
    gen = torch.Generator().manual_seed(11)
    grads = [torch.randn(n, generator=gen).to(grad_dtype) for n in (1, 15, 17, 1000003, 70000)]
    expected = sum(float(g.double().square().sum()) for g in grads)
    for threads in (1, 2, 3):
        got = grad_sumsq(grads, isa=isa, num_threads=threads)
        assert got == pytest.approx(expected, rel=1e-12)


def test_bad_arguments_name_what_is_wrong():
    p, g, m, v, s = torch.zeros(8), torch.zeros(8), torch.zeros(8), torch.zeros(8), torch.zeros(())
    cfg = AdamConfig()
    with pytest.raises(ConfigError, match=r"grads\[0\] has 4 elements"):
        adam_step([p], [torch.zeros(4)], [m], [v], [s], config=cfg)
    with pytest.raises(ConfigError, match=r"exp_avgs\[0\] has dtype torch.float64"):
        adam_step([p], [g], [m.double()], [v], [s], config=cfg)
    with pytest.raises(ConfigError, match=r"params\[0\] is not contiguous"):
        adam_step([torch.zeros(8, 2).t()[0]], [g], [m], [v], [s], config=cfg)
    with pytest.raises(ConfigError, match=r"steps has 2 tensors, params has 1"):
        adam_step([p], [g], [m], [v], [s, s], config=cfg)
    with pytest.raises(ConfigError, match=r"grads\[0\] has layout torch.sparse_coo"):
        adam_step([p], [g.to_sparse()], [m], [v], [s], config=cfg)
    with pytest.raises(ConfigError, match=r"grads have dtype torch.int32"):
        adam_step([p], [g.int()], [m], [v], [s], config=cfg)
    with pytest.raises(ConfigError, match="beta2 must be in"):
        AdamConfig(beta2=1.0)
    with pytest.raises(ConfigError, match="lr must be >= 0"):
        AdamConfig(lr=-1.0)
    with pytest.raises(ConfigError, match="unknown ISA 'sse9'"):
        AdamConfig(isa="sse9")
    assert isinstance(ConfigError("x"), ValueError)


def test_isa_choice_follows_the_environment(monkeypatch):
    monkeypatch.setenv("OFFLOAD_CPU_ADAM_ISA", "scalar")
    assert resolve_isa(None) == Isa.SCALAR
    monkeypatch.delenv("OFFLOAD_CPU_ADAM_ISA")
    assert resolve_isa(None) == available_isas()[-1]


def test_empty_call_is_a_no_op():
    assert adam_step([], [], [], [], [], config=AdamConfig()) is False
    assert grad_sumsq([]) == 0.0
