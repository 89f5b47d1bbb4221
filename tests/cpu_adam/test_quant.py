"""Compressed Adam states (bf16, int8 blockwise) against the numpy reference, bit for bit, on every
ISA this CPU runs and any thread count; and int8 training against torch's AdamW."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cpu_adam import AdamConfig, CPUAdamW, adam_step, available_isas
from cpu_adam.quant import StateDtype, dequantize, q8_map, quantize, zeros_moments
from csrc import ConfigError
from tests.cpu_adam import reference_q8 as ref

ISAS = [isa.name.lower() for isa in available_isas()]
SIZES = [1, 7, 255, 256, 257, 1000, 65536 + 13, 200003]


def _wide(n: int, seed: int) -> torch.Tensor:
    """Values spanning many decades, both signs, with zeros and a zero block."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.pow(10.0, torch.empty(n).uniform_(-9, 3, generator=gen))
    x[::17] = 0.0
    x[::29] = -0.0
    if n > 600:
        x[256:512] = 0.0
    return x


def test_maps_are_the_reference_maps():
    assert torch.equal(q8_map(True), torch.from_numpy(ref.SIGNED))
    assert torch.equal(q8_map(False), torch.from_numpy(ref.UNSIGNED))
    assert q8_map(True)[127] == 1.0 and q8_map(False)[255] == 1.0
    assert bool((q8_map(False).diff() > 0).all())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("n", SIZES)
def test_quantize_matches_reference(isa, signed, n):
    x = _wide(n, n)
    if not signed:
        x = x.abs()
    codes, scales = quantize(x, signed=signed, isa=isa)
    want_codes, want_scales = ref.quantize(x.numpy(), signed)
    assert np.array_equal(scales.numpy(), want_scales)
    assert np.array_equal(codes.numpy(), want_codes)
    back = dequantize(codes, scales, signed=signed, isa=isa)
    assert np.array_equal(back.numpy(), ref.dequantize(want_codes, want_scales, signed))


@pytest.mark.parametrize("isa", ISAS)
def test_codes_are_nearest_and_huge_values_and_tiny_v(isa):
    for signed, mag in ((True, ref.SIGNED_MAG), (False, ref.UNSIGNED)):
        x = torch.from_numpy(mag[1:].astype(np.float32))  # its last is 1: scale 1, a == x
        codes, _ = quantize(x, signed=signed, isa=isa)
        assert np.array_equal(codes.numpy(), np.arange(1, len(mag)))  # the map codes to itself
        a = torch.rand(20000, generator=torch.Generator().manual_seed(5)) ** 6  # many decades
        a[0] = 1.0
        codes, scales = quantize(a, signed=signed, isa=isa)
        back = dequantize(codes, scales, signed=signed)
        table = torch.from_numpy(mag.astype(np.float64))
        best = (a.double()[:, None] * scales.repeat_interleave(256)[:a.numel(), None].double().reciprocal()
                - table[None, :]).abs().min(dim=1).values * scales.repeat_interleave(256)[:a.numel()].double()
        err = (back.double() - a.double()).abs()
        smallest = float(mag[1]) * scales.repeat_interleave(256)[:a.numel()].double()
        # the nearest value but for float rounding at a midpoint, or below the smallest decade's
        assert bool((err <= best + 1e-6 * scales.repeat_interleave(256)[:a.numel()].double() + smallest).all())
        assert bool((err <= best * 1.0001 + 1e-6 * scales.repeat_interleave(256)[:a.numel()].double())[a > 1e-3].all())
    huge = torch.tensor([3.0e38, -3.3e38, 1e-30, 0.0] * 70)
    codes, scales = quantize(huge, signed=True, isa=isa)
    assert np.array_equal(codes.numpy(), ref.quantize(huge.numpy(), True)[0])
    assert dequantize(codes, scales, signed=True)[1] == -3.3e38
    tiny = torch.tensor([1.0] + [1e-20] * 255)  # far under the smallest code: v stays positive
    codes, _ = quantize(tiny, signed=False, isa=isa)
    assert bool((codes[1:] == 1).all())


