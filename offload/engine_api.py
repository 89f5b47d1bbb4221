"""DeepSpeed's accessors of an engine (``DeepSpeedEngine``'s names and meanings), so that scripts and the
frameworks written for DeepSpeed's engine read ours unchanged. A mixin of ``offload.engine.Engine``, over the
attributes the engine sets: ``ranks``, ``config``, ``compute_dtype``, ``optimizer``, ``scaler``,
``micro_steps``, ``last_grad_norm``, ``_boundary``."""
from __future__ import annotations

import torch

__all__ = ["DeepSpeedAccessors"]


class DeepSpeedAccessors:
    """The read-only half of DeepSpeed's engine API, and its accumulation-boundary call."""

    @property
    def local_rank(self) -> int:
        return self.ranks.local_rank

    @property
    def global_rank(self) -> int:
        return self.ranks.rank

    @property
    def world_size(self) -> int:
        return self.ranks.world_size

    @property
    def device(self) -> torch.device:
        return self.ranks.device

    def bfloat16_enabled(self) -> bool:
        return self.compute_dtype == torch.bfloat16

    def fp16_enabled(self) -> bool:
        return self.compute_dtype == torch.float16

    def gradient_accumulation_steps(self) -> int:
        return self.config.batch.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.batch.micro_batch_size_per_gpu

    def train_batch_size(self) -> int:
        return self.config.batch.train_batch_size

    def zero_optimization_stage(self) -> int:
        return self.config.zero.stage

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next ``step()`` steps: the caller's word (``set_gradient_accumulation_boundary``), else
        every ``gradient_accumulation_steps``-th micro-batch."""
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """DeepSpeed's call, made by Accelerate and the HF Trainer before each backward: whether this micro-batch
        ends an accumulation cycle (a short last cycle of an epoch too). None: count micro-batches again."""
        self._boundary = None if is_boundary is None else bool(is_boundary)

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        return self.last_grad_norm

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale
