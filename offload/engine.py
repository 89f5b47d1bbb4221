"""The engine a training script drives: ``loss = engine(batch); engine.backward(loss); engine.step()``.

It delegates: gradients to ``GradReducer``, the optimizer step to ``PartitionedAdam`` (over a
``StateStorage`` on the tier), the loss scale to ``LossScaler``, checkpoints to
``offload.checkpoint``. ````offload.initialize`` builds the parts and hands them over; the
engine only sequences them. Its accessors are DeepSpeed's, so scripts written for
DeepSpeed's engine run with the import changed.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import math
import sys
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

from csrc import ConfigError, DaemonNotRunningError
from offload.engine_api import DeepSpeedAccessors
from offload.engine_stats import EngineStats, stats_of
from offload.runtime.host_heap import HeapTrimmer
from offload.runtime.rank_barrier import CLOSE_WAIT_SECONDS, every_rank_reached
from offload.precision import LossScaler, clip_coefficient
from offload.checkpoint.resume import UNKNOWN, CommitRegion, daemon_lost
from offload.checkpoint.rng import rng_state, set_rng_state
from offload.tiers import Tier
from offload.zero.grads import GradReducer
from offload.zero.layout import FlatLayout
from offload.zero.optimizer import OffloadOptimizer, PartitionedAdam

logger = logging.getLogger(__name__)

__all__ = ["Engine", "EngineStats", "RankInfo", "close_at_exit"]

# [Note: close at exit] A script's normal end is the end of its job: DeepSpeed scripts never call close(), so
# the engines a process built and did not close are closed when the interpreter exits (their swap files
# removed, their daemon sessions finished, so that running the script again starts fresh). An end by an
# exception nobody caught is a crash: the daemon session is kept for a restart (torchrun's, within the
# daemon's reattach grace), as it is for a kill or SIGTERM; the swap files of an embedded store go either way
# (nothing resumes from them).
_OPEN_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()


def close_at_exit(engine: "Engine") -> None:
    """Close ``engine`` when the interpreter exits, unless it was closed before ([Note: close at exit])."""
    _OPEN_ENGINES.add(engine)


@atexit.register
def _close_open_engines() -> None:
    crashed = getattr(sys, "last_value", None) is not None  # set by the interpreter for an uncaught exception
    for engine in list(_OPEN_ENGINES):
        try:
            engine.close(keep_session=crashed)
        except Exception as exc:  # the exit goes on: say what was left
            logger.warning("rank %d: closing the engine at exit failed: %s: %s", engine.global_rank,
                           type(exc).__name__, exc)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankInfo:
    """This process's place among the ranks, and where it computes."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    group: dist.ProcessGroup | None = None