def _moments(sd, n, seed):
    mo = zeros_moments((n,), sd)
    if sd == "int8":  # start from a quantized random state
        quantize(_wide(n, seed), signed=True, codes=mo.exp_avg, scales=mo.exp_avg_scale)
        quantize(_wide(n, seed + 1).abs() * 1e-3, signed=False, codes=mo.exp_avg_sq, scales=mo.exp_avg_sq_scale)
    else:
        mo.exp_avg.copy_(_wide(n, seed))
        mo.exp_avg_sq.copy_(_wide(n, seed + 1).abs() * 1e-3)
    return mo


def _ref_moments(sd, mo):
    if sd == "int8":
        return (ref.dequantize(mo.exp_avg.numpy(), mo.exp_avg_scale.numpy(), True),
                ref.dequantize(mo.exp_avg_sq.numpy(), mo.exp_avg_sq_scale.numpy(), False))
    return mo.exp_avg.float().numpy(), mo.exp_avg_sq.float().numpy()


def _call(params, grads, mos, steps, cfg, **kw):
    q8 = mos[0].exp_avg_scale is not None
    return adam_step(params, grads, [m.exp_avg for m in mos], [m.exp_avg_sq for m in mos], steps, config=cfg,
                     exp_avg_scales=[m.exp_avg_scale for m in mos] if q8 else None,
                     exp_avg_sq_scales=[m.exp_avg_sq_scale for m in mos] if q8 else None, **kw)


HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, bias_correction=True)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("sd", ["bf16", "int8"])
@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_fused_step_matches_reference(isa, sd, adamw_mode, grad_dtype):
    sizes = [1, 17, 300, 4099]
    gen = torch.Generator().manual_seed(3)
    params = [torch.randn(n, generator=gen) * 10 for n in sizes]
    mos = [_moments(sd, n, 7 * n) for n in sizes]
    steps = [torch.full((1,), 4.0) for _ in sizes]
    outs = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    cfg = AdamConfig(**HYPER, adamw_mode=adamw_mode, isa=isa)
    for k in range(3):
        grads = [(torch.randn(n, generator=gen) * 1e3).to(grad_dtype) for n in sizes]
        grads[0][:] = 0.0
        want = []
        for p, g, mo in zip(params, grads, mos):
            m0, v0 = _ref_moments(sd, mo)
            c = ref.coeffs(**HYPER, adamw_mode=adamw_mode, step=5.0 + k, grad_scale=0.5)
            want.append(ref.step(p.numpy().copy(), g.float().numpy(), m0, v0, c))
        assert _call(params, grads, mos, steps, cfg, grad_scale=0.5, params_out=outs) is False
        for (wp, wm, wv), p, mo, out in zip(want, params, mos, outs):
            assert np.array_equal(p.numpy(), wp)
            assert torch.equal(out, p.to(torch.bfloat16))
            if sd == "int8":
                cm, sm = ref.quantize(wm, True)
                cv, sv = ref.quantize(wv, False)
                assert np.array_equal(mo.exp_avg_scale.numpy(), sm) and np.array_equal(mo.exp_avg_sq_scale.numpy(), sv)
                assert np.array_equal(mo.exp_avg.numpy(), cm) and np.array_equal(mo.exp_avg_sq.numpy(), cv)
            else:
                assert np.array_equal(mo.exp_avg.float().numpy(), ref.bf16_round(wm))
                assert np.array_equal(mo.exp_avg_sq.float().numpy(), ref.bf16_round(wv))


@pytest.mark.parametrize("sd", ["bf16", "int8"])
def test_same_bits_on_every_isa_and_thread_count(sd):
    sizes = [70001, 1, 300, 130000, 65536]
    results = []
    for isa in ISAS:
        for threads in (1, 2, 3, 5):
            gen = torch.Generator().manual_seed(11)
            params = [torch.randn(n, generator=gen) for n in sizes]
            mos = [_moments(sd, n, n) for n in sizes]
            steps = [torch.zeros(1) for _ in sizes]
            cfg = AdamConfig(**HYPER, isa=isa, num_threads=threads)
            for _ in range(3):
                _call(params, [torch.randn(n, generator=gen) for n in sizes], mos, steps, cfg)
            results.append(torch.cat([torch.cat([p.view(torch.uint8) for p in params])]
                                     + [t.reshape(-1).view(torch.uint8) for mo in mos for t in mo if t is not None]))
    for r in results[1:]:
        assert torch.equal(r, results[0])


