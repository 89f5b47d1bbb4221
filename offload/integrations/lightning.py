"""Lightning's Trainer on the engine: ``OffloadStrategy``, a ``DDPStrategy`` whose model is an offload engine, and
its precision plugin ``OffloadPrecision``. It mirrors Lightning's ``DeepSpeedStrategy`` without importing deepspeed.

```python
import lightning.pytorch as pl
from offload.integrations.lightning import OffloadStrategy

trainer = pl.Trainer(strategy=OffloadStrategy("ds_config.json"), accelerator="cpu", devices=1,
                     accumulate_grad_batches=2, gradient_clip_val=1.0)
trainer.fit(module)                        # configure_optimizers' torch AdamW becomes the engine's optimizer
trainer.fit(module, ckpt_path="last.ckpt")  # a directory the engine wrote: states, loops, scheduler
```

- At setup the LightningModule goes to ``offload.initialize`` with the optimizer ``configure_optimizers``
  returns (torch Adam/AdamW or cpu_adam's, one of them); the engine's optimizer takes its place in the Trainer,
  and the scheduler, re-pointed at it, stays Lightning's to step. A config that names an "optimizer" is used
  instead (``configure_optimizers`` is not called), and a config "scheduler" is handed to Lightning (per step).
- At stage 3, ``configure_model`` runs under ``offload.init_context``: the model is built on the meta device
  and each parameter goes straight into its partition at setup.
- ``accumulate_grad_batches`` is the engine's ``gradient_accumulation_steps``, ``gradient_clip_val`` its
  ``gradient_clipping`` (by norm; the config may say the same), ``precision`` the config's bf16/fp16 sections.
- [Note: Lightning accumulates] ``handles_gradient_accumulation`` is False: Lightning decides, as it does
  without a strategy, which micro-batch ends a window (every ``accumulate_grad_batches``-th and the last of
  an epoch), steps the scheduler and counts ``global_step`` there. The precision plugin tells the engine that
  decision before each backward (``set_gradient_accumulation_boundary``), backpropagates the loss Lightning
  already divided by ``accumulate_grad_batches`` (``scale_wrt_gas=False``), and calls ``engine.step()`` after
  every micro-batch, where it only counts, and after the closure in ``optimizer_step``, where it steps. So
  the steps, the scheduler and ``global_step`` are those of plain Lightning, the short last window of an epoch
  included (``DeepSpeedStrategy`` lets its engine count windows on its own and carries that window over).
- Checkpoints are the engine's (``engine.save_checkpoint(path, tag="checkpoint", client_state=...)``): a
  directory at the path Lightning gives, holding the states and Lightning's own entries (loops, callbacks,
  schedulers) but not its ``state_dict`` or ``optimizer_states``; ``fit(ckpt_path=...)`` loads it after setup.
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import logging
import os
from datetime import timedelta
from typing import Any, Callable, Iterator, Mapping

import torch
from lightning_utilities import apply_to_collection
from torch.optim import LBFGS, Optimizer

import lightning.pytorch as pl
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.callbacks import BaseFinetuning, GradientAccumulationScheduler, StochasticWeightAveraging
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.types import LRSchedulerConfig

from csrc import ConfigError
from offload.builder import initialize
from offload.config.client_optimizer import read_client_optimizer
from offload.engine import Engine
from offload.hf.init_context import init_context
from offload.integrations.lightning_config import (PRECISIONS, default_config, load_config, precision_of,
                                                   put_accumulation, put_clipping, put_precision, stage_of)

logger = logging.getLogger(__name__)

__all__ = ["CHECKPOINT_TAG", "OffloadPrecision", "OffloadStrategy"]

CHECKPOINT_TAG = "checkpoint"
"""The engine checkpoint's tag under the directory Lightning names (``DeepSpeedStrategy``'s too)."""



def _engine_of(module: "pl.LightningModule") -> Engine:
    engine = module.trainer.model
    if not isinstance(engine, Engine):
        raise ConfigError("OffloadPrecision runs backward and step through the engine OffloadStrategy builds when "
                          "fitting; the Trainer holds none now")
    return engine


def _ends_window(module: "pl.LightningModule") -> bool:
    """Whether this micro-batch's backward is the last before an optimizer step ([Note: Lightning accumulates])."""
    if not module.automatic_optimization:
        return True  # manual optimization: each backward is followed by its optimizer.step()
    return not module.trainer.fit_loop._should_accumulate()


