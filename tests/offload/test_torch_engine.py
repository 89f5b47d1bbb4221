"""TorchEngine against the same loop written with torch directly."""
import pytest
import torch
from torch import nn

from csrc.errors import ConfigError
from offload.torch_engine import TorchEngine, TorchEngineConfig


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def _batches():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 6, generator=gen), torch.randn(4, 1, generator=gen)) for _ in range(12)]


def test_accumulation_clipping_and_warmup_match_a_hand_loop():
    config = TorchEngineConfig(micro_batch=4, grad_accum=3, lr=0.05, warmup_min_lr=0.01, warmup_steps=2,
                               weight_decay=0.1, grad_clip_norm=0.5)
    model, ref = _model(), _model()
    engine = TorchEngine(model, config)
    opt = torch.optim.AdamW(ref.parameters(), lr=config.lr, weight_decay=0.1)
    lrs = [0.01, 0.03, 0.05, 0.05]
    batches = _batches()
    for step in range(4):
        for x, y in batches[3 * step:3 * step + 3]:
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            (nn.functional.mse_loss(ref(x), y) / 3).backward()
        for group in opt.param_groups:
            group["lr"] = lrs[step]
        nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        assert engine.global_steps == step + 1
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q)
    assert engine.get_lr() == [0.05]
    stats = engine.offload_stats()
    n = sum(p.numel() for p in model.parameters())
    assert stats.optimizer_steps == 4 and stats.state_bytes_by_tier["device"] == 3 * 4 * n


def test_step_between_boundaries_does_not_step():
    engine = TorchEngine(_model(), TorchEngineConfig(micro_batch=4, grad_accum=2))
    before = [p.detach().clone() for p in engine.module.parameters()]
    x, y = _batches()[0]
    engine.backward(nn.functional.mse_loss(engine(x), y))
    assert engine.is_gradient_accumulation_boundary() is False
    engine.step()
    assert engine.global_steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))


def test_bad_config_names_the_field():
    with pytest.raises(ConfigError, match="grad_accum"):
        TorchEngineConfig(micro_batch=1, grad_accum=0)
