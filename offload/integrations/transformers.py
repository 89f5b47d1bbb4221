"""The Hugging Face Trainer on the engine: ``OffloadTrainer(..., offload_config=ds_config)``.

```python
from offload.integrations.transformers import OffloadTrainer

trainer = OffloadTrainer(model=model, args=TrainingArguments(...), train_dataset=data,
                         offload_config="ds_config.json")      # DeepSpeed's JSON, "auto" values and all
trainer.train()
```

``OffloadTrainerMixin`` goes before ``Trainer`` (or a subclass: TRL's ``SFTTrainer``) in the bases. It keeps
``args.deepspeed`` None, so transformers and Accelerate take their plain paths (the DeepSpeed ones import the
``deepspeed`` package), and joins the engine at the points the Trainer leaves open (transformers 5.x):

- ``_wrap_model``: builds the engine (``offload.initialize``) from the config with its ``"auto"`` values filled
  from the ``TrainingArguments`` (``resolve_auto``, transformers' own rules for DeepSpeed). The Trainer keeps
  ``self.model``; ``model_wrapped`` is an ``EngineModule`` whose forward is the engine's.
- the optimizer: the config's "optimizer" section if it has one (one group over the trainable params, as
  DeepSpeed runs it), else the Trainer's own (``create_optimizer``: AdamW with its decay / no-decay groups),
  read as the engine reads a client optimizer. The Trainer then holds an ``EngineOptimizer``: the engine's own
  param-group dicts, so the Trainer's LR scheduler sets the lr the engine steps with.
- the schedule: the config's "scheduler" if it has one (the engine steps it), else the Trainer's (its
  ``lr_scheduler_type``, or one handed in ``optimizers=(opt, sched)``), which the Trainer steps.
- ``training_step``: [Note: the Trainer's backward].
- clipping: the engine clips (``gradient_clipping``, from ``max_grad_norm``); the logged ``grad_norm`` is
  ``engine.get_global_grad_norm()``, the norm before clipping as the Trainer logs it.
- checkpoints: the engine's (``save_checkpoint`` into ``checkpoint-N/global_stepN``) and the Trainer's scheduler
  state, RNG states and trainer state beside it; ``resume_from_checkpoint`` loads them back.
- ``save_model``: ``engine.save_16bit_model`` (sharded safetensors + config.json; at stage 3 gathered one unit
  at a time, never the whole model in one process).
"""
from __future__ import annotations

import contextlib
import copy
import glob
import json
import logging
import os
from typing import Any, Iterator

import torch
import transformers
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME

import offload
from csrc import ConfigError
from offload.config.client_optimizer import read_client_optimizer

logger = logging.getLogger(__name__)

__all__ = ["EngineModule", "EngineOptimizer", "EngineScheduler", "OffloadTrainer", "OffloadTrainerMixin",
           "init_context", "load_offload_config", "resolve_auto"]


# -- the config's "auto" values ---------------------------------------------------------------


def load_offload_config(config: str | os.PathLike | dict) -> dict:
    """A private copy of a DeepSpeed config given as a dict or a JSON path."""
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            return json.load(f)
    if isinstance(config, dict):
        return copy.deepcopy(config)
    raise ConfigError(f"offload_config must be a dict or a JSON path, got {type(config).__name__}")


class _Filler:
    """transformers' ``HfTrainerDeepSpeedConfig.fill_match``: an "auto" becomes the Trainer's value; a value set
    by hand that differs from it is a mismatch, all reported at once."""

    def __init__(self, config: dict) -> None:
        self.config = config
        self.mismatches: list[str] = []

    def node(self, dotted: str) -> tuple[dict | None, str]:
        *parents, key = dotted.split(".")
        node: Any = self.config
        for name in parents:
            node = node.get(name) if isinstance(node, dict) else None
            if node is None:
                return None, key
        return (node if isinstance(node, dict) else None), key

    def is_auto(self, dotted: str) -> bool:
        node, key = self.node(dotted)
        return node is not None and node.get(key) == "auto"

    def fill(self, dotted: str, value: Any, arg_name: str, must_match: bool = True) -> None:
        node, key = self.node(dotted)
        if node is None:
            return
        if node.get(key) == "auto":
            node[key] = value
            return
        given = node.get(key)
        if must_match and given is not None and _plain(given) != _plain(value):
            self.mismatches.append(f"- {dotted}={given!r} vs TrainingArguments {arg_name}={value!r}")

    def fill_only(self, dotted: str, value: Any) -> None:
        self.fill(dotted, value, "", must_match=False)


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _hidden_size(model: torch.nn.Module | None) -> int | None:
    cfg = getattr(model, "config", None)
    for c in (cfg, getattr(cfg, "text_config", None)):
        if c is None:
            continue
        if getattr(c, "hidden_size", None) is not None:
            return int(c.hidden_size)
        if getattr(c, "hidden_sizes", None):
            return int(max(c.hidden_sizes))
    return None


