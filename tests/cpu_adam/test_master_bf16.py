"""A bfloat16 master with compressed or float32 moments ([Note: a bf16 master] in csrc/ofl_adam.h): its
stochastic rounding against the numpy reference, bit for bit, on every ISA and thread count; the
fused step equal to the fp32-master step of the widened master followed by that rounding; and
updates below the master's last place kept on average, where rounding to nearest loses them."""
from __future__ import annotations

import errno

import numpy as np
import pytest
import torch

from cpu_adam import AdamConfig, adam_step, available_isas
from cpu_adam.quant import bf16_round_sr, quantize, zeros_moments
from csrc import ConfigError
from tests.cpu_adam import reference_q8 as ref

ISAS = [isa.name.lower() for isa in available_isas()]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, bias_correction=True)


def _values(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.pow(10.0, torch.empty(n).uniform_(-30, 30, generator=gen))
    if n > 8:
        x[:6] = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 3.3895e38])
    return x


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n, first", [(1, 0), (15, 3), (1000, 0), (1001, 7), (4097, 70000), (100003, 2 ** 31)])
def test_rounding_matches_reference(isa, n, first):
    x = _values(n, n)
    for seed, step in [(0, 1), (12345678901234, 7), (2 ** 64 - 1, 100000)]:
        got = bf16_round_sr(x, seed=seed, step=step, first=first, isa=isa).view(torch.int16).numpy().view(np.uint16)
        assert np.array_equal(got, ref.bf16_round_sr(x.numpy(), seed, step, first))


def test_rounding_is_unbiased_and_each_way_only_to_a_neighbour():
    x = torch.full((200000,), 1.0 + 0.3 * 2.0 ** -7)  # 30% of the way from 1 to the next bf16 value
    r = bf16_round_sr(x, seed=5, step=1).float()
    assert set(r.unique().tolist()) == {1.0, 1.0 + 2.0 ** -7}
    up = (r > 1.0).double().mean().item()
    assert abs(up - 0.3) < 0.005
    assert not torch.equal(r, bf16_round_sr(x, seed=5, step=2).float())  # a new step, new bits
    assert not torch.equal(r, bf16_round_sr(x, seed=6, step=1).float())  # another tensor, new bits


def _moments(sd, n, seed):
    gen = torch.Generator().manual_seed(seed)
    mo = zeros_moments((n,), sd)
    m, v = torch.randn(n, generator=gen), torch.rand(n, generator=gen) * 1e-3
    if sd == "int8":
        quantize(m, signed=True, codes=mo.exp_avg, scales=mo.exp_avg_scale)
        quantize(v, signed=False, codes=mo.exp_avg_sq, scales=mo.exp_avg_sq_scale)
    else:
        mo.exp_avg.copy_(m)
        mo.exp_avg_sq.copy_(v)
    return mo


def _call(params, grads, mos, steps, cfg, **kw):
    q8 = mos[0].exp_avg_scale is not None
    return adam_step(params, grads, [m.exp_avg for m in mos], [m.exp_avg_sq for m in mos], steps, config=cfg,
                     exp_avg_scales=[m.exp_avg_scale for m in mos] if q8 else None,
                     exp_avg_sq_scales=[m.exp_avg_sq_scale for m in mos] if q8 else None, **kw)