def test_state_dtype_names_and_errors():
    assert StateDtype.parse("INT8") is StateDtype.INT8
    with pytest.raises(ConfigError, match="state_dtype.*fp8"):
        StateDtype.parse("fp8")
    mo = zeros_moments((300,), "int8")
    with pytest.raises(ConfigError, match="exp_avg_scales"):
        adam_step([torch.zeros(300)], [torch.zeros(300)], [mo.exp_avg], [mo.exp_avg_sq], [torch.zeros(1)],
                  config=AdamConfig())
    with pytest.raises(ConfigError, match="exp_avg_scales"):
        adam_step([torch.zeros(300)], [torch.zeros(300)], [mo.exp_avg], [mo.exp_avg_sq], [torch.zeros(1)],
                  config=AdamConfig(), exp_avg_scales=[torch.zeros(1)], exp_avg_sq_scales=[mo.exp_avg_sq_scale])
    assert StateDtype.INT8.moment_bytes(1000) == 2 * 1000 + 8 * 4


@pytest.mark.parametrize("sd,tol", [("bf16", 0.02), ("int8", 0.05)])
def test_training_tracks_torch_adamw(sd, tol):
    """A small regression trained 300 steps: the loss curve stays within ``tol`` of torch's AdamW."""
    gen = torch.Generator().manual_seed(0)
    x, w_true = torch.randn(512, 64, generator=gen), torch.randn(64, 32, generator=gen)
    y = torch.tanh(x @ w_true) + 0.05 * torch.randn(512, 32, generator=gen)

    def train(make):
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
        opt = make(model.parameters())
        losses = []
        for _ in range(300):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return np.array(losses)

    theirs = train(lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.01))
    ours = train(lambda ps: CPUAdamW(ps, lr=3e-3, weight_decay=0.01, state_dtype=sd))
    assert theirs[-1] < 0.3 * theirs[0]  # it did learn
    assert np.all(np.abs(ours[50:] - theirs[50:]) <= tol * theirs[50:] + 1e-3), np.abs(ours - theirs).max()


def test_optimizer_state_dict_moves_between_state_dtypes():
    """A CPUAdamW state saved with fp32 moments loads into an int8 one (quantized: close) and back."""
    gen = torch.Generator().manual_seed(4)
    w = torch.nn.Parameter(torch.randn(1000, generator=gen))
    opt = CPUAdamW([w], lr=1e-2)
    for _ in range(3):
        w.grad = torch.randn(1000, generator=gen)
        opt.step()
    saved = opt.state_dict()
    q = CPUAdamW([torch.nn.Parameter(w.detach().clone())], lr=1e-2, state_dtype="int8")
    q.load_state_dict(saved)
    st = next(iter(q.state.values()))
    assert st["exp_avg"].dtype == torch.uint8 and st["exp_avg_scale"].numel() == 4
    m = dequantize(st["exp_avg"], st["exp_avg_scale"], signed=True)
    torch.testing.assert_close(m, saved["state"][0]["exp_avg"], rtol=0.02, atol=0.02 * m.abs().max().item())
    back = CPUAdamW([torch.nn.Parameter(w.detach().clone())], lr=1e-2)
    back.load_state_dict(q.state_dict())  # int8 codes (made float by torch's loader) -> fp32
    assert torch.equal(next(iter(back.state.values()))["exp_avg"], m)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("sd", ["bf16", "int8"])
