"""What the engine tests share: a tiny model, its data, a config builder, and two training
loops over the same batches: the engine's, and plain torch's (the oracle).

The model is small on purpose (about 3,000 parameters) but has what exercises the layout:
odd sizes (padding in every bucket), LayerNorms, a parameter that forward never uses (its
gradient is zero in the engine and absent in torch; it sits in the no-decay group so both
leave it alone), and a frozen parameter (not trainable, so not in the optimizer at all).
"""
from __future__ import annotations

import copy
import math
from typing import Any, Callable, Iterable

import torch
from torch import nn

from offload.builder import initialize

IN_FEATURES, HIDDEN, OUT_FEATURES = 13, 37, 5
LR = 1e-2
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.999)
EPS = 1e-8

# Small sizes so one model makes several buckets and several sub-groups (and, with nvme, more
# sub-groups than the window of buffer_count blocks in host memory).
BUCKET_NUMEL = 700
SUB_GROUP_NUMEL = 512
BUFFER_COUNT = 2


class TinyNet(nn.Module):
    """Two blocks (Linear, LayerNorm, GELU) and a head, plus an unused and a frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN_FEATURES, HIDDEN)
        self.ln1 = nn.LayerNorm(HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN)
        self.ln2 = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, OUT_FEATURES)
        self.unused = nn.Parameter(torch.randn(7, 3))
        self.frozen_shift = nn.Parameter(torch.randn(OUT_FEATURES) * 0.1, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.ln1(self.fc1(x)))
        h = nn.functional.gelu(self.ln2(self.fc2(h)))
        return self.head(h) + self.frozen_shift


def make_model(seed: int = 0) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet()


def make_batches(steps: int, batch_size: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed regression problem: targets from a random linear map plus noise."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(IN_FEATURES, OUT_FEATURES, generator=gen)
    out = []
    for _ in range(steps):
        x = torch.randn(batch_size, IN_FEATURES, generator=gen)
        out.append((x, x @ w + 0.1 * torch.randn(batch_size, OUT_FEATURES, generator=gen)))
    return out


def overflowing(batches: list, steps: set[int]) -> list:
    """Targets a million times too large at ``steps``: the loss stays finite in fp32 but its
    gradient, times an fp16 loss scale, is beyond fp16's range at the model's output."""
    return [(x, y * 1e6) if i in steps else (x, y) for i, (x, y) in enumerate(batches)]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """MSE computed in fp32 whatever the model's dtype."""
    return nn.functional.mse_loss(output.float(), target.float())


def param_groups(model: nn.Module, weight_decay: float = WEIGHT_DECAY) -> list[dict[str, Any]]:
    """Matrices decay; biases, LayerNorms and the unused parameter do not."""
    decay = [p for n, p in model.named_parameters() if p.requires_grad and n.endswith("weight") and p.dim() == 2]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and not (n.endswith("weight") and p.dim() == 2)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def engine_config(*, stage: int = 0, device: str = "none", nvme_path: str | None = None, batch_size: int = 8,
                  optimizer: str = "AdamW", adam_w_mode: bool | None = None, world_size: int = 1,
                  gas: int = 1, **top: Any) -> dict[str, Any]:
    """A DeepSpeed-style config; ``top`` adds or replaces top-level sections."""
    params: dict[str, Any] = {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY}
    if adam_w_mode is not None:
        params["adam_w_mode"] = adam_w_mode
    offload: dict[str, Any] = {"device": device}
    if device == "nvme":
        offload.update(nvme_path=str(nvme_path), buffer_count=BUFFER_COUNT)
    cfg = {
        "train_batch_size": batch_size * gas,
        "train_micro_batch_size_per_gpu": batch_size // world_size,
        "gradient_accumulation_steps": gas,
        "steps_per_print": 1000,
        "optimizer": {"type": optimizer, "params": params},
        "zero_optimization": {"stage": stage, "offload_optimizer": offload, "sub_group_size": SUB_GROUP_NUMEL,
                              "reduce_bucket_size": BUCKET_NUMEL},
    }
    cfg.update(top)
    return cfg


def torch_optimizer(kind: str, groups: list[dict[str, Any]], **kw: Any) -> torch.optim.Optimizer:
    """The oracle's optimizer: ``AdamW`` (decoupled decay) or ``Adam`` (L2 decay)."""
    cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[kind]
    return cls(groups, lr=LR, betas=BETAS, eps=EPS, **kw)


