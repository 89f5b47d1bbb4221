"""``TorchEngine``: the DeepSpeed-style training API over plain torch, one process.

The demo's loop (``loss = engine(x, y); engine.backward(loss); engine.step()``) runs
on this when ``offload.initialize`` is not available, and it is the plain-torch
side of a comparison with the offload engine: ``torch.optim.AdamW``; a linear
warm-up where optimizer step ``s`` (from 0) runs at ``warmup_min_lr + (lr -
warmup_min_lr) * s / warmup_steps`` until ``s`` reaches ``warmup_steps``;
``clip_grad_norm_``; and gradient accumulation where ``backward`` divides the loss
by the accumulation count and ``step`` steps only at the boundary.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from csrc.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["TorchEngineConfig", "TorchEngine", "TorchEngineStats"]


@dataclass(frozen=True, kw_only=True)
class TorchEngineConfig:
    """What ``TorchEngine`` trains with; the demo fills it from its own config."""

    micro_batch: int
    """Samples per forward/backward (train_micro_batch_size_per_gpu)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (gradient_accumulation_steps)."""
    lr: float = 1e-3
    """Peak learning rate (WarmupLR's warmup_max_lr)."""
    warmup_min_lr: float = 0.0
    """Learning rate at step 0 of the warm-up."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from warmup_min_lr to lr (0: none)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's beta1, beta2."""
    eps: float = 1e-8
    """AdamW's epsilon."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay."""
    grad_clip_norm: float = 0.0
    """Clip the global gradient norm to this before each step (0: no clipping)."""
    seed: int = 0
    """Seed of the loader's shuffle."""

    def __post_init__(self) -> None:
        for name in ("micro_batch", "grad_accum"):
            if getattr(self, name) < 1:
                raise ConfigError(f"TorchEngineConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("lr", "warmup_min_lr", "eps", "weight_decay", "grad_clip_norm", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"TorchEngineConfig.{name} must be >= 0, got {getattr(self, name)!r}")


@dataclass(frozen=True, kw_only=True)
class TorchEngineStats:
    """The fields of the offload engine's stats, for a run with no tiers."""

    optimizer_device: str = "none"
    tier: str = "plain torch (no tiers)"
    state_bytes_by_tier: dict[str, int] = field(default_factory=dict)
    bytes_read_total: int = 0
    bytes_written_total: int = 0
    io_wait_seconds_total: float = 0.0
    step_seconds_total: float = 0.0
    optimizer_steps: int = 0


class TorchEngine:
    """One process, the model on the CPU, the optimizer ``torch.optim.AdamW``."""

    def __init__(self, model: nn.Module, config: TorchEngineConfig) -> None:
        self.module = model
        self.config = config
        self.device = torch.device("cpu")
        self.global_rank = 0
        self.world_size = 1
        self.global_steps = 0
        self._micro_steps = 0
        self._step_seconds = 0.0
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=config.betas,
                                           eps=config.eps, weight_decay=config.weight_decay)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)

    def _lr_factor(self, step: int) -> float:
        c = self.config
        if c.lr == 0 or step >= c.warmup_steps:
            return 1.0
        return (c.warmup_min_lr + (c.lr - c.warmup_min_lr) * step / c.warmup_steps) / c.lr

    def dataloader(self, dataset: Dataset) -> DataLoader:
        """Shuffled micro-batches of ``dataset``, the last partial one dropped."""
        gen = torch.Generator().manual_seed(self.config.seed)
        return DataLoader(dataset, batch_size=self.config.micro_batch, shuffle=True, drop_last=True,
                          generator=gen)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.config.grad_accum).backward()

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self._micro_steps + 1) % self.config.grad_accum == 0

    def step(self) -> None:
        """Count a micro-batch; at the accumulation boundary clip, step, zero the grads."""
        boundary = self.is_gradient_accumulation_boundary()
        self._micro_steps += 1
        if not boundary:
            return
        start = time.perf_counter()
        if self.config.grad_clip_norm > 0:
            nn.utils.clip_grad_norm_(self.module.parameters(), self.config.grad_clip_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        self.global_steps += 1
        self._step_seconds += time.perf_counter() - start

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def offload_stats(self) -> TorchEngineStats:
        """Where the fp32 weights and Adam moments live (beside the model) and the time in ``step``."""
        state_bytes = sum(p.numel() * p.element_size() for p in self.module.parameters())
        state_bytes += sum(s[k].numel() * s[k].element_size() for s in self.optimizer.state.values()
                           for k in ("exp_avg", "exp_avg_sq") if k in s)
        return TorchEngineStats(state_bytes_by_tier={"host": 0, "nvme": 0, "device": state_bytes},
                                step_seconds_total=self._step_seconds, optimizer_steps=self.global_steps)

    def close(self) -> None:
        self.optimizer.state.clear()