def test_a_non_finite_gradient_is_reported(isa, sd):
    n = 1000
    mo = zeros_moments((n,), sd)
    g = torch.zeros(n)
    g[997] = float("inf")  # in every ISA's tail handling
    q8 = sd == "int8"
    bad = adam_step([torch.zeros(n)], [g], [mo.exp_avg], [mo.exp_avg_sq], [torch.zeros(1)], config=AdamConfig(isa=isa),
                    exp_avg_scales=[mo.exp_avg_scale] if q8 else None, exp_avg_sq_scales=[mo.exp_avg_sq_scale] if q8 else None)
    assert bad is True
    g[997] = 0.0
    assert adam_step([torch.zeros(n)], [g], [mo.exp_avg], [mo.exp_avg_sq], [torch.zeros(1)], config=AdamConfig(isa=isa),
                     exp_avg_scales=[mo.exp_avg_scale] if q8 else None,
                     exp_avg_sq_scales=[mo.exp_avg_sq_scale] if q8 else None) is False  # gradients only


def _edge_blocks(signed: bool) -> torch.Tensor:
    """Whole blocks of the cases the whole-block path hands to the general one, or must not:
    ordinary, subnormal (a scale whose reciprocal overflows), tiny normal, all zeros, all -0.0,
    an inf and a NaN among ordinary values, one huge value."""
    gen = torch.Generator().manual_seed(23)
    blocks = [torch.randn(256, generator=gen), torch.randn(256, generator=gen) * 1e-40,
              torch.randn(256, generator=gen) * 1e-37, torch.zeros(256), torch.full((256,), -0.0)]
    for bad in (float("inf"), float("nan"), 3e38):
        b = torch.randn(256, generator=gen)
        b[77] = bad
        blocks.append(b)
    x = torch.cat(blocks)
    return x if signed else x.abs()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the reference's inf and NaN arithmetic
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("signed", [True, False])
def test_whole_blocks_at_the_edges_match_reference(isa, signed):
    x = _edge_blocks(signed)
    codes, scales = quantize(x, signed=signed, isa=isa)
    want_codes, want_scales = ref.quantize(x.numpy(), signed)
    assert np.array_equal(scales.numpy().view(np.uint32), want_scales.view(np.uint32))
    assert np.array_equal(codes.numpy(), want_codes)
    back = dequantize(codes, scales, signed=signed, isa=isa)
    assert np.array_equal(back.numpy().view(np.uint32), ref.dequantize(want_codes, want_scales, signed).view(np.uint32))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("grad_scale", [1.0, 0.5])
@pytest.mark.parametrize("case", ["inf_grad", "nan_grad", "v_overflows", "finite"])
def test_whole_blocks_with_non_finite_values_match_reference(isa, grad_scale, case):
    """Four whole blocks, the third one's gradient not finite (reported) or so large that v
    overflows with the gradient finite (not reported); every bit as the reference's."""
    n = 4 * 256
    gen = torch.Generator().manual_seed(29)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen)
    g[600] = {"inf_grad": float("inf"), "nan_grad": float("nan"), "v_overflows": 1e30, "finite": 3.0}[case]
    mo = _moments("int8", n, 31)
    m0, v0 = _ref_moments("int8", mo)
    c = ref.coeffs(**HYPER, adamw_mode=True, step=1.0, grad_scale=grad_scale)
    wp, wm, wv = ref.step(p.numpy().copy(), g.numpy(), m0, v0, c)
    bad = _call([p], [g], [mo], [torch.zeros(1)], AdamConfig(**HYPER, isa=isa), grad_scale=grad_scale)
    assert bad is (case in ("inf_grad", "nan_grad"))
    assert np.array_equal(p.numpy().view(np.uint32), wp.view(np.uint32))
    cm, sm = ref.quantize(wm, True)
    cv, sv = ref.quantize(wv, False)
    assert np.array_equal(mo.exp_avg_scale.numpy().view(np.uint32), sm.view(np.uint32))
    assert np.array_equal(mo.exp_avg_sq_scale.numpy().view(np.uint32), sv.view(np.uint32))
    assert np.array_equal(mo.exp_avg.numpy(), cm) and np.array_equal(mo.exp_avg_sq.numpy(), cv)
