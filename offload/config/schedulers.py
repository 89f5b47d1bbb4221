"""DeepSpeed's LR schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR) as torch LR schedulers.

Each is a ``torch.optim.lr_scheduler.LRScheduler``: it steps, saves and loads as torch's
own do, and composes with them. The formulas are DeepSpeed's documented ones:
- WarmupLR: from warmup_min_lr to warmup_max_lr over warmup_num_steps (log or linear),
  then warmup_max_lr.
- WarmupDecayLR: WarmupLR, then linear decay to 0 at total_num_steps.
- WarmupCosineLR: a ratio of the optimizer's lr, from warmup_min_ratio to 1 over the
  warmup, then a cosine from 1 to cos_min_ratio at total_num_steps (and there it stays;
  DeepSpeed's cosine would turn back up).

[Note: DeepSpeed's step count] DeepSpeed's schedulers start at ``last_batch_iteration``
-1, set the start value (the LR at iteration 0) when built, and count one per optimizer
step: the LR of optimizer step k (from 0) is the formula at iteration k - 1, and steps 0
and 1 both run at the start value. torch's schedulers take a step when built, so here
``last_epoch`` is one ahead: the formula is evaluated at ``last_epoch - 1``.
"""
from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LRScheduler

from csrc import ConfigError

__all__ = ["WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "build_scheduler"]


def _iteration(last_epoch: int) -> int:
    """DeepSpeed's last_batch_iteration for torch's last_epoch (see [Note: DeepSpeed's step count])."""
    return max(0, last_epoch - 1)


def _warmup_gamma(step: int, warmup_steps: int, kind: str) -> float:
    """Progress through the warmup in [0, 1]: log(step+1)/log(warmup) or step/warmup."""
    if step >= warmup_steps:
        return 1.0
    if kind == "log":
        return math.log(step + 1) / math.log(warmup_steps)
    return step / warmup_steps


class WarmupLR(LRScheduler):
    """warmup_min_lr -> warmup_max_lr over warmup_num_steps, then constant."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, warmup_min_lr: float = 0.0, warmup_max_lr: float = 1e-3,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_epoch: int = -1) -> None:
        if warmup_type not in ("log", "linear"):
            raise ConfigError(f"scheduler.params.warmup_type must be 'log' or 'linear', got {warmup_type!r}")
        self.min_lr, self.max_lr = warmup_min_lr, warmup_max_lr
        self.warmup_steps = max(2, int(warmup_num_steps))
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_epoch)

    def _gamma(self, step: int) -> float:
        return _warmup_gamma(step, self.warmup_steps, self.warmup_type)

    def get_lr(self) -> list[float]:
        lr = self.min_lr + (self.max_lr - self.min_lr) * self._gamma(_iteration(self.last_epoch))
        return [lr for _ in self.optimizer.param_groups]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay from warmup_max_lr to 0 at total_num_steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, total_num_steps: int, **warmup) -> None:
        self.total_steps = int(total_num_steps)
        warmup_steps = max(2, int(warmup.get("warmup_num_steps", 1000)))
        if self.total_steps < warmup_steps:
            raise ConfigError(f"scheduler.params.total_num_steps ({total_num_steps}) must be >= "
                              f"warmup_num_steps ({warmup_steps})")
        super().__init__(optimizer, **warmup)

    def _gamma(self, step: int) -> float:
        if step < self.warmup_steps:
            return super()._gamma(step)
        return max(0.0, (self.total_steps - step) / max(1.0, self.total_steps - self.warmup_steps))


class WarmupCosineLR(LRScheduler):
    """A ratio of the optimizer's lr: warmup_min_ratio -> 1 over the warmup, then cosine to cos_min_ratio."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 1e-4, warmup_type: str = "log",
                 last_epoch: int = -1) -> None:
        if warmup_type not in ("log", "linear"):
            raise ConfigError(f"scheduler.params.warmup_type must be 'log' or 'linear', got {warmup_type!r}")
        self.total_steps = int(total_num_steps)
        self.warmup_steps = max(2, int(warmup_num_steps))
        if self.total_steps < self.warmup_steps:
            raise ConfigError(f"scheduler.params.total_num_steps ({total_num_steps}) must be >= "
                              f"warmup_num_steps ({self.warmup_steps})")
        self.min_ratio, self.cos_min_ratio, self.warmup_type = warmup_min_ratio, cos_min_ratio, warmup_type
        super().__init__(optimizer, last_epoch)

    def _ratio(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.min_ratio + (1.0 - self.min_ratio) * _warmup_gamma(step, self.warmup_steps, self.warmup_type)
        # DeepSpeed's cosine starts one step into its last warmup iteration (step - warmup + 1)
        progress = min(1.0, (step - self.warmup_steps + 1) / max(1, self.total_steps - self.warmup_steps))
        return self.cos_min_ratio + (1.0 - self.cos_min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def get_lr(self) -> list[float]:
        ratio = self._ratio(_iteration(self.last_epoch))
        return [base * ratio for base in self.base_lrs]


def build_scheduler(config, optimizer: torch.optim.Optimizer) -> LRScheduler:
    """The scheduler a ``SchedulerConfig`` names, over ``optimizer``."""
    warmup = {"warmup_num_steps": config.warmup_num_steps, "warmup_type": config.warmup_type,
              "last_epoch": config.last_batch_iteration}
    if config.type == "WarmupLR":
        return WarmupLR(optimizer, warmup_min_lr=config.warmup_min_lr, warmup_max_lr=config.warmup_max_lr, **warmup)
    if config.type in ("WarmupDecayLR", "WarmupCosineLR") and config.total_num_steps is None:
        raise ConfigError(f"scheduler.params.total_num_steps is required by {config.type}")
    if config.type == "WarmupDecayLR":
        return WarmupDecayLR(optimizer, total_num_steps=config.total_num_steps, warmup_min_lr=config.warmup_min_lr,
                             warmup_max_lr=config.warmup_max_lr, **warmup)
    if config.type == "WarmupCosineLR":
        return WarmupCosineLR(optimizer, total_num_steps=config.total_num_steps,
                              warmup_min_ratio=config.warmup_min_ratio, cos_min_ratio=config.cos_min_ratio, **warmup)
    raise ConfigError(f"scheduler.type {config.type!r} is not one of WarmupLR, WarmupDecayLR, WarmupCosineLR")
