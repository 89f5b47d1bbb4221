"""The engine a training script drives: ``loss = engine(batch); engine.backward(loss); engine.step()``.

It delegates: gradients to ``GradReducer``, the optimizer step to ``PartitionedAdam`` (over a
``StateStorage`` on the tier), the loss scale to ``LossScaler``, checkpoints to
``offload.checkpoint``. ``offload.initialize`` builds the parts and hands them over; the
engine only sequences them. Its accessors are DeepSpeed's, so scripts written for
DeepSpeed's engine run with the import changed.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

import torch
import torch.distributed as dist

from offload.precision import LossScaler, clip_coefficient
from offload.tiers import Tier
from offload.zero.grads import GradReducer
from offload.zero.layout import FlatLayout
from offload.zero.optimizer import OffloadOptimizer, PartitionedAdam

logger = logging.getLogger(__name__)

__all__ = ["Engine", "EngineStats", "RankInfo"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankInfo:
    """This process's place among the ranks, and where it computes."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    group: dist.ProcessGroup | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineStats:
    """What the tiers did, for progress bars and summaries."""

    optimizer_device: str
    """"none", "cpu" or "nvme"."""
    tier: str
    """Which tier holds the state (the embedded store and its engine, or the daemon)."""
    state_bytes_by_tier: dict[str, int]
    """Bytes of fp32 master + moments per tier now: "device", "host", "nvme"."""
    bytes_read_total: int
    """NVMe -> host bytes of this engine's tier."""
    bytes_written_total: int
    """Host -> NVMe bytes."""
    io_wait_seconds_total: float
    """Time ``step`` spent waiting on tier I/O."""
    step_seconds_total: float
    """Time spent in optimizer steps."""
    optimizer_steps: int
    """Steps taken (overflow-skipped steps not counted)."""
    skipped_steps: int
    """Steps skipped for a non-finite gradient."""


class Engine:
    """ZeRO stages 0-2 with the optimizer state on the device, in host memory or on NVMe."""

    def __init__(self, *, module: torch.nn.Module, config, ranks: RankInfo, layout: FlatLayout,
                 flat_params: torch.Tensor, reducer: GradReducer, adam: PartitionedAdam, tier: Tier | None,
                 optimizer: OffloadOptimizer, lr_scheduler: Any, scaler: LossScaler, compute_dtype: torch.dtype,
                 training_dataloader: Any = None) -> None:
        self.module = module
        self.config = config
        self.ranks = ranks
        self.layout = layout
        self.flat_params = flat_params
        self.reducer = reducer
        self.adam = adam
        self.tier = tier
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.scaler = scaler
        self.compute_dtype = compute_dtype
        self.training_dataloader = training_dataloader
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self.step_seconds = 0.0
        self.last_grad_norm: float | None = None
        self._closed = False

    # -- DeepSpeed's accessors -----------------------------------------------------------

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
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        return self.last_grad_norm

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    # -- the training loop ---------------------------------------------------------------

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward; floating-point inputs are cast to the compute dtype (bf16/fp16)."""
        if self.compute_dtype != torch.float32:
            args = tuple(self._cast(a) for a in args)
            kwargs = {k: self._cast(v) for k, v in kwargs.items()}
        return self.module(*args, **kwargs)

    __call__ = forward

    def _cast(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(self.compute_dtype)
        return value

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Backward of ``loss`` scaled by the loss scale / accumulation steps; reduces gradients as they come."""
        gas = self.gradient_accumulation_steps()
        final = self.is_gradient_accumulation_boundary()
        stage2 = self.config.zero.stage == 2
        reduce = final or stage2
        first = (self.micro_steps % gas == 0) if stage2 else True
        if final:
            self.adam.prefetch_states()  # NVMe -> host while backward runs
        self.reducer.begin(reduce=reduce, first=first, final=final)
        factor = self.scaler.scale / gas
        (loss * factor if factor != 1.0 else loss).backward()
        self.reducer.end()
        return loss

    def step(self) -> None:
        """At an accumulation boundary: clip, step (or skip on overflow), update the loss scale and LR."""
        if self.is_gradient_accumulation_boundary():
            self._take_step()
        self.micro_steps += 1

    def _take_step(self) -> None:
        t0 = time.perf_counter()
        denom = self.scaler.scale * self.world_size
        sumsq = self.adam.global_sumsq()
        overflow = not math.isfinite(sumsq)
        if overflow:
            self.last_grad_norm = float("inf")
            self.adam.storage.cancel_prefetches()
            self.skipped_steps += 1
            logger.warning("rank %d step %d: gradient not finite (loss scale %g): step skipped",
                           self.global_rank, self.global_steps, self.scaler.scale)
        else:
            norm = math.sqrt(sumsq) / denom
            self.last_grad_norm = norm
            self.adam.step(clip_coefficient(norm, self.config.gradient_clipping) / denom)
            if self.lr_scheduler is not None:
                # torch's schedulers warn unless optimizer.step() ran; the engine steps Adam itself
                self.optimizer._opt_called = True
                self.lr_scheduler.step()
        self.scaler.update(overflow)
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self.step_seconds += time.perf_counter() - t0
        every = self.config.steps_per_print
        if every and self.global_steps % every == 0:
            logger.info("rank %d step %d: lr %s, grad norm %.4g, loss scale %g, step %.3f s total, I/O wait %.3f s",
                        self.global_rank, self.global_steps, self.get_lr(), self.last_grad_norm, self.scaler.scale,
                        self.step_seconds, self.adam.storage.io_wait_seconds)

    def zero_grad(self) -> None:
        self.reducer.zero()

    # -- checkpoints and stats ---------------------------------------------------------------

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True) -> str:
        from offload.checkpoint import save_checkpoint

        return save_checkpoint(self, save_dir, tag=tag, client_state=client_state or {}, save_latest=save_latest)

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True) -> tuple[str | None, dict]:
        from offload.checkpoint import load_checkpoint

        return load_checkpoint(self, load_dir, tag=tag, load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states)

    def offload_stats(self) -> EngineStats:
        storage = self.adam.storage
        stats = self.tier.store.stats() if self.tier is not None else None
        return EngineStats(
            optimizer_device=self.config.zero.offload_optimizer.device.value,
            tier=self.tier.description if self.tier is not None else f"none (state on {self.device})",
            state_bytes_by_tier=storage.bytes_by_tier(),
            bytes_read_total=stats.bytes_read_total if stats else 0,
            bytes_written_total=stats.bytes_written_total if stats else 0,
            io_wait_seconds_total=storage.io_wait_seconds,
            step_seconds_total=self.step_seconds,
            optimizer_steps=self.adam.step_count,
            skipped_steps=self.skipped_steps,
        )

    def close(self, *, keep_session: bool = False) -> None:
        """Free the optimizer state (tier regions, swap files). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.reducer.close()
        if keep_session and self.tier is not None:
            self.tier.close(keep_session=True)
            return
        self.adam.storage.close()
        if self.tier is not None:
            self.tier.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
