"""Accelerate custom loops on the engine: ``OffloadAccelerator``, an ``accelerate.Accelerator`` whose
``prepare`` sends the model and its optimizer (and LR scheduler) to ``offload.initialize``.

```python
accelerator = OffloadAccelerator(offload_config="ds_config.json", gradient_accumulation_steps=2)
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
for x, y in loader:
    with accelerator.accumulate(model):
        loss = loss_fn(model(x), y)
        accelerator.backward(loss)  # backward; at the accumulation boundary the engine's step (clip, Adam, LR)
        if accelerator.sync_gradients:
            norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)  # the norm; the config's clipping clipped
        optimizer.step(); scheduler.step(); optimizer.zero_grad()  # no-ops: the engine stepped
```

It is Accelerate's own DeepSpeed route (``DeepSpeedEngineWrapper``, ``DeepSpeedOptimizerWrapper``,
``DeepSpeedSchedulerWrapper`` in ``accelerate/utils/deepspeed.py``) without a ``DeepSpeedPlugin``, which
imports deepspeed: the Accelerator runs as NO, MULTI_CPU or MULTI_GPU; the model is never DDP-wrapped nor
moved (``initialize`` places it); dataloaders and anything else go to ``Accelerator.prepare``.

[Note: who steps] ``accelerator.backward`` tells the engine whether this micro-batch ends a cycle
(``sync_gradients``, set by ``accumulate()``: every ``gradient_accumulation_steps``-th micro-batch and the last
of the dataloader), runs its backward (which divides the loss by the accumulation steps, as Accelerate's
does) and calls ``engine.step()`` at every micro-batch: the engine counts micro-batches there and steps
only at the boundary. So the engine's ``gradient_accumulation_steps`` must be the Accelerator's ("auto" in
the config takes it). The optimizer and scheduler the script holds are wrappers whose ``step`` does
nothing. The script's scheduler is stepped by the engine after each step it takes (none when a step is
skipped on overflow), as many times as Accelerate's ``AcceleratedScheduler`` steps it (once per process
unless ``split_batches``); it is re-pointed from the script's torch optimizer to the engine's, whose
param groups the engine reads (``_adopt_scheduler``).
"""
from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import re
import warnings
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import DistributedType, DynamoBackend
from accelerate.utils.deepspeed import DummyOptim, DummyScheduler  # plain classes: deepspeed is not imported

from csrc import ConfigError
from offload.builder import initialize
from offload.engine import Engine

logger = logging.getLogger(__name__)

__all__ = ["ENGINE_CHECKPOINT_TAG", "OffloadAccelerator", "OffloadOptimizerWrapper", "OffloadSchedulerWrapper"]

ENGINE_CHECKPOINT_TAG = "pytorch_model"
"""The engine checkpoint's tag under a ``save_state`` folder (Accelerate's DeepSpeed route names it so)."""

_SUPPORTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


class OffloadOptimizerWrapper(AcceleratedOptimizer):
    """What ``prepare`` returns for the optimizer: the engine's optimizer (its param groups, read at each step),
    with ``step`` and ``zero_grad`` doing nothing, since ``accelerator.backward`` stepped the engine."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine.optimizer, device_placement=False, scaler=None)
        self.engine = engine

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        pass  # the engine zeroes its gradients itself

    def step(self, closure: Any = None) -> None:
        pass  # [Note: who steps]

    @property
    def step_was_skipped(self) -> bool:
        """Whether the engine's last step was skipped (a gradient not finite: fp16 overflow)."""
        return self._is_overflow


class OffloadSchedulerWrapper(AcceleratedScheduler):
    """What ``prepare`` returns for the LR scheduler: the script's scheduler, stepped by the engine
    ([Note: who steps]); ``step`` here does nothing, the rest passes through."""

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass


class _EngineScheduler:
    """The scheduler as the engine holds it: each engine step steps it ``times`` times (Accelerate's
    ``AcceleratedScheduler``: once per process unless ``split_batches``); saved in the engine's checkpoints."""

    def __init__(self, scheduler: Any, times: int) -> None:
        self.scheduler = scheduler
        self.times = times

    def step(self) -> None:
        with warnings.catch_warnings():  # the engine steps Adam itself, not through a patched optimizer.step()
            warnings.filterwarnings("ignore", message=r".*optimizer\.step\(\)", category=UserWarning)
            for _ in range(self.times):
                total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR past its end: Accelerate stops
                if total is None or self.scheduler._step_count <= total:
                    self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()