class OffloadPrecision(Precision):
    """Backward and optimizer step through the engine. The engine holds the module in the compute dtype (the
    config's bf16/fp16 sections, which ``precision`` is written into) and clips (the config's
    gradient_clipping); here the batch's floating-point tensors are cast to that dtype, as DeepSpeedPrecision
    does. The module is built in fp32 either way: ``initialize`` takes the fp32 masters from it."""

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in PRECISIONS:
            raise ConfigError(f"OffloadPrecision({precision!r}): one of {', '.join(PRECISIONS)}")
        self.precision = precision
        self._dtype = {None: torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[PRECISIONS[precision]]

    def convert_input(self, data: Any) -> Any:
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=torch.Tensor, dst_type=self._dtype)

    def backward(self, tensor: torch.Tensor, model: "pl.LightningModule", optimizer: Any, *args: Any,
                 **kwargs: Any) -> None:
        engine = _engine_of(model)
        batches = model.trainer.accumulate_grad_batches
        if model.automatic_optimization and batches != engine.gradient_accumulation_steps():
            raise ConfigError(f"accumulate_grad_batches changed to {batches} during the fit; the engine was built "
                              f"for {engine.gradient_accumulation_steps()}")
        boundary = _ends_window(model)
        engine.set_gradient_accumulation_boundary(boundary)
        engine.backward(tensor, scale_wrt_gas=False)  # Lightning divided the loss by accumulate_grad_batches
        if not boundary:
            engine.step()  # counts the micro-batch; optimizer_step steps at the boundary

    def optimizer_step(self, optimizer: Any, model: "pl.LightningModule", closure: Callable[[], Any],
                       **kwargs: Any) -> Any:
        if isinstance(optimizer, LBFGS):
            raise ConfigError("LBFGS does not run on the offload engine (it runs Adam/AdamW)")
        result = closure()
        self._after_closure(model, optimizer)
        if model.automatic_optimization and result is None:
            raise ConfigError("training_step returned None (skip this batch): OffloadStrategy needs a loss at "
                              "every micro-batch")
        _engine_of(model).step()
        return result

    def clip_gradients(self, optimizer: Optimizer, clip_val: int | float = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        """The engine clips at its step, by the config's ``gradient_clipping`` (``gradient_clip_val`` goes there)."""


def _repoint(scheduler: Any, client: Optimizer, engine_optimizer: Optimizer) -> None:
    """Point a torch LR scheduler built on ``client`` at the engine's optimizer, whose param groups the engine
    reads (its groups are copies of the client's, made by ``initialize``)."""
    for mine, theirs in zip(engine_optimizer.param_groups, client.param_groups):
        if "initial_lr" in theirs:
            mine.setdefault("initial_lr", theirs["initial_lr"])

    def repoint(s: Any) -> None:
        if getattr(s, "optimizer", None) is client:
            s.optimizer = engine_optimizer
        for child in getattr(s, "_schedulers", ()):  # SequentialLR, ChainedScheduler
            repoint(child)

    repoint(scheduler)
    _track_steps(engine_optimizer)


def _track_steps(optimizer: Optimizer) -> None:
    """Mark ``optimizer.step`` as torch's LR schedulers do when they are built on it, so that a scheduler
    re-pointed at it sees the engine's steps (torch warns at its first ``step()`` otherwise)."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    step = optimizer.step

    def tracked(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True
        return step(*args, **kwargs)

    tracked._wrapped_by_lr_sched = True
    optimizer.step = tracked


class OffloadStrategy(DDPStrategy):
    """``pl.Trainer(strategy=OffloadStrategy(config))``: the LightningModule trained by an offload engine.

    ``config`` is the engine's DeepSpeed-style config (a dict or a JSON path); without it, ``zero_stage``,
    ``offload_optimizer`` and ``offload_params`` ("none", "cpu" or "nvme", with ``nvme_path``) make one (the
    registered names "offload_stage_2_cpu" and "offload_stage_3_cpu" do so). The rest is ``DDPStrategy``'s:
    one process per device, started by Lightning or by torchrun."""

    strategy_name = "offload"

    def __init__(self, config: Any = None, *, zero_stage: int | None = None, offload_optimizer: str | None = None,
                 offload_params: str | None = None, nvme_path: str | None = None,
                 accelerator: "pl.accelerators.Accelerator | None" = None,
                 parallel_devices: list[torch.device] | None = None, cluster_environment: Any = None,
                 checkpoint_io: Any = None, precision_plugin: Precision | None = None,
                 process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout,
                 **kwargs: Any) -> None:
        if config is None:
            config = default_config(zero_stage, offload_optimizer, offload_params, nvme_path)
        elif (zero_stage, offload_optimizer, offload_params, nvme_path) != (None,) * 4:
            raise ConfigError("OffloadStrategy: give config= or zero_stage/offload_optimizer/offload_params/"
                              "nvme_path, not both")
        self._user_config = load_config(config)
        if precision_plugin is None:
            precision_plugin = OffloadPrecision(precision_of(self._user_config))
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, **kwargs)
        self.config: dict[str, Any] | None = None
        """The config the engine is built from: the user's with the Trainer's settings in (at the first use)."""
        self._engine: Engine | None = None

    @property
    def engine(self) -> Engine | None:
        """The engine of the last fit (``DeepSpeedStrategy.deepspeed_engine``); ``engine.close()`` frees its state
        (it is closed at exit otherwise)."""
        return self._engine

    @property
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            return OffloadPrecision(precision_of(self._user_config))
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        """Lightning's own plugin for ``Trainer(precision=...)`` (given to a strategy named by its registered
        name) becomes OffloadPrecision of the same precision; any other plugin is an error."""
        if plugin is not None and not isinstance(plugin, OffloadPrecision):
            precision = getattr(plugin, "precision", None)
            if type(plugin) not in (Precision, MixedPrecision, HalfPrecision) or precision not in PRECISIONS:
                raise ConfigError(f"{type(plugin).__name__} does not run with OffloadStrategy: precision is the "
                                  f"config's bf16/fp16 sections, or OffloadPrecision(one of {', '.join(PRECISIONS)})")
            plugin = OffloadPrecision(precision)
        self._precision_plugin = plugin

    @property
    def zero_stage_3(self) -> bool:
        return stage_of(self._user_config) == 3

    # -- Lightning's hooks, in the order a fit calls them --------------------------------------

    def connect(self, model: "pl.LightningModule") -> None:
        super().connect(model)
        self.config = None  # this run's Trainer settings go in again

    def setup_distributed(self) -> None:
        if self.num_nodes * self.num_processes == 1:  # one process: no process group (the engine needs none)
            reset_seed()
            self.set_world_ranks()
            return
        importlib.import_module("torch.distributed.nn")  # before the group: [Note: world group lifetime] in builder
        super().setup_distributed()

    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        if self.zero_stage_3:  # built on the meta device by model_sharded_context; initialize places it
            yield
            return
        with super().tensor_init_context(empty_init=empty_init):
            yield

    @contextlib.contextmanager
    def model_sharded_context(self) -> Iterator[None]:
        """``configure_model`` under ``offload.init_context`` at stage 3 (DeepSpeed's ``zero.Init``)."""
        with init_context(self._formatted_config(), enabled=self.zero_stage_3):
            yield

    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if trainer.state.fn == TrainerFn.FITTING:
            _refuse_callbacks(trainer)
            self.model = self._build_engine(module)
        else:
            self.model = self._evaluation_model(module)
        self.setup_precision_plugin()

    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        """Nothing: ``setup`` takes ``configure_optimizers``' optimizer into the engine."""

    def model_to_device(self) -> None:
        if not isinstance(self.model, Engine):  # the engine placed its module
            super().model_to_device()

    @property
    def handles_gradient_accumulation(self) -> bool:
        return False  # [Note: Lightning accumulates]

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine loads into the states it built

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine's checkpoint holds them

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing: ``load_checkpoint`` loaded the weights."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: ``load_checkpoint`` loaded the optimizer states."""

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """The engine's checkpoint in the directory ``filepath``, Lightning's entries as its client state."""
        if self._engine is None:  # validate/test without a fit: a plain module
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        if storage_options is not None:
            raise TypeError("OffloadStrategy.save_checkpoint(storage_options=...): the engine writes the "
                            "checkpoint; CheckpointIO is not used")
        filepath = self.broadcast(str(filepath))
        state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        self._engine.save_checkpoint(filepath, tag=CHECKPOINT_TAG, client_state=state)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = str(checkpoint_path)
        if os.path.isfile(path):
            raise ConfigError(f"{path} is a file; OffloadStrategy resumes from the directory its save_checkpoint "
                              "wrote (a plain Lightning checkpoint holds no engine state)")
        if self._engine is None:
            raise ConfigError(f"loading {path} needs the engine of a fit (trainer.fit(..., ckpt_path=...)); for "
                              "validate/test/predict, consolidate it (`offload consolidate`) and load the weights")
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        loaded, client_state = self._engine.load_checkpoint(path, tag=CHECKPOINT_TAG, load_optimizer_states=fitting,
                                                            load_lr_scheduler_states=False)
        if loaded is None:
            raise ConfigError(f"no engine checkpoint in {path} (tag {CHECKPOINT_TAG!r})")
        return client_state

    def teardown(self) -> None:
        # Strategy.teardown would move the module to the CPU: the engine owns where its params live, and keeps
        # them for a validate/test after the fit. (DDPStrategy's unwrapping and layer sync do not apply.)
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("offload_stage_2_cpu", cls, description="offload engine: ZeRO stage 2, "
                                   "optimizer states in host memory", zero_stage=2, offload_optimizer="cpu")
        strategy_registry.register("offload_stage_3_cpu", cls, description="offload engine: ZeRO stage 3, params "
                                   "and optimizer states in host memory", zero_stage=3, offload_optimizer="cpu",
                                   offload_params="cpu")

    # -- the engine ------------------------------------------------------------------------------

    def _formatted_config(self) -> dict[str, Any]:
        """The user's config with the Trainer's accumulation, clipping, precision and micro-batch size in;
        a setting the config gives differently is an error naming both."""
        if self.config is not None:
            return self.config
        module = self.lightning_module
        trainer = module.trainer if module is not None else None
        cfg = copy.deepcopy(self._user_config)
        if trainer is not None:
            put_accumulation(cfg, trainer.accumulate_grad_batches)
            put_clipping(cfg, trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
            if "train_batch_size" not in cfg and "train_micro_batch_size_per_gpu" not in cfg:
                cfg["train_micro_batch_size_per_gpu"] = _loader_batch_size(trainer)
            flag = getattr(trainer._accelerator_connector, "_precision_flag", None)
            if flag not in (None, "32-true", self.precision_plugin.precision):
                raise ConfigError(f"Trainer(precision={flag!r}) and this OffloadStrategy's precision "
                                  f"({self.precision_plugin.precision!r}, from its config's bf16/fp16 sections) "
                                  "disagree: the strategy's is used; set it in the config")
        elif "train_batch_size" not in cfg:
            cfg.setdefault("train_micro_batch_size_per_gpu", 1)
        put_precision(cfg, self.precision_plugin.precision)
        self.config = cfg
        return cfg

    def _build_engine(self, module: "pl.LightningModule") -> Engine:
        if self._engine is not None:
            if self._engine.module is module and self._engine.stage3 is not None:
                raise ConfigError("this LightningModule's params are partitioned by the engine of an earlier fit; "
                                  "fit a new instance (ckpt_path= resumes the state)")
            self._engine.close()
            self._engine = None
        if is_overridden("configure_gradient_clipping", module, pl.LightningModule):
            logger.warning("LightningModule.configure_gradient_clipping is overridden but cannot clip: the engine "
                           "clips by the config's gradient_clipping (Trainer(gradient_clip_val=...) sets it)")
        if is_overridden("backward", module, pl.LightningModule):
            logger.warning("LightningModule.backward is overridden but not called: the engine runs the backward")
        cfg = self._formatted_config()
        if torch.cuda.is_available() and self.root_device.type == "cpu":
            raise ConfigError("the engine computes on the GPU when there is one: use accelerator='gpu' with "
                              "OffloadStrategy")
        client, scheduler_config = None, None
        if "optimizer" in cfg:
            logger.info("the config names the optimizer: configure_optimizers is not called")
        else:
            optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
            if len(optimizers) != 1 or len(schedulers) > 1:
                raise ConfigError(f"configure_optimizers returned {len(optimizers)} optimizers and {len(schedulers)} "
                                  "schedulers; the engine runs one optimizer, with at most one scheduler")
            client, scheduler_config = optimizers[0], (schedulers[0] if schedulers else None)
            if scheduler_config is not None and "scheduler" in cfg:
                raise ConfigError("the config names a scheduler and configure_optimizers returns one: give one")
        engine, optimizer = _initialize(module, cfg, client)
        if scheduler_config is not None:
            _repoint(scheduler_config.scheduler, client, optimizer)
        elif engine.lr_scheduler is not None:  # the config's "scheduler", built by initialize on the engine's optimizer
            scheduler_config = LRSchedulerConfig(engine.lr_scheduler, interval="step")
            _track_steps(optimizer)
        engine.lr_scheduler = None  # Lightning steps it ([Note: Lightning accumulates])
        self.optimizers = [optimizer]
        self.lr_scheduler_configs = [scheduler_config] if scheduler_config is not None else []
        self._engine = engine
        return engine

    def _evaluation_model(self, module: "pl.LightningModule") -> torch.nn.Module | Engine:
        if self._engine is not None and self._engine.module is module:
            return self._engine  # the fit's engine: its params are the trained ones
        if any(p.is_meta for p in module.parameters()):
            raise ConfigError("validate/test/predict of a model built on the meta device (configure_model at "
                              "stage 3) needs the engine of a fit: run trainer.fit first with this Trainer")
        module.to(self.root_device)
        return module


def _loader_batch_size(trainer: "pl.Trainer") -> int:
    """The train dataloader's batch size (only the engine's sample counts read it), else 1; as DeepSpeedStrategy."""
    try:
        source = trainer.fit_loop._data_source
        if source.is_defined():
            size = getattr(source.dataloader(), "batch_size", None)
            if isinstance(size, int) and size > 0:
                return size
    except Exception:  # a datamodule that needs setup first: the size is only for counting
        pass
    return 1


def _initialize(module: "pl.LightningModule", cfg: dict[str, Any], client: Optimizer | None):
    """``offload.initialize`` on the module with the client optimizer. A model built under init_context (meta
    params) gets the optimizer as the config's "optimizer" section instead: initialize gives the meta params
    new objects before it reads the client's param groups, which then hold no param of the model; one group over
    every trainable param, as a section, trains the same."""
    if client is not None and any(p.is_meta for p in module.parameters()):
        section, groups = read_client_optimizer(client)
        trainable = {id(p) for p in module.parameters() if p.requires_grad}
        if len(groups) != 1 or {id(p) for p in groups[0]["params"]} != trainable:
            raise ConfigError("a model built in configure_model at stage 3 takes one param group over all its "
                              "trainable params from configure_optimizers (several groups, or a subset, are not "
                              "supported there yet); build it in __init__ instead, or use one group")
        engine, optimizer, _, _ = initialize(model=module, config={**cfg, "optimizer": section},
                                             dist_init_required=False)
    else:
        engine, optimizer, _, _ = initialize(model=module, config=cfg, optimizer=client, dist_init_required=False)
    return engine, optimizer


def _refuse_callbacks(trainer: "pl.Trainer") -> None:
    """Callbacks that refuse DeepSpeedStrategy by its class, and would not work here either."""
    for callback in trainer.callbacks:
        if isinstance(callback, (BaseFinetuning, StochasticWeightAveraging, GradientAccumulationScheduler)):
            raise ConfigError(f"{type(callback).__name__} does not run with OffloadStrategy (it changes the "
                              "optimizer's groups, copies the module, or the accumulation during the fit)")


if "offload_stage_2_cpu" not in StrategyRegistry:
    OffloadStrategy.register_strategies(StrategyRegistry)