def run_engine(model: nn.Module, config: dict[str, Any], batches: Iterable, *, gas: int = 1,
               groups: Callable[[nn.Module], list] | None = param_groups,
               on_step: Callable[[Any, int], None] | None = None, lrs_out: list[list[float]] | None = None,
               ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train ``model`` with the engine over ``batches``, each split into ``gas`` micro-batches.
    Returns the loss of every optimizer step (mean over its micro-batches) and the final params;
    ``on_step(engine, step)`` runs after each step, ``lrs_out`` gets the LRs each step used."""
    engine, _, _, _ = initialize(model=model, config=config,
                                 model_parameters=groups(model) if groups is not None else None)
    losses = []
    try:
        for step, (x, y) in enumerate(batches):
            if lrs_out is not None:
                lrs_out.append(engine.get_lr())
            total = 0.0
            for mx, my in zip(x.chunk(gas), y.chunk(gas)):
                loss = loss_fn(engine(mx), my)
                engine.backward(loss)
                engine.step()
                total += loss.item()
            losses.append(total / gas)
            if on_step is not None:
                on_step(engine, step)
        engine.settle()  # (offload.step_under_forward: the last step's tail, which no forward waited for)
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        if engine.stage3 is not None:  # the module's params are empty between steps: gathered from the shards
            params = {n: v.float() for n, v in engine.consolidated_16bit_state_dict().items() if n in params}
    finally:
        engine.close()
    return losses, params


def train_and_close(engine: Any, batches: Iterable, loss_of: Callable[[Any, Any, Any], torch.Tensor]) -> list[float]:
    """One engine step per batch (``loss_of(engine, x, y)``), the losses; the engine closed after."""
    losses = []
    try:
        for x, y in batches:
            loss = loss_of(engine, x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    finally:
        engine.close()
    return losses


def run_torch(model: nn.Module, batches: Iterable, *, optimizer: str = "AdamW", gas: int = 1,
              clip: float = 0.0, lr_at: Callable[[int], float] | None = None,
              norms_out: list[float] | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The oracle: plain torch over the same batches; accumulation by hand (loss / gas per
    micro-batch), clipping by ``clip_grad_norm_`` (its norms appended to ``norms_out``), the
    LR set per step by ``lr_at``."""
    opt = torch_optimizer(optimizer, param_groups(model), foreach=False)
    losses = []
    for step, (x, y) in enumerate(batches):
        if lr_at is not None:
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        mean_loss = accumulate(model, x, y, gas)
        if clip:
            norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], clip)
            if norms_out is not None:
                norms_out.append(norm.item())
        opt.step()
        losses.append(mean_loss)
    return losses, {n: p.detach().float().clone() for n, p in model.named_parameters()}


def accumulate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, gas: int,
               loss_of: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> float:
    """Forward and backward of one step's ``gas`` micro-batches (loss / gas each); their mean loss.
    ``loss_of(model, x, y)``: the loss (default ``loss_fn(model(x), y)``)."""
    total = 0.0
    for mx, my in zip(x.chunk(gas), y.chunk(gas)):
        loss = loss_of(model, mx, my) if loss_of is not None else loss_fn(model(mx), my)
        (loss / gas).backward()
        total += loss.item()
    return total / gas


def twin_models(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """The same initial model twice: one for the engine (which re-homes its params), one for torch."""
    model = make_model(seed)
    return model, copy.deepcopy(model)


def assert_matches_torch(losses: list[float], params: dict[str, torch.Tensor], batches: list, *, clip: float = 0.0,
                         device: str = "cpu", rel: float = 1e-5) -> None:
    """The engine's losses and final params against the oracle (``run_torch`` on ``device`` over ``batches``):
    losses within ``rel``, params within ``assert_close``'s fp32 defaults."""
    _, ref = twin_models()
    ref_losses, ref_params = run_torch(ref.to(device), [(x.to(device), y.to(device)) for x, y in batches], clip=clip)
    assert_losses_close(losses, ref_losses, rel=rel)
    for name in params:  # (stage 3's params are gathered to the host)
        torch.testing.assert_close(params[name], ref_params[name].to(params[name].device), msg=lambda m: f"{name}: {m}")


def assert_losses_close(ours: list[float], theirs: list[float], rel: float) -> None:
    """Every step's loss within ``rel`` relative of the oracle's."""
    assert len(ours) == len(theirs)
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))
    bad = [(i, a, b) for i, (a, b) in enumerate(zip(ours, theirs)) if not math.isclose(a, b, rel_tol=rel, abs_tol=0)]
    assert not bad, f"losses differ beyond {rel:g} relative (worst {worst:.3g}) at (step, ours, torch): {bad[:5]}"


def run_mixed(model: nn.Module, batches: Iterable, dtype: torch.dtype, *, scaler: Any = None, clip: float = 0.0,
              ) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    """The mixed-precision oracle in plain torch: a ``dtype`` copy of the model computes
    forward and backward (the loss times the scale); ``torch.optim.AdamW`` steps fp32 master
    weights on the unscaled (and clipped) gradients; the masters are copied back to ``dtype``.
    A non-finite gradient skips the step. ``scaler`` (``scale``, ``update(overflow)``) is the
    loss scale; none means 1. Returns the losses, the ``dtype`` params (as fp32), and the
    scale each step used."""
    master = copy.deepcopy(model).float()
    low = copy.deepcopy(model).to(dtype)
    opt = torch_optimizer("AdamW", param_groups(master), foreach=False)
    losses, scales = [], []
    for x, y in batches:
        low.zero_grad(set_to_none=True)
        scale = scaler.scale if scaler is not None else 1.0
        loss = loss_fn(low(x.to(dtype)), y)
        (loss * scale).backward()
        grads = [None if q.grad is None else q.grad.float() / scale for q in low.parameters()]
        overflow = any(g is not None and not torch.isfinite(g).all() for g in grads)
        if not overflow:
            for p, g in zip(master.parameters(), grads):
                p.grad = g
            if clip:
                torch.nn.utils.clip_grad_norm_([p for p in master.parameters() if p.grad is not None], clip)
            opt.step()
            with torch.no_grad():
                for p, q in zip(master.parameters(), low.parameters()):
                    q.copy_(p)
        if scaler is not None:
            scaler.update(overflow)
        losses.append(loss.item())
        scales.append(scale)
    return losses, {n: p.detach().float().clone() for n, p in low.named_parameters()}, scales