def _clone(mos):
    return [type(mo)(*(None if t is None else t.clone() for t in mo)) for mo in mos]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("sd", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("out_dtype,adamw_mode", [(None, True), (torch.bfloat16, True), (torch.float32, False),
                                                  (torch.float16, True)])
def test_step_is_the_fp32_step_of_the_widened_master_then_rounded(isa, sd, out_dtype, adamw_mode):
    """AVX-512's int8 path rounds inside its full-block pass, the others through a tile of fp32 copies:
    each must be the fp32 step followed by the reference rounding, tails, L2 decay and an infinite
    gradient (the block's other pass) included."""
    sizes = [1, 17, 300, 2048, 2049, 6000, 70001]  # tiles of 2048 (whole, one over, a tail), chunks of 65536
    seeds = [3, 2 ** 40 + 1, 77, 0, 9, 2 ** 63, 5]
    gen = torch.Generator().manual_seed(1)
    masters = [(torch.randn(n, generator=gen) * 3).to(torch.bfloat16) for n in sizes]
    mos = [_moments(sd, n, n) for n in sizes]
    steps = [torch.full((1,), 4.0) for _ in sizes]
    cfg = AdamConfig(**HYPER, adamw_mode=adamw_mode, isa=isa)
    for k in range(3):
        grads = [torch.randn(n, generator=gen) for n in sizes]
        if k == 2:
            grads[6][300] = float("inf")  # a whole block's moments not finite
        wide = [m.float() for m in masters]  # the oracle: an fp32 master holding the same values
        want_mos, want_steps = _clone(mos), [s.clone() for s in steps]
        _call(wide, grads, want_mos, want_steps, cfg)
        outs = None if out_dtype is None else [torch.empty(n, dtype=out_dtype) for n in sizes]
        assert _call(masters, grads, mos, steps, cfg, params_out=outs, master_seeds=seeds) is (k == 2)
        for i, (m, w) in enumerate(zip(masters, wide)):
            bits = m.view(torch.int16).numpy().view(np.uint16)
            assert np.array_equal(bits, ref.bf16_round_sr(w.numpy(), seeds[i], 5 + k)), (i, k)
            assert all(torch.equal(a, b) for a, b in zip(mos[i], want_mos[i]) if a is not None)
            assert torch.equal(steps[i], want_steps[i])
            if outs is not None:
                if out_dtype is torch.bfloat16:  # the master's bits, NaNs too
                    assert torch.equal(outs[i].view(torch.int16), m.view(torch.int16))
                else:
                    torch.testing.assert_close(outs[i], m.float().to(out_dtype), rtol=0, atol=0, equal_nan=True)
            if k == 2 and i == 6:
                assert m[256:512].float().isnan().any()  # the infinite gradient's block


@pytest.mark.parametrize("sd", ["fp32", "bf16", "int8"])
def test_same_bits_on_every_isa_and_thread_count(sd):
    """Compressed moments: one result everywhere. float32 moments follow ofl_adam_step, whose scalar
    path may differ from the vector paths in a moment's last place: the same bits for every thread
    count, and on every vector ISA."""
    sizes = [70001, 1, 300, 130000, 65536]
    results = []
    isas = []
    for isa in ISAS:
        for threads in (1, 2, 3):
            gen = torch.Generator().manual_seed(11)
            masters = [torch.randn(n, generator=gen).to(torch.bfloat16) for n in sizes]
            mos = [_moments(sd, n, n) for n in sizes]
            steps = [torch.zeros(1) for _ in sizes]
            cfg = AdamConfig(**HYPER, isa=isa, num_threads=threads)
            for _ in range(3):
                _call(masters, [torch.randn(n, generator=gen) for n in sizes], mos, steps, cfg,
                      master_seeds=list(range(len(sizes))))
            results.append(torch.cat([m.view(torch.uint8) for m in masters]
                                     + [t.reshape(-1).view(torch.uint8) for mo in mos for t in mo if t is not None]))
            isas.append(isa)
    if sd == "fp32":
        for family in ({"scalar"}, set(ISAS) - {"scalar"}):
            mine = [r for r, isa in zip(results, isas) if isa in family]
            assert all(torch.equal(r, mine[0]) for r in mine[1:]), family
        return
    for r in results[1:]:
        assert torch.equal(r, results[0])


def test_updates_below_the_last_place_are_kept_on_average():
    """lr 1e-4 against bf16's spacing of 2^-7 at 1.0: round to nearest would leave every master at 1."""
    n, steps_run = 8192, 200
    master = torch.ones(n, dtype=torch.bfloat16)
    mo = zeros_moments((n,), "int8")
    step = [torch.zeros(1)]
    cfg = AdamConfig(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True)
    for _ in range(steps_run):
        _call([master], [torch.ones(n)], [mo], step, cfg, master_seeds=[42])
    # Adam's step with a constant gradient is lr each time: the mean moves by about lr * steps
    assert abs(master.float().mean().item() - (1.0 - 1e-4 * steps_run)) < 2e-3
    assert master.float().min().item() < 1.0


def test_bad_calls_name_what_is_wrong():
    n = 300
    mo = zeros_moments((n,), "bf16")
    cfg = AdamConfig(**HYPER)
    master = torch.zeros(n, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="master_seeds"):
        _call([master], [torch.zeros(n)], [mo], [torch.zeros(1)], cfg)
    with pytest.raises(ConfigError, match="master_seeds"):
        _call([master], [torch.zeros(n)], [mo], [torch.zeros(1)], cfg, master_seeds=[1, 2])
    with pytest.raises(ConfigError, match="float32 or bfloat16"):
        _call([master.half()], [torch.zeros(n)], [mo], [torch.zeros(1)], cfg, master_seeds=[1])
    with pytest.raises(ConfigError, match="not bfloat16"):
        adam_step([master.float()], [torch.zeros(n)], [torch.zeros(n)], [torch.zeros(n)], [torch.zeros(1)], config=cfg,
                  master_seeds=[1])


def test_the_c_entry_takes_fp32_moments_only_with_a_bf16_master():
    """ofl_adam_step_qm: fp32 moments with an fp32 master are ofl_adam_step's, so -EINVAL here."""
    from cpu_adam.kernels import config_struct, ffi, lib
    cfg = config_struct(AdamConfig(**HYPER), 1.0, lib.OFL_DTYPE_F32, lib.OFL_DTYPE_NONE)
    none = ffi.new("ofl_adam_qtensors *")  # count 0: only the arguments are checked
    assert lib.ofl_adam_step_qm(cfg, lib.OFL_STATE_F32, lib.OFL_DTYPE_F32, none, ffi.NULL, ffi.NULL) == -errno.EINVAL
    assert lib.ofl_adam_step_q(cfg, lib.OFL_STATE_F32, none, ffi.NULL) == -errno.EINVAL
    assert lib.ofl_adam_step_qm(cfg, lib.OFL_STATE_F32, lib.OFL_DTYPE_BF16, none, ffi.NULL, ffi.NULL) == 0
    assert lib.ofl_adam_step_qm(cfg, 3, lib.OFL_DTYPE_BF16, none, ffi.NULL, ffi.NULL) == -errno.EINVAL