def resolve_auto(config: dict, args: "transformers.TrainingArguments", *, model: torch.nn.Module | None = None,
                 num_training_steps: int | None = None) -> dict:
    """``config`` (unchanged) with transformers' "auto" values filled from ``args``, as the Trainer fills a
    DeepSpeed config (``trainer_config_process``, then with the model and the step count
    ``trainer_config_finalize``). A value set by hand that differs from the Trainer's is a ``ConfigError``
    listing each. Without ``num_training_steps`` the keys that need it (the scheduler's total and warm-up
    steps) and the model (the hidden-size buckets) are left as they are."""
    out = copy.deepcopy(config)
    f = _Filler(out)
    gas = args.gradient_accumulation_steps
    micro = args.per_device_train_batch_size
    f.fill("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size", not args.auto_find_batch_size)
    f.fill("gradient_accumulation_steps", gas, "gradient_accumulation_steps")
    f.fill("train_batch_size", args.world_size * micro * gas, "world_size*per_device_train_batch_size*"
           "gradient_accumulation_steps", not args.auto_find_batch_size)
    f.fill("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    f.fill("optimizer.params.lr", args.learning_rate, "learning_rate")
    f.fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2")
    f.fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    f.fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    f.fill_only("scheduler.params.warmup_min_lr", 0)
    f.fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    if args.save_on_each_node:
        out.setdefault("checkpoint", {})["use_node_local_storage"] = True
    f.fill("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16|fp16_full_eval")
    f.fill("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16|bf16_full_eval")
    if model is not None:
        buckets = [k for k in ("zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                               "zero_optimization.stage3_param_persistence_threshold") if f.is_auto(k)]
        if buckets:
            hidden = _hidden_size(model)
            if hidden is None:
                raise ConfigError(f"{', '.join(buckets)} are \"auto\" but the model's config has no hidden_size "
                                  "(or hidden_sizes): give them numbers")
            f.fill_only("zero_optimization.reduce_bucket_size", hidden * hidden)
            if (out.get("zero_optimization") or {}).get("stage") == 3:
                f.fill_only("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden * hidden))
                f.fill_only("zero_optimization.stage3_param_persistence_threshold", 10 * hidden)
    if num_training_steps is not None:
        f.fill("scheduler.params.total_num_steps", num_training_steps, "num_training_steps (calculated)")
        f.fill("scheduler.params.warmup_num_steps", max(1, args.get_warmup_steps(num_training_steps)), "warmup_steps")
    if f.mismatches:
        raise ConfigError("offload_config values differ from the TrainingArguments:\n" + "\n".join(f.mismatches)
                          + "\nset them to \"auto\" in the config to take the Trainer's")
    return out


def _stage(config: dict) -> int:
    zero = config.get("zero_optimization")
    return int(zero.get("stage", 0)) if isinstance(zero, dict) else 0


@contextlib.contextmanager
def init_context(offload_config: str | os.PathLike | dict) -> Iterator[None]:
    """``offload.init_context`` for a config that may still hold the Trainer's "auto" values: build the model
    (``from_pretrained`` too) partitioned at stage 3, for ``OffloadTrainer(model=...)``."""
    config = load_offload_config(offload_config)
    if _stage(config) != 3:
        raise ConfigError(f"init_context needs zero_optimization.stage 3, the config says {_stage(config)}")
    with offload.init_context(None):  # None: stage 3, nothing else of the config is read while building
        yield


# -- what the Trainer holds ---------------------------------------------------------------------


class EngineModule(torch.nn.Module):
    """The Trainer's ``model_wrapped``: forward through the engine (the compute-dtype cast, stage 3's gathers);
    ``train()``, ``eval()`` and ``parameters()`` reach the model (``self.module``, the Trainer's ``self.model``)."""

    def __init__(self, engine: "offload.Engine") -> None:
        super().__init__()
        self.module = engine.module
        self.engine = engine  # not a Module: a plain attribute

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def _get_name(self) -> str:
        """The model's class name (a PEFT model's base model's), which the Trainer reads to shift the labels for a
        causal LM's label smoothing."""
        inner = self.module.get_base_model() if hasattr(self.module, "get_base_model") else self.module
        return inner._get_name()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()


class EngineOptimizer(torch.optim.Optimizer):
    """The Trainer's optimizer: the engine optimizer's own param-group dicts (a scheduler built on this one sets
    the lr the engine steps with); ``step()`` does nothing, the engine stepped at the end of the boundary's
    backward ([Note: the Trainer's backward]); its state lives in the tier, saved by the engine's checkpoint."""

    def __init__(self, engine: "offload.Engine") -> None:
        source = engine.optimizer
        super().__init__(source.param_groups, dict(source.defaults))
        self.param_groups = source.param_groups  # the same list of the same dicts
        self.engine = engine

    def step(self, closure=None):  # noqa: D102 - torch's signature
        if closure is not None:
            raise ConfigError("the offload engine's optimizer takes no closure")
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: D102
        self.engine.zero_grad()

    def state_dict(self) -> dict[str, Any]:  # noqa: D102 - the hyperparameters; the states are the engine's
        return {"state": {}, "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                              for g in self.param_groups]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # noqa: D102 - in place: the dicts are shared
        for group, saved in zip(self.param_groups, state_dict.get("param_groups", ())):
            group.update({k: v for k, v in saved.items() if k != "params"})


class EngineScheduler:
    """The Trainer's ``lr_scheduler`` when the config names one: the engine steps it at each boundary, so
    ``step()`` here does nothing (as Accelerate's DeepSpeed scheduler wrapper). ``get_last_lr()`` is the lr the
    last step ran at, which the plain Trainer logs (the engine has moved its scheduler on by then)."""

    def __init__(self, engine: "offload.Engine") -> None:
        self.engine = engine
        self.step_lr: list[float] | None = None  # set by the Trainer's backward before the engine steps

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def get_last_lr(self) -> list[float]:
        return self.step_lr if self.step_lr is not None else self.engine.lr_scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.engine.lr_scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.engine.lr_scheduler.load_state_dict(state_dict)


class _GroupsByName:
    """Param groups by parameter name, resolved to the model's parameters when ``initialize`` iterates them
    ([Note: groups by name])."""

    def __init__(self, model: torch.nn.Module, groups: list[tuple[list[str], dict[str, Any]]]) -> None:
        self.model = model
        self.groups = groups

    def __iter__(self) -> Iterator[dict[str, Any]]:
        params = dict(self.model.named_parameters())
        for names, hypers in self.groups:
            if names:
                yield {"params": [params[n] for n in names], **hypers}


# [Note: groups by name] The Trainer builds its optimizer (create_optimizer) before the model is wrapped, over
# the parameters the model has then. A model built under init_context has meta parameters that initialize
# replaces with its own before it reads the param groups, so the optimizer's tensors are not the model's any
# more. The groups are kept by name and looked up when initialize iterates them (after the replacement); the
# Trainer's optimizer object itself is only read for its kind and hyperparameters.


def _trainer_optimizer_groups(optimizer: torch.optim.Optimizer, model: torch.nn.Module):
    """The config's "optimizer" section equivalent to the Trainer's optimizer, and its groups by name."""
    section, groups = read_client_optimizer(optimizer)  # Adam/AdamW only; AMSGrad, maximize, mixed modes refused
    names = {id(p): n for n, p in model.named_parameters()}
    named = []
    for group in groups:
        missing = [p for p in group["params"] if id(p) not in names]
        if missing:
            raise ConfigError("the Trainer's optimizer holds a tensor that is not a parameter of the model")
        named.append(([names[id(p)] for p in group["params"]],
                      {k: (list(v) if k == "betas" else v) for k, v in group.items() if k != "params"}))
    return section, named


def _drive_engine_groups(client: torch.optim.Optimizer, engine_optimizer: torch.optim.Optimizer) -> None:
    """Let a scheduler built over the Trainer's optimizer (``client``) drive the engine's lr: the client's param
    groups become the engine's (with the lr and initial_lr the scheduler set at construction); the Trainer steps
    the scheduler as before. ``client.step()`` is never called: the engine steps."""
    if len(client.param_groups) != len(engine_optimizer.param_groups):
        raise ConfigError(f"the Trainer's optimizer has {len(client.param_groups)} param groups (an empty one?), "
                          f"the engine's {len(engine_optimizer.param_groups)}: its scheduler cannot drive them")
    for mine, theirs in zip(engine_optimizer.param_groups, client.param_groups):
        mine.update({k: theirs[k] for k in ("lr", "initial_lr") if k in theirs})
    client.param_groups = engine_optimizer.param_groups
    client._opt_called = True  # torch's schedulers warn unless the optimizer stepped (the engine does it)


# -- the mixin ---------------------------------------------------------------------------------


class OffloadTrainerMixin:
    """Put before ``transformers.Trainer`` (or a subclass) in the bases; pass ``offload_config=`` (a DeepSpeed
    config, path or dict) and leave ``args.deepspeed`` unset. See the module docstring."""

    def __init__(self, *args: Any, offload_config: str | os.PathLike | dict | None = None, **kwargs: Any) -> None:
        if offload_config is None:
            raise ConfigError(f"{type(self).__name__} needs offload_config= (a DeepSpeed config: dict or JSON path)")
        self.offload_config = load_offload_config(offload_config)
        self.offload_engine: "offload.Engine | None" = None
        self._offload_wrapper: EngineModule | None = None
        super().__init__(*args, **kwargs)
        if self.args.deepspeed:
            raise ConfigError(f"{type(self).__name__} trains through the offload engine: pass the config as "
                              "offload_config= and leave TrainingArguments(deepspeed=...) unset")
        if self.model_init is not None or self.args.auto_find_batch_size:
            raise ConfigError(f"{type(self).__name__} builds one engine for the model it is given: model_init "
                              "(hyperparameter search) and auto_find_batch_size are not supported")
        resolve_auto(self.offload_config, self.args)  # a value that differs from the arguments fails now
        if self.args.max_grad_norm and "gradient_clipping" not in self.offload_config:
            logger.warning("max_grad_norm=%s but the offload config has no gradient_clipping: the engine does not "
                           "clip (as DeepSpeed); add \"gradient_clipping\": \"auto\"", self.args.max_grad_norm)
        if (self.args.bf16 or self.args.fp16) and not any(k in self.offload_config for k in ("bf16", "fp16")):
            logger.warning("bf16/fp16 is set in the TrainingArguments but the offload config has no \"bf16\" / "
                           "\"fp16\" section: the engine computes in fp32; add {\"enabled\": \"auto\"}")
        if getattr(self.accelerator, "scaler", None) is not None:
            self.accelerator.scaler = None  # fp16: the engine scales the loss itself (its "fp16" section)

    # -- the model and the optimizer -----------------------------------------------------------

    def _move_model_to_device(self, model: torch.nn.Module, device: torch.device) -> None:
        """The engine places the model (``initialize``); a stage 3 model has no full weights to move."""
        return None

    def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader: Any = None) -> torch.nn.Module:
        if self._offload_wrapper is not None:
            return self._offload_wrapper
        if not training:  # evaluate() before train(): the plain model, which stage 3 does not have
            if _stage(self.offload_config) == 3:
                raise ConfigError("evaluate()/predict() before train() at stage 3: the engine is built by train() "
                                  "(call train() first)")
            return super()._wrap_model(model, training=training, dataloader=dataloader)
        return self._build_engine()

    def _build_engine(self) -> EngineModule:
        config = resolve_auto(self.offload_config, self.args, model=self.model,
                              num_training_steps=self.state.max_steps)
        model_parameters, client = None, None
        if "optimizer" not in config:
            if self.optimizer is None:
                self.create_optimizer()
            client = self.optimizer
            config["optimizer"], named = _trainer_optimizer_groups(client, self.model)
            model_parameters = _GroupsByName(self.model, named)
        elif self.optimizer is not None:
            logger.info("the offload config names an optimizer: it is used, not the Trainer's %s",
                        type(self.optimizer).__name__)
        handed = self.lr_scheduler  # optimizers=(opt, sched): built over the Trainer's optimizer
        if handed is not None and ("scheduler" in config or getattr(handed, "optimizer", None) is not client):
            raise ConfigError("the scheduler handed to the Trainer (optimizers=(opt, sched)) must be built over the "
                              "optimizer handed with it, and the config must then name no \"scheduler\"")
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):  # the plain Trainer draws nothing here: neither do we
            engine, _, _, _ = offload.initialize(model=self.model, config=config, model_parameters=model_parameters)
        self.offload_engine = engine
        self._offload_wrapper = EngineModule(engine)
        self.optimizer = EngineOptimizer(engine)
        if engine.lr_scheduler is not None:
            self.lr_scheduler = EngineScheduler(engine)
        elif handed is not None:
            _drive_engine_groups(client, engine.optimizer)
        return self._offload_wrapper

    # -- a training step -------------------------------------------------------------------------

    # [Note: the Trainer's backward] Trainer.training_step (and the subclasses' that wrap it, TRL's) divides the
    # loss by the accumulation steps itself and hands it to accelerator.backward. For the step it runs, that call
    # is the engine's, as Accelerate's DeepSpeed wrapper makes it: the boundary is the Trainer's sync_gradients
    # (a short last cycle of an epoch too), backward does not divide again (scale_wrt_gas=False), and step() runs
    # every micro-batch (it acts at the boundary: clip, Adam, the config's scheduler). So the norm is known when
    # the Trainer reads it for its log, and the Trainer's optimizer.step() after it has nothing left to do.

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None):
        engine = self.offload_engine
        if engine is None:
            return super().training_step(model, inputs, num_items_in_batch)
        accelerator = self.accelerator

        def backward(loss: torch.Tensor, **kwargs: Any) -> None:
            engine.set_gradient_accumulation_boundary(accelerator.sync_gradients)
            skipped = engine.skipped_steps
            if accelerator.sync_gradients and isinstance(self.lr_scheduler, EngineScheduler):
                self.lr_scheduler.step_lr = engine.get_lr()
            engine.backward(loss, scale_wrt_gas=False)
            engine.step()
            if accelerator.sync_gradients and hasattr(self.optimizer, "_is_overflow"):
                self.optimizer._is_overflow = engine.skipped_steps != skipped  # fp16: the schedule skips it too

        before = vars(accelerator).get("backward")  # an instance attribute someone else set, if any
        accelerator.backward = backward
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            if before is None:
                del accelerator.backward
            else:
                accelerator.backward = before

    def _clip_grad_norm(self, model: torch.nn.Module):
        if self.offload_engine is None:
            return super()._clip_grad_norm(model)
        return self.offload_engine.get_global_grad_norm()  # the engine clipped in its step

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None):
        if self.offload_engine is None:
            return super()._get_grad_norm(model, grad_norm=grad_norm)
        return self.offload_engine.get_global_grad_norm()

    # -- saving and resuming -----------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """What ``from_pretrained`` loads: ``engine.save_16bit_model`` (every rank takes part; rank 0 writes)."""
        engine = self.offload_engine
        if engine is None:
            if _stage(self.offload_config) == 3 and any(p.is_meta for p in self.model.parameters()):
                raise ConfigError("save_model() before train() at stage 3: the weights reach the engine at train()")
            return super().save_model(output_dir, _internal_call=_internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        engine.save_16bit_model(output_dir)
        if self.args.should_save:
            tokenizer = self.processing_class or getattr(self.data_collator, "tokenizer", None)
            if tokenizer is not None:
                tokenizer.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        engine = self.offload_engine
        if engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        engine.save_checkpoint(output_dir, tag=f"global_step{self.state.global_step}")  # every rank: its shards
        if self.args.should_save and not isinstance(self.lr_scheduler, EngineScheduler):  # else in the engine's
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        if glob.glob(os.path.join(resume_from_checkpoint, "global_step*")):
            return None  # the engine's checkpoint holds the weights: loaded with the optimizer states
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        engine = self.offload_engine
        if engine is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        path, _ = engine.load_checkpoint(checkpoint)
        if path is None:
            raise ConfigError(f"{checkpoint} holds no offload engine checkpoint (global_step*/ and latest): "
                              "resume from a checkpoint this trainer saved")
        if isinstance(self.lr_scheduler, EngineScheduler):
            return None  # restored with the engine
        saved = os.path.join(checkpoint, SCHEDULER_NAME)
        if not os.path.isfile(saved):
            raise ConfigError(f"{checkpoint} has no {SCHEDULER_NAME}: resuming would restart the LR schedule")
        self.lr_scheduler.load_state_dict(torch.load(saved, weights_only=True))

    def _load_best_model(self) -> None:
        engine = self.offload_engine
        if engine is None:
            return super()._load_best_model()
        best = self.state.best_model_checkpoint
        path, _ = engine.load_checkpoint(best, load_lr_scheduler_states=False)
        if path is None:
            raise ConfigError(f"load_best_model_at_end: {best} holds no offload engine checkpoint "
                              "(save_only_model=True saves none)")

    def end(self) -> None:
        """Close the engine (its swap files, its daemon session) before the ranks' group goes."""
        if self.offload_engine is not None:
            self.offload_engine.close()
        super().end()


class OffloadTrainer(OffloadTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` trained through the offload engine: ``OffloadTrainer(..., offload_config=...)``."""
