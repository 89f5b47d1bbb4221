"""Gradients on one rank: autograd's own tensors are landed (no accumulation into zeroed views),
so after backward ``.grad`` holds the gradient as torch's does and the flat buffer stays zero;
under accumulation the flat buffer is used, and both agree with torch's gradients."""
from __future__ import annotations

import pytest
import torch

from offload.builder import initialize
from tests.offload.harness import engine_config, loss_fn, make_batches, param_groups, torch_optimizer, twin_models


def _torch_grads(model, batches) -> dict[str, torch.Tensor]:
    """The oracle: torch's gradient of the summed (mean per micro-batch / count) loss."""
    for x, y in batches:
        (loss_fn(model(x), y) / len(batches)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("device", ["none", "cpu"])
def test_grad_after_backward_is_autograds_and_the_flat_buffer_stays_zero(stage, device, tmp_path):
    model, ref = twin_models()
    (x, y), = make_batches(1, 8)
    want = _torch_grads(ref, [(x, y)])
    engine, _, _, _ = initialize(model=model, config=engine_config(stage=stage, device=device),
                                 model_parameters=param_groups(model))
    try:
        for _ in range(2):  # the second backward too (after a step)
            engine.backward(loss_fn(engine(x), y))
            assert not engine.reducer.flat_grads.any()
            for name, p in model.named_parameters():
                if name in want:
                    torch.testing.assert_close(p.grad, want[name], msg=lambda m: f"{name}: {m}")
                elif p.requires_grad:
                    assert p.grad is None, f"{name} got no gradient from autograd: it has none, as in torch"
            sumsq = sum(float((g.double() ** 2).sum()) for g in want.values())
            assert engine.adam.sumsq == pytest.approx(sumsq, rel=1e-6)
            engine.step()
            want = _torch_grads(_step_like(ref, model), [(x, y)])
    finally:
        engine.close()


def _step_like(ref, model):
    """The oracle model with the engine's updated params (so the next gradients can be compared)."""
    with torch.no_grad():
        for (_, r), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
            r.copy_(p)
            r.grad = None
    return ref


def test_accumulation_uses_the_flat_buffer_and_lands_the_sum(tmp_path):
    model, ref = twin_models()
    batches = make_batches(2, 8)
    want = _torch_grads(ref, batches)
    cfg = engine_config(stage=1, device="cpu", batch_size=8, gas=2)
    engine, _, _, _ = initialize(model=model, config=cfg, model_parameters=param_groups(model))
    try:
        for i, (x, y) in enumerate(batches):
            engine.backward(loss_fn(engine(x), y))
            if i == 0:  # not reduced yet: the micro-step's gradient sits in the flat buffer
                flat = engine.reducer.flat_grads
                lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
                assert flat.any()
                assert all(lo <= p.grad.data_ptr() < hi for p in model.parameters() if p.requires_grad)
            engine.step()
        # the landed accumulators hold the sum: the step's grad norm is torch's
        norm = sum(float((g.double() ** 2).sum()) for g in want.values()) ** 0.5
        assert engine.last_grad_norm == pytest.approx(norm, rel=1e-5)
        assert not engine.reducer.flat_grads.any()
    finally:
        engine.close()


def test_land_takes_a_shard_tensor_too():
    """The tensor form (a reducer that hands over a bucket's shard as one tensor) lands the same bytes."""
    model, _ = twin_models()
    engine, _, _, _ = initialize(model=model, config=engine_config(stage=1, device="cpu"),
                                 model_parameters=param_groups(model))
    try:
        adam, bucket = engine.adam, engine.layout.buckets[0]
        shard = torch.randn(bucket.shard_numel, generator=torch.Generator().manual_seed(5))
        assert adam.land(bucket, shard, True, True) is False  # nothing zeroed unless asked
        base = bucket.shard_start(engine.layout.rank)
        landed = 0.0
        for sg in engine.layout.sub_groups:
            for p in sg.pieces:
                if p.bucket == bucket.index:
                    got = adam.storage.grad(sg.index)[p.sub_start:p.sub_start + p.numel]
                    assert torch.equal(got, shard[p.flat_start - base:p.flat_start - base + p.numel])
                    landed += float((got.double() ** 2).sum())
        assert adam.global_sumsq() == pytest.approx(landed, rel=1e-12) and landed > 0
    finally:
        engine.close()


@pytest.mark.parametrize("stage", [0, 1])
def test_zero_grad_in_the_middle_of_an_accumulation_cycle_drops_what_was_accumulated(stage):
    """torch's rule: ``zero_grad()`` after two of four micro-steps leaves only the last two's gradient
    for the step. Checked by the step's gradient norm (the landed sum) and the params after it,
    against torch doing the same, over several cycles. Stages 0 and 1 hold the cycle's gradient in the
    flat buffer until the boundary; stage 2 reduces every micro-step into the optimizer's accumulators,
    which ``zero_grad()`` leaves alone, as DeepSpeed's stage 2 leaves its partitioned gradients."""
    gas, micro, steps = 4, 4, 3
    model, ref = twin_models()
    batches = make_batches(steps, gas * micro)
    opt = torch_optimizer("AdamW", param_groups(ref), foreach=False)
    cfg = engine_config(stage=stage, device="cpu", batch_size=micro, gas=gas)
    engine, _, _, _ = initialize(model=model, config=cfg, model_parameters=param_groups(model))
    try:
        for x, y in batches:
            for i, (mx, my) in enumerate(zip(x.chunk(gas), y.chunk(gas))):
                if i == 2:
                    ref.zero_grad(set_to_none=False)
                    engine.zero_grad()
                (loss_fn(ref(mx), my) / gas).backward()
                engine.backward(loss_fn(engine(mx), my))
                engine.step()
            norm = sum(float((p.grad.double() ** 2).sum()) for p in ref.parameters() if p.grad is not None) ** 0.5
            opt.step()
            ref.zero_grad(set_to_none=True)
            assert engine.get_global_grad_norm() == pytest.approx(norm, rel=1e-5)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), msg=lambda m: f"{name}: {m}")
    finally:
        engine.close()