def _repoint(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    scheduler.optimizer = optimizer
    for child in getattr(scheduler, "_schedulers", ()):  # SequentialLR, ChainedScheduler
        _repoint(child, optimizer)


def _read_config(source: Any) -> dict[str, Any]:
    if isinstance(source, (str, os.PathLike)):
        with open(source, encoding="utf-8") as f:
            return json.load(f)
    if isinstance(source, dict):
        return copy.deepcopy(source)
    raise ConfigError(f"offload_config: a DeepSpeed config dict or a JSON path, not {type(source).__name__}")


class OffloadAccelerator(Accelerator):
    """``accelerate.Accelerator`` on the offload engine, for custom loops: ``offload_config`` is the DeepSpeed
    config (a dict or a JSON path); every other argument is Accelerator's. One model per accelerator, prepared
    together with its optimizer (and its scheduler). Precision is the config's ("bf16"/"fp16"), so
    ``mixed_precision`` must be "no"; DeepSpeed, FSDP, Megatron, XLA and ``dynamo_backend`` are not taken."""

    def __init__(self, *args: Any, offload_config: Any, **kwargs: Any) -> None:
        for name in ("deepspeed_plugin", "deepspeed_plugins", "fsdp_plugin", "megatron_lm_plugin"):
            if kwargs.get(name) is not None:
                raise ConfigError(f"OffloadAccelerator takes offload_config=, not {name}= (the engine replaces it)")
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
            raise ConfigError("ACCELERATE_USE_DEEPSPEED is set (an `accelerate launch` DeepSpeed config?): "
                              "OffloadAccelerator runs without DeepSpeed; launch with a plain multi-GPU/CPU config")
        super().__init__(*args, **kwargs)
        if self.distributed_type not in _SUPPORTED:
            raise ConfigError(f"OffloadAccelerator runs as NO, MULTI_CPU or MULTI_GPU, not {self.distributed_type}")
        if self.mixed_precision != "no":
            raise ConfigError(f"OffloadAccelerator: mixed_precision={self.mixed_precision!r}: the engine's precision "
                              "is the config's; set \"bf16\": {\"enabled\": true} (or \"fp16\") in offload_config "
                              "and mixed_precision=\"no\"")
        if self.state.dynamo_plugin.backend != DynamoBackend.NO:
            raise ConfigError("OffloadAccelerator: dynamo_backend is not supported (prepare never compiles the model)")
        _read_config(offload_config)  # a bad path or type fails here, not at prepare
        self.offload_config = offload_config
        self.engine: Engine | None = None
        self._client_optimizer: torch.optim.Optimizer | None = None
        self._offload_optimizer: OffloadOptimizerWrapper | None = None
        self._offload_scheduler: OffloadSchedulerWrapper | None = None

    # -- prepare ---------------------------------------------------------------------------

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """The model and its optimizer (and a scheduler over that optimizer) go to ``offload.initialize``:
        the engine, an ``OffloadOptimizerWrapper`` and an ``OffloadSchedulerWrapper`` come back in their
        places. Everything else goes to ``Accelerator.prepare``."""
        if device_placement is not None and len(device_placement) != len(args):
            raise ConfigError(f"`device_placement` should be a list with {len(args)} elements")
        result = list(args)
        for obj in args:
            if isinstance(obj, (DummyOptim, DummyScheduler)):
                raise ConfigError(f"OffloadAccelerator: {type(obj).__name__} is not taken: name the optimizer and "
                                  "scheduler in offload_config and pass none, or pass torch's")
        done = [isinstance(a, (Engine, OffloadOptimizerWrapper, OffloadSchedulerWrapper)) for a in args]
        models = [i for i, a in enumerate(args) if isinstance(a, torch.nn.Module)]
        optimizers = [i for i, a in enumerate(args) if isinstance(a, torch.optim.Optimizer) and not done[i]]
        if len(models) > 1 or (models and self.engine is not None):
            raise ConfigError("OffloadAccelerator: one model per accelerator (create another for another model)")
        if len(optimizers) > 1 and models:
            raise ConfigError("OffloadAccelerator: one optimizer for the model")
        if models:
            self._take_model(args, result, done, models[0], optimizers[0] if optimizers else None)
        elif optimizers and self.engine is not None and args[optimizers[0]] is self._client_optimizer:
            result[optimizers[0]], done[optimizers[0]] = self._offload_optimizer, True
        elif optimizers and self.engine is not None:
            owned = {id(p) for p in self.engine.module.parameters()}
            if any(id(p) in owned for g in args[optimizers[0]].param_groups for p in g["params"]):
                raise ConfigError("OffloadAccelerator: prepare the optimizer in the same call as its model")
        for i, obj in enumerate(args):  # a scheduler prepared after its model and optimizer
            if not done[i] and self.engine is not None and isinstance(obj, torch.optim.lr_scheduler.LRScheduler) \
                    and getattr(obj, "optimizer", None) in (self._client_optimizer, self._offload_optimizer,
                                                            self.engine.optimizer):
                result[i], done[i] = self._attach_scheduler(obj), True
        rest = [i for i in range(len(args)) if not done[i]]
        if rest:
            placement = None if device_placement is None else [device_placement[i] for i in rest]
            prepared = super().prepare(*(args[i] for i in rest), device_placement=placement)
            for i, obj in zip(rest, prepared if len(rest) > 1 else (prepared,)):
                result[i] = obj
        return tuple(result) if len(result) > 1 else result[0]

    def _take_model(self, args: tuple, result: list, done: list[bool], model_i: int, opt_i: int | None) -> None:
        """The engine over ``args[model_i]`` and its optimizer (and the scheduler over that), in their places."""
        client = args[opt_i] if opt_i is not None else None
        sched_is = [i for i, a in enumerate(args) if client is not None and getattr(a, "optimizer", None) is client
                    and isinstance(a, torch.optim.lr_scheduler.LRScheduler)]
        if len(sched_is) > 1:
            raise ConfigError("OffloadAccelerator: one LR scheduler for the optimizer")
        sched_i = sched_is[0] if sched_is else None
        batch_sizes = [a.batch_size for a in args if isinstance(a, torch.utils.data.DataLoader) and a.batch_size]
        self._prepare_engine(args[model_i], client, args[sched_i] if sched_i is not None else None, batch_sizes)
        for i, obj in ((model_i, self.engine), (opt_i, self._offload_optimizer), (sched_i, self._offload_scheduler)):
            if i is not None:
                result[i], done[i] = obj, True

    def _prepare_engine(self, model: torch.nn.Module, client: torch.optim.Optimizer | None, scheduler: Any,
                        batch_sizes: list[int]) -> None:
        config = self._engine_config(batch_sizes)
        lr_scheduler = None
        if scheduler is not None:
            def lr_scheduler(engine_optimizer):  # called by initialize with the engine's optimizer
                return self._adopt_scheduler(scheduler, client, engine_optimizer)
        engine, _, _, _ = initialize(model=model, optimizer=client, lr_scheduler=lr_scheduler, config=config)
        if engine.gradient_accumulation_steps() != self.gradient_accumulation_steps:
            engine.close()
            raise ConfigError(f"OffloadAccelerator: the config's gradient_accumulation_steps "
                              f"({engine.gradient_accumulation_steps()}) is not the Accelerator's "
                              f"({self.gradient_accumulation_steps}): set \"gradient_accumulation_steps\": "
                              f"{self.gradient_accumulation_steps} (or \"auto\") in offload_config")
        self.engine = engine
        self._client_optimizer = client
        self._offload_optimizer = OffloadOptimizerWrapper(engine)
        self._models.append(engine)
        self._optimizers.append(self._offload_optimizer)
        if scheduler is not None:
            self._offload_scheduler = OffloadSchedulerWrapper(scheduler, self._offload_optimizer)
            self._schedulers.append(self._offload_scheduler)
        for obj in (engine, self._offload_optimizer, self._offload_scheduler):
            if obj is not None:
                obj._is_accelerate_prepared = True

    def _engine_config(self, batch_sizes: list[int]) -> dict[str, Any]:
        """The config with Accelerate's "auto" batch values filled: gradient_accumulation_steps from the
        Accelerator, train_micro_batch_size_per_gpu from the dataloaders of the same call, train_batch_size
        from those two."""
        config = _read_config(self.offload_config)
        if config.get("gradient_accumulation_steps") == "auto":
            config["gradient_accumulation_steps"] = self.gradient_accumulation_steps
        if config.get("train_micro_batch_size_per_gpu") == "auto":
            if not batch_sizes:
                raise ConfigError("offload_config: train_micro_batch_size_per_gpu \"auto\" needs a dataloader with a "
                                  "batch_size in the same prepare() call as the model")
            size = max(batch_sizes)
            config["train_micro_batch_size_per_gpu"] = size // self.num_processes if self.split_batches else size
        if config.get("train_batch_size") == "auto":
            del config["train_batch_size"]  # the other two give it
        return config

    def _adopt_scheduler(self, scheduler: Any, client: torch.optim.Optimizer | None,
                         engine_optimizer: torch.optim.Optimizer) -> _EngineScheduler:
        """``scheduler``, built over the script's optimizer, re-pointed at the engine's (whose param groups the
        engine reads at each step), with the values it keeps in the groups (lr, initial_lr, a cycled
        momentum's bounds) carried over."""
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ConfigError("OffloadAccelerator: ReduceLROnPlateau steps on a metric, which the engine does not "
                              "have; set the lr in optimizer.param_groups yourself")
        if client is not None and client is not engine_optimizer:
            if len(client.param_groups) != len(engine_optimizer.param_groups):
                raise ConfigError("OffloadAccelerator: the engine's param groups do not match the optimizer's")
            for theirs, ours in zip(client.param_groups, engine_optimizer.param_groups):
                ours.update({k: v for k, v in theirs.items() if k != "params"})
        _repoint(scheduler, engine_optimizer)
        return _EngineScheduler(scheduler, 1 if self.split_batches else self.num_processes)

    def _attach_scheduler(self, scheduler: Any) -> OffloadSchedulerWrapper:
        engine = self.engine
        if engine.lr_scheduler is not None:
            raise ConfigError("OffloadAccelerator: the engine has an LR scheduler already (the config's \"scheduler\" "
                              "or one prepared before)")
        client = self._client_optimizer if scheduler.optimizer is self._client_optimizer else None
        engine.lr_scheduler = self._adopt_scheduler(scheduler, client, engine.optimizer)
        self._offload_scheduler = OffloadSchedulerWrapper(scheduler, self._offload_optimizer)
        self._offload_scheduler._is_accelerate_prepared = True
        self._schedulers.append(self._offload_scheduler)
        return self._offload_scheduler

    def _engine_of(self, model: Any) -> Engine | None:
        engine = self.engine
        if engine is not None and (model is engine or model is engine.module):
            return engine
        return None

    # -- the loop --------------------------------------------------------------------------

    @contextlib.contextmanager
    def accumulate(self, *models: Any):
        """Accelerate's: sets ``sync_gradients`` for this micro-batch. The engine is left out of ``no_sync``:
        it reduces as its boundary says ([Note: who steps])."""
        with super().accumulate(*(m for m in models if not isinstance(m, Engine))):
            yield

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """The engine's backward (``kwargs``: ``scale_wrt_gas``), and its step at the boundary ([Note: who steps])."""
        engine = self.engine
        if engine is None:
            return super().backward(loss, **kwargs)
        skipped = engine.skipped_steps
        engine.set_gradient_accumulation_boundary(self.sync_gradients)
        engine.backward(loss, **kwargs)
        engine.step()
        if self.sync_gradients:
            self._offload_optimizer._is_overflow = engine.skipped_steps > skipped

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor | None:
        """The engine's global gradient norm of its last step, before clipping (a 0-d tensor; None before the
        first step). The engine clipped that step already, in ``backward``, at the config's
        ``gradient_clipping``: ``max_norm`` must be that value (``inf`` for none), else a ConfigError says what
        to set. Call it when ``accelerator.sync_gradients``, as Accelerate's examples do."""
        engine = self.engine
        if engine is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        if float(norm_type) != 2.0:
            raise ConfigError(f"clip_grad_norm_(norm_type={norm_type}): the engine computes the 2-norm")
        configured = engine.config.gradient_clipping or 0.0
        wanted = float(max_norm)
        same = (configured <= 0 and math.isinf(wanted)) or (configured > 0 and math.isclose(wanted, configured,
                                                                                            rel_tol=1e-6))
        if not same:
            raise ConfigError(f"clip_grad_norm_(max_norm={max_norm}): the engine clips inside accelerator.backward, at "
                              f"the config's gradient_clipping ({configured or 'none'}); set \"gradient_clipping\": "
                              f"{max_norm} in offload_config (max_norm=float('inf') reads the norm without clipping)")
        norm = engine.get_global_grad_norm()
        return None if norm is None else torch.tensor(norm)

    def unwrap_model(self, model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> Any:
        engine = self._engine_of(model)
        if engine is not None:
            return engine.module
        return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    def get_state_dict(self, model: Any, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The trained weights in the compute dtype, on the CPU (``engine.consolidated_16bit_state_dict``): at
        stage 3 gathered unit by unit, every rank taking part, the dict on rank 0 (an empty one elsewhere)."""
        engine = self._engine_of(model)
        if engine is not None:
            return engine.consolidated_16bit_state_dict()
        return super().get_state_dict(model, unwrap)

    def save_model(self, model: Any, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        engine = self._engine_of(model)
        return super().save_model(engine.module if engine is not None else model, save_directory, **kwargs)

    # -- state -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _without_engine(self):
        """Accelerate's lists without the engine and its wrappers, whose state is the engine checkpoint's."""
        ours = {id(x) for x in (self.engine, self._offload_optimizer, self._offload_scheduler) if x is not None}
        kept = self._models, self._optimizers, self._schedulers
        self._models, self._optimizers, self._schedulers = ([x for x in xs if id(x) not in ours] for xs in kept)
        try:
            yield
        finally:
            self._models, self._optimizers, self._schedulers = kept

    def save_state(self, output_dir: str | os.PathLike | None = None, safe_serialization: bool = True,
                   **save_model_func_kwargs: Any) -> Any:
        """Accelerate's ``save_state`` (RNG, dataloaders, the step counter, registered objects, other models)
        and the engine's checkpoint (params, Adam state, loss scale, LR scheduler) under
        ``<folder>/pytorch_model``; ``save_model_func_kwargs`` go to ``engine.save_checkpoint``."""
        if self.engine is None:
            return super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
        with self._without_engine():
            location = super().save_state(output_dir, safe_serialization)
        self.engine.save_checkpoint(str(location), tag=ENGINE_CHECKPOINT_TAG, **save_model_func_kwargs)
        return location

    def load_state(self, input_dir: str | os.PathLike | None = None, load_kwargs: dict | None = None,
                   **load_model_func_kwargs: Any) -> None:
        """What ``save_state`` saved: the engine's checkpoint (``load_model_func_kwargs`` go to
        ``engine.load_checkpoint``, but ``map_location``), then Accelerate's part."""
        if self.engine is None:
            return super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        input_dir = self._state_dir(input_dir)
        if not os.path.isdir(os.path.join(input_dir, ENGINE_CHECKPOINT_TAG)):
            raise FileNotFoundError(f"load_state: {input_dir} holds no engine checkpoint "
                                    f"({ENGINE_CHECKPOINT_TAG}/): was it written by OffloadAccelerator.save_state?")
        map_location = load_model_func_kwargs.pop("map_location", None)
        self.engine.load_checkpoint(input_dir, tag=ENGINE_CHECKPOINT_TAG, **load_model_func_kwargs)
        self._offload_optimizer._is_overflow = False
        with self._without_engine():
            extra = {} if map_location is None else {"map_location": map_location}
            super().load_state(input_dir, load_kwargs, **extra)

    def _state_dir(self, input_dir: str | os.PathLike | None) -> str:
        """The folder ``Accelerator.load_state`` would read (the newest automatic one without ``input_dir``)."""
        if input_dir is not None:
            input_dir = os.path.expanduser(input_dir)
            if not os.path.isdir(input_dir):
                raise ConfigError(f"Tried to find {input_dir} but folder does not exist")
            return str(input_dir)
        if not self.project_configuration.automatic_checkpoint_naming:
            raise ConfigError("No input_dir provided and automatic checkpoint naming is disabled.")
        root = os.path.join(self.project_dir, "checkpoints")
        folders = [os.path.join(root, f) for f in os.listdir(root)]
        return max(folders, key=lambda f: int(re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", f)[0]))

    def free_memory(self, *objects: Any) -> Any:
        """Closes the engine (its swap files, its daemon session), then Accelerate's ``free_memory``."""
        if self.engine is not None:
            self.engine.close()
        self.engine = self._client_optimizer = self._offload_optimizer = self._offload_scheduler = None
        return super().free_memory(*objects)