class Engine(DeepSpeedAccessors):
    """ZeRO stages 0-2 with the optimizer state on the device, in host memory or on NVMe."""

    def __init__(self, *, module: torch.nn.Module, config, ranks: RankInfo, layout: FlatLayout,
                 flat_params: torch.Tensor, reducer: GradReducer, adam: PartitionedAdam, tier: Tier | None,
                 optimizer: OffloadOptimizer, lr_scheduler: Any, scaler: LossScaler, compute_dtype: torch.dtype,
                 training_dataloader: Any = None, stage3: Any = None) -> None:
        self.module = module
        self.config = config
        self.heap_trimmer = HeapTrimmer() if config.offload.release_host_heap else None
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
        self.stage3 = stage3  # offload.zero.stage3.Stage3Parts: the param shards and their hooks
        self.delayed = None  # offload.zero.delayed.DelayedUpdate when offload.delayed_update is on
        self.overlap = None  # offload.zero.overlap.OverlappedStep when offload.overlap_step is on
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self.step_seconds = 0.0
        self.last_grad_norm: float | None = None
        self._multiplier: float | None = None  # set by step() for the optimizer's step() to apply
        self._pending_plan: Any = None  # the plain recorded step's StepPlan, its record written ([Note: pending step])
        self.step_multiplier: Any = UNKNOWN  # the last step's multiplier (None: skipped): [Note: pending step]
        self.wall_seconds = {"forward": 0.0, "backward": 0.0, "step": 0.0}  # wall_clock_breakdown
        self.client_state: dict[str, Any] = {}
        """The caller's small state (its data position): committed with every step, back after a resume."""
        self.commit: CommitRegion | None = None  # set by initialize when the tier is the daemon
        self.record_steps = True
        """With the daemon: record each step's inputs and progress so that a restart can finish it
        ([Note: restartable step]); False steps as before (torn if cut), for the paired bench."""
        self.reporter: Any = None  # offload.report.StepReporter: with the daemon, one report per step
        self.resumed_step: int | None = None  # the step this process resumed from the daemon at, if it did
        self.last_checkpoint: str | None = None
        self.stop_requested = False  # SIGTERM: finish the step, commit, detach, exit
        self._boundary: bool | None = None  # set_gradient_accumulation_boundary's word, if given
        self._closed = False

    # -- the training loop ---------------------------------------------------------------

    @contextlib.contextmanager
    def _daemon_alive(self):
        """A daemon that went away mid-training: say what was lost and what to do (offload.checkpoint.resume.daemon_lost)."""
        try:
            yield
        except DaemonNotRunningError as exc:
            if self.tier is None or not self.tier.daemon:
                raise
            raise DaemonNotRunningError(daemon_lost(rank=self.global_rank, step=self.global_steps,
                                                    tier=self.tier.description, last_checkpoint=self.last_checkpoint,
                                                    cause=exc)) from exc

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward; floating-point inputs are cast to the compute dtype (bf16/fp16)."""
        t0 = time.perf_counter()
        if self.compute_dtype != torch.float32:
            args = tuple(self._cast(a) for a in args)
            kwargs = {k: self._cast(v) for k, v in kwargs.items()}
        try:
            with self._daemon_alive():
                out = self.module(*args, **kwargs)
        except RuntimeError as err:
            if self.stage3 is not None and "storage of size 0" in str(err):
                from offload.zero.external import unregistered_read_error

                raise unregistered_read_error(self.module, err) from err
            raise
        if self.stage3 is not None and not torch.is_grad_enabled():
            self.stage3.coordinator.park()  # no backward follows ([Note: parked params] in offload.zero.params)
        self.wall_seconds["forward"] += time.perf_counter() - t0
        return out

    __call__ = forward

    def _cast(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(self.compute_dtype)
        return value

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss`` scaled by the loss scale / accumulation steps (``scale_wrt_gas=False``: by the loss
        scale only, the caller divided already, as the HF Trainer does); reduces gradients as they come."""
        with self._daemon_alive():
            out = self._backward(loss, scale_wrt_gas)
        if self.stage3 is not None:
            self.stage3.coordinator.park()
        return out

    def _backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> torch.Tensor:
        self.settle()  # the last step's tail reads the accumulators this backward lands in
        gas = self.gradient_accumulation_steps()
        final = self.is_gradient_accumulation_boundary()
        stage2 = self.config.zero.stage >= 2  # stage 3 reduces every micro-step too
        reduce = final or stage2
        first = (self.micro_steps % gas == 0) if stage2 else True
        if final and not (self.delayed is not None and self.delayed.busy):  # a delayed step prefetches itself
            self.adam.prefetch_states()  # NVMe -> host while backward runs
        overlap = self.overlap if final else None
        if overlap is not None:
            if self.commit is not None:  # the state is written under backward from now on
                if self.record_steps:
                    self.commit.begin_speculative_step()  # [Note: speculative step] in offload.checkpoint.resume
                else:
                    self.commit.begin_step()
            overlap.begin(self.scaler.scale, self.world_size)  # [Note: overlapped step]
        t0 = time.perf_counter()
        self.adam.storage.begin_landing()
        self.reducer.begin(reduce=reduce, first=first, final=final)
        factor = self.scaler.scale / gas if scale_wrt_gas else self.scaler.scale
        (loss * factor if factor != 1.0 else loss).backward()
        self.reducer.end()  # what lands here starts early steps too: [Note: the host runs ahead] in offload.zero.overlap
        if overlap is not None:
            overlap.backward_done()
        self.wall_seconds["backward"] += time.perf_counter() - t0
        return loss

    def step(self) -> None:
        """At an accumulation boundary: clip, step (or skip on overflow), update the loss scale and LR,
        and commit the small state to the daemon. After a SIGTERM, the boundary ends the process."""
        with self._daemon_alive():
            self._step()
        if self.stage3 is not None:
            self.stage3.coordinator.park()

    def _step(self) -> None:
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            self._take_step()
            if self.heap_trimmer is not None:
                self.heap_trimmer.after_step()  # [Note: host heap creep]
        self.micro_steps += 1
        if boundary and self._boundary is not None:  # a cycle the caller ended early: the next one starts afresh
            gas = self.gradient_accumulation_steps()
            self.micro_steps = -(-self.micro_steps // gas) * gas
        if boundary and self.commit is not None:
            if self.delayed is not None:
                self.delayed.finish()  # the committed state is a finished step's ([Note: delayed update])
            self.commit.commit(self.global_steps, self.small_state())
            if self.reporter is not None:
                self.reporter.report(self)
            if self.stop_requested:
                logger.warning("rank %d: stopping at step %d on SIGTERM; the state is committed and the session "
                               "kept for a restart", self.global_rank, self.global_steps)
                self.close(keep_session=True)
                raise SystemExit(143)

    def _take_step(self) -> None:
        t0 = time.perf_counter()
        if self.delayed is not None:
            self.delayed.publish()  # the step started at the last boundary ([Note: delayed update])
        denom = self.scaler.scale * self.world_size
        if self.commit is not None and self.record_steps and self.delayed is None:  # [Note: pending step]
            plan = self.adam.prepare_step(count=False)  # all but the multiplier, before the all-reduce
            inputs = {"small": self.small_state(), "step_count": plan.step_count, "hypers": plan.hypers}
            if self.overlap is None:
                self._pending_plan = plan
                self.commit.begin_pending_step(inputs)
            else:  # beside the speculative record's rollback copies
                self.commit.speculative_pending(inputs)
        sumsq = self.adam.global_sumsq()
        overflow = not math.isfinite(sumsq)
        if overflow:
            self._pending_plan = None
            self.step_multiplier = None
            self.last_grad_norm = float("inf")
            if self.overlap is not None:
                self.overlap.cancel()
            self.adam.storage.cancel_prefetches()
            self.skipped_steps += 1
            logger.warning("rank %d step %d: gradient not finite (loss scale %g): step skipped",
                           self.global_rank, self.global_steps, self.scaler.scale)
        else:
            norm = math.sqrt(sumsq) / denom
            self.last_grad_norm = norm
            self._multiplier = clip_coefficient(norm, self.config.gradient_clipping) / denom
            self.optimizer.step()
        self._count_step(overflow)
        self.step_seconds += time.perf_counter() - t0
        self.wall_seconds["step"] = self.step_seconds
        if self.overlap is not None:
            self.wall_seconds["step under backward"] = self.overlap.seconds_under_backward
        every = self.config.steps_per_print
        if every and self.global_steps % every == 0:
            logger.info("rank %d step %d: lr %s, grad norm %.4g, loss scale %g, step %.3f s total, I/O wait %.3f s",
                        self.global_rank, self.global_steps, self.get_lr(), self.last_grad_norm, self.scaler.scale,
                        self.step_seconds, self.adam.storage.io_wait_seconds)
            if self.config.wall_clock_breakdown:
                logger.info("rank %d wall clock so far: %s", self.global_rank,
                            ", ".join(f"{k} {v:.3f} s" for k, v in self.wall_seconds.items()))

    def _count_step(self, overflow: bool) -> None:
        """A step's bookkeeping after its Adam pass (or its skip): LR schedule, loss scale, counters."""
        if not overflow and self.lr_scheduler is not None:
            # torch's schedulers warn unless optimizer.step() ran; the engine steps Adam itself
            self.optimizer._opt_called = True
            self.lr_scheduler.step()
        self.scaler.update(overflow)
        self.global_steps += 1
        self.global_samples += self.train_batch_size()

    def apply_update(self) -> None:
        """The optimizer's step (called by ``optimizer.step()`` from ``step()``, never by a script)."""
        if self._multiplier is None:
            raise ConfigError("optimizer.step() is driven by the engine: call engine.backward(loss); engine.step()")
        multiplier, self._multiplier = self._multiplier, None
        self.step_multiplier = multiplier
        recorded = self.commit is not None and self.record_steps and self.delayed is None
        if self.commit is not None and not recorded:
            self.commit.begin_step()  # [Note: restartable step] in offload.checkpoint.resume: no record for these
        if self.delayed is not None and self.delayed.applies():
            self.delayed.start(multiplier)
        elif self.overlap is not None:
            record = None
            if recorded:  # [Note: speculative step] in offload.checkpoint.resume
                small = self.small_state()

                def record(plan, early):
                    self.commit.begin_recorded_step({"small": small, "step_count": plan.step_count,
                                                     "hypers": plan.hypers, "multiplier": multiplier,
                                                     "early": list(early)})
            self.overlap.step(multiplier, record=record, progress=self.commit if recorded else None)
        elif recorded:
            plan, self._pending_plan = self._pending_plan, None
            if plan is None:
                raise RuntimeError("the plain recorded step's record was not written before its all-reduce")
            self.adam.step_count += 1  # what prepare_step counts
            self.commit.record_multiplier(multiplier)
            self.adam.step_states(multiplier, plan, progress=self.commit, publish_early=True)
            self.adam.publish()
        else:
            self.adam.step(multiplier)

    def finish_step(self, record: dict[str, Any], done: int, in_pass: bool = False) -> None:
        """A restarted rank finishes the step its predecessor was killed in, from the step record
        ([Note: restartable step]): the small state as the step began, the sub-groups from ``done`` on
        (``in_pass``: the first of them from where its cut Adam pass left the undo log), then the
        step's bookkeeping. The params are the caller's to rebuild from the masters after."""
        from offload.zero.optimizer import StepPlan

        self.restore_small_state(record["small"])
        self.step_multiplier = multiplier = record["multiplier"]
        if multiplier is None:  # a pending step its peers skipped on overflow ([Note: pending step] in offload.checkpoint.resume)
            self.skipped_steps += 1
            self.adam.step_count = record["step_count"]
        else:
            plan = StepPlan(record["step_count"], record["hypers"], self.adam.storage.step_grads())
            self.adam.step_count = record["step_count"] + 1
            skip = frozenset(range(done)) | frozenset(record.get("early", ()))  # early: stepped under backward
            self.adam.step_states(multiplier, plan, skip=skip, progress=self.commit, resume=in_pass)
            self.adam.storage.drain()
        self._count_step(multiplier is None)
        self.micro_steps += 1

    def zero_grad(self) -> None:
        self.reducer.zero()

    def settle(self) -> None:
        """Finish what of the last step still runs (``offload.step_under_forward``: the sub-groups stepped under
        the next forward): the params are the step's after this. The engine's own calls do it; a script that
        reads the params between ``step()`` and the next forward calls it first."""
        if self.overlap is not None:
            self.overlap.settle()

    def parameters(self, recurse: bool = True):
        """The module's parameters, as a DeepSpeed engine (an ``nn.Module``) gives them to framework loops
        (``accelerator.clip_grad_norm_(model.parameters(), ...)``)."""
        return self.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any):
        return self.module.named_parameters(*args, **kwargs)

    def consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """The module's state dict as CPU copies in the compute dtype, ties kept (DeepSpeed's
        ``_zero3_consolidated_16bit_state_dict``). At stage 3 every rank must call it: one unit is gathered at a
        time, and rank 0 gets the dict, the others an empty one, as DeepSpeed's. Stages 0-2: every rank."""
        from offload.hf.save import consolidated_16bit_state_dict

        self.settle()
        return consolidated_16bit_state_dict(self, exclude_frozen_parameters)

    # -- state that outlives the process ---------------------------------------------------

    def small_state(self) -> dict[str, Any]:
        """Everything but the tier's regions and the params: what a resume needs besides them."""
        sched = self.lr_scheduler
        return {
            "global_steps": self.global_steps, "micro_steps": self.micro_steps, "global_samples": self.global_samples,
            "skipped_steps": self.skipped_steps, "optimizer_steps": self.adam.step_count,
            "loss_scaler": self.scaler.state_dict(),
            "lr_scheduler": sched.state_dict() if sched is not None and hasattr(sched, "state_dict") else None,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
            "rng": rng_state(), "client_state": dict(self.client_state), "last_checkpoint": self.last_checkpoint,
            **({} if self.step_multiplier is UNKNOWN else {"step_multiplier": self.step_multiplier}),
        }

    def restore_small_state(self, state: dict[str, Any], *, optimizer: bool = True, scheduler: bool = True,
                            rng: bool = True) -> None:
        self.global_steps = state["global_steps"]
        self.micro_steps = state["micro_steps"]
        self.global_samples = state["global_samples"]
        self.skipped_steps = state["skipped_steps"]
        if optimizer:
            self.adam.step_count = state["optimizer_steps"]
            self.scaler.load_state_dict(state["loss_scaler"])
            for group, saved in zip(self.optimizer.param_groups, state["param_groups"]):
                group.update(saved)
        if scheduler and state["lr_scheduler"] is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if rng and state.get("rng") is not None:
            set_rng_state(state["rng"])
        self.client_state = dict(state.get("client_state") or {})
        self.last_checkpoint = state.get("last_checkpoint", self.last_checkpoint)
        self.step_multiplier = state.get("step_multiplier", UNKNOWN)

    # -- checkpoints and stats ---------------------------------------------------------------

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True) -> str:
        from offload.checkpoint.dcp import save_checkpoint

        state = self.client_state if client_state is None else client_state
        if self.delayed is not None:
            self.delayed.finish()
        if self.overlap is not None:
            self.overlap.cancel()  # a speculation in flight is not a step's state ([Note: overlapped step])
        return save_checkpoint(self, save_dir, tag=tag, client_state=state, save_latest=save_latest)

    def save_16bit_model(self, save_dir: str, save_filename: str | None = None,
                         exclude_frozen_parameters: bool = False, **kwargs: Any) -> bool:
        """The weights in the compute dtype: sharded safetensors + index + config.json that ``from_pretrained``
        loads (no ``save_filename``; ``max_shard_size_bytes=``), or one state dict file (stage 3: only with
        stage3_gather_16bit_weights_on_model_save); True if written. See ``offload.hf.save``."""
        from offload.hf.save import save_16bit_model

        self.settle()
        return save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters=exclude_frozen_parameters,
                                **kwargs)

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, *, force: bool = False) -> tuple[str | None, dict]:
        """DeepSpeed's call: (path, client_state), (None, {}) without a checkpoint. [Note: newest state wins]:
        after a resume from the daemon, a checkpoint no newer than the resumed state is not loaded (the
        return is then the checkpoint's path and the resumed ``client_state``); ``force=True`` loads it anyway."""
        from offload.checkpoint.dcp import checkpoint_step, load_checkpoint, resolve_path

        path = resolve_path(load_dir, tag)
        if path is not None and self.resumed_step is not None and not force:
            saved = checkpoint_step(path)
            if saved <= self.global_steps:
                logger.warning("rank %d: kept the state resumed from the daemon (step %d) over checkpoint %s "
                               "(step %d, %s); load_checkpoint(..., force=True) loads it anyway",
                               self.global_rank, self.global_steps, path, saved,
                               "the same step" if saved == self.global_steps else "older")
                return path, dict(self.client_state)
        if self.delayed is not None:
            self.delayed.discard()  # its params would overwrite the loaded ones
        if self.overlap is not None:
            self.overlap.cancel()
        loaded = load_checkpoint(self, load_dir, tag=tag, load_optimizer_states=load_optimizer_states,
                                 load_lr_scheduler_states=load_lr_scheduler_states)
        if loaded[0] is not None and self.commit is not None and self.resumed_step is None:
            logger.warning("rank %d: starting from checkpoint %s at step %d (the daemon held no committed state "
                           "for this job)", self.global_rank, loaded[0], self.global_steps)
        return loaded

    def offload_stats(self) -> EngineStats:
        """What the tiers did (``offload.engine_stats.stats_of``)."""
        return stats_of(self)

    def close(self, *, keep_session: bool = False) -> None:
        """Free the optimizer state (tier regions, swap files). Idempotent."""
        if self._closed:
            return
        self._closed = True
        _OPEN_ENGINES.discard(self)
        if self.delayed is not None:
            self.delayed.close()
        failure = self.overlap.close() if self.overlap is not None else None  # raised once the rest is closed
        self.reducer.close()
        if self.commit is not None:
            self.commit.release()
        if self.adam.undo is not None:
            self.adam.undo.release()
            self.adam.undo = None
        if self.stage3 is not None:
            self.stage3.close()
        if not keep_session and self.commit is not None and not every_rank_reached(
                "close", self.ranks.group, self.world_size, rank=self.global_rank, timeout_seconds=CLOSE_WAIT_SECONDS):
            keep_session = True  # a rank killed before its close: the others keep their sessions for the restart
        if keep_session and self.tier is not None:
            self.tier.close(keep_session=True)
        else:
            self.adam.storage.close()
            if self.reporter is not None:
                self.reporter.report(self, closing=True)  # the bytes of the transfers that settled in close
            if self.tier is not None:
                self.tier.close()
        if failure is not None:
            raise failure

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
