"""The landing pass (copy or add into fp32 accumulators, sum of squares on the way) against torch."""
from __future__ import annotations

import math

import pytest
import torch

from cpu_adam import available_isas, grad_land, grad_sumsq
from csrc import ConfigError

ISAS = [isa.name.lower() for isa in available_isas()]
SRC_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [1, 15, 16, 17, 65537, 300007]  # below, at and past a vector; past a chunk of the grid


def _pieces(sizes, dtype, offsets, seed):
    """Views at odd element offsets into larger buffers (so no piece starts on an aligned address),
    with their float64 values; the buffers are returned too, to check what lies around the views."""
    gen = torch.Generator().manual_seed(seed)
    srcs, dsts, bufs = [], [], []
    for n, off in zip(sizes, offsets):
        sbuf = (torch.randn(n + off + 5, generator=gen) * 3).to(dtype)
        dbuf = torch.randn(n + off + 3, generator=gen)
        srcs.append(sbuf[off:off + n])
        dsts.append(dbuf[off + 1:off + 1 + n])
        bufs.append((sbuf, dbuf))
    return srcs, dsts, bufs


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", SRC_DTYPES)
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("zero_sources", [False, True])
def test_land_matches_torch(isa, dtype, accumulate, zero_sources):
    offsets = [1, 3, 0, 7, 5, 2]
    srcs, dsts, bufs = _pieces(SIZES, dtype, offsets, seed=len(ISAS) + int(accumulate))
    before_src = [b[0].clone() for b in bufs]
    before_dst = [b[1].clone() for b in bufs]
    want = [(d.double() + s.double() if accumulate else s.double()) for s, d in zip(srcs, dsts)]
    total = grad_land(dsts, srcs, accumulate=accumulate, zero_sources=zero_sources, isa=isa)
    for d, w in zip(dsts, want):  # fp32 of an exact sum (copy) or of one rounding (add), as torch's add_
        assert torch.equal(d, w.float())
    want_sumsq = sum(float((w.float().double() ** 2).sum()) for w in want)
    assert math.isclose(total, want_sumsq, rel_tol=1e-12)
    for (sbuf, dbuf), s0, d0, n, off in zip(bufs, before_src, before_dst, SIZES, offsets):
        # nothing outside the views was touched
        assert torch.equal(sbuf[:off], s0[:off]) and torch.equal(sbuf[off + n:], s0[off + n:])
        assert torch.equal(dbuf[:off + 1], d0[:off + 1]) and torch.equal(dbuf[off + 1 + n:], d0[off + 1 + n:])
        if zero_sources:
            assert not sbuf[off:off + n].any()
        else:
            assert torch.equal(sbuf, s0)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", SRC_DTYPES)
@pytest.mark.parametrize("accumulate", [False, True])
def test_bf16_accumulators_hold_the_rounded_fp32_sum(isa, dtype, accumulate):
    """data_types.grad_accum_dtype bf16: dst = bf16(fp32(dst) + src), rounded to nearest even as torch
    rounds, bit for bit on every ISA, odd sizes and offsets; the sum of squares is of the values stored."""
    offsets = [1, 3, 0, 7, 5, 2]
    srcs, dsts32, _ = _pieces(SIZES, dtype, offsets, seed=5)
    dsts = [d.bfloat16() for d in dsts32]
    dsts[2][0] = 3.0e38  # + a source can round past bf16's largest: inf, as torch rounds it
    want = [((d.float() + s.float()) if accumulate else s.float()).bfloat16() for s, d in zip(srcs, dsts)]
    total = grad_land(dsts, srcs, accumulate=accumulate, isa=isa)
    for d, w in zip(dsts, want):
        assert torch.equal(d.view(torch.int16), w.view(torch.int16))
    want_sumsq = sum(float((w.double() ** 2).sum()) for w in want)
    assert math.isclose(total, want_sumsq, rel_tol=1e-12)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", SRC_DTYPES)
def test_sum_equals_grad_sumsq_of_the_result_with_any_thread_count(isa, dtype):
    sizes = [5, 70001, 1, 200003, 64, 131071]
    results = []
    for threads in (1, 2, 3, 7):
        srcs, dsts, _ = _pieces(sizes, dtype, [1] * len(sizes), seed=11)
        total = grad_land(dsts, srcs, accumulate=True, num_threads=threads, isa=isa)
        assert total == grad_sumsq(dsts, num_threads=threads, isa=isa)  # bit for bit: the same partials
        results.append((total, [d.clone() for d in dsts]))
    for total, ds in results[1:]:
        assert total == results[0][0]
        assert all(torch.equal(a, b) for a, b in zip(ds, results[0][1]))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_a_nonfinite_source_makes_the_sum_nonfinite(isa, bad):
    src = torch.randn(1000, dtype=torch.float16)
    src[517] = bad
    dst = torch.zeros(1000)
    total = grad_land([dst], [src], accumulate=False, isa=isa)
    assert not math.isfinite(total)


def test_micro_steps_accumulate_like_a_loop():
    gen = torch.Generator().manual_seed(3)
    micro = [torch.randn(4099, generator=gen).to(torch.bfloat16) for _ in range(4)]
    dst = torch.full((4099,), 123.0)  # stale: the first micro-step must overwrite it
    want = torch.zeros(4099)
    for i, g in enumerate(micro):
        total = grad_land([dst], [g.clone()], accumulate=i > 0)
        want = g.float() if i == 0 else want + g.float()
        assert torch.equal(dst, want)
    assert math.isclose(total, float((want.double() ** 2).sum()), rel_tol=1e-12)


def test_bad_arguments_name_what_is_wrong():
    f32 = torch.zeros(8)
    with pytest.raises(ConfigError, match="dsts has 1 tensors, srcs has 2"):
        grad_land([f32], [f32, f32], accumulate=False)
    with pytest.raises(ConfigError, match="srcs\\[0\\] has 7 elements"):
        grad_land([f32], [torch.zeros(7)], accumulate=False)
    with pytest.raises(ConfigError, match="dsts must be float32 or bfloat16 accumulators, got torch.float16"):
        grad_land([f32.half()], [f32], accumulate=False)
    with pytest.raises(ConfigError, match="dsts\\[1\\] has dtype torch.bfloat16, expected torch.float32"):
        grad_land([f32, f32.bfloat16()], [f32, f32], accumulate=False)
    with pytest.raises(ConfigError, match="srcs have dtype torch.float64"):
        grad_land([f32], [f32.double()], accumulate=False)
    with pytest.raises(ConfigError, match="not contiguous"):
        grad_land([torch.zeros(16)[::2]], [f32], accumulate=False)
    assert grad_land([], [], accumulate=True) == 0.0
