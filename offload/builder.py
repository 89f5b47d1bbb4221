"""``initialize()``: the one place that knows the whole engine (``offload.initialize`` is this module's function;
the module is named builder so that the package attribute stays the function). It reads the config, joins the
ranks, lays out the parameters, opens the tier, and wires the parts into an ``Engine``.

Everything that can be wrong with the config is found by ``read_config`` before any of
this allocates memory or opens a file.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from csrc import ConfigError, StateTornError
from offload.checkpoint.resume import (FINISH, FRESH, RESUME, ROLLBACK, TORN, CommitRegion, agree, inspect_session,
                                       open_undo, roll_back, step_multiplier, undo_exists, undo_slots)
from offload.config import EngineConfig, OffloadDevice, read_config, resolve_daemon_socket, resolve_job_id, resolve_resume
from offload.config.client_optimizer import read_client_optimizer
from offload.config.schedulers import build_scheduler
from offload.engine import Engine, RankInfo, close_at_exit
from offload.hf.init_context import init_fn_of, init_record_of
from offload.hf.load import pending_load_of
from offload.hf.model_init import InitStep, plan_steps
from offload.plan.memory import OptimizerPlan, engine_optimizer_plan, flat_layout, sub_group_numel
from offload.precision import LossScaler, LossScalerConfig
from offload.report import reporter_for
from offload.runtime.omp_wait import quiet_omp_waits
from offload.runtime.rendezvous import init_distributed
from offload.tiers import Tier, open_tier
from offload.zero.device_share import WITH_DAEMON, device_buckets, device_share
from offload.zero.external import register_known_reads
from offload.zero.grads import GradReducer
from offload.zero.layout import FlatLayout
from offload.zero.node_buffers import open_node_buffers, write_own_shards
from offload.zero.optimizer import OffloadOptimizer, PartitionedAdam
from offload.zero.overlap import OverlappedStep, overlap_runs, overlap_wanted
from offload.zero.stage3 import build_stage3, replace_meta_params
from offload.zero.state_format import StateFormat
from offload.zero.states import StateStorage
from offload.zero.step_tail import attach_tail
from offload.zero.unit_grads import UnitGradReducer

logger = logging.getLogger(__name__)

__all__ = ["add_config_arguments", "init_distributed", "initialize"]


def add_config_arguments(parser):
    """DeepSpeed's argparse flags: ``--deepspeed`` and ``--deepspeed_config PATH`` (which ``initialize(args=...)``
    reads when no ``config=`` is given), and ``--local_rank`` for launchers that pass it."""
    group = parser.add_argument_group("offload", "offload engine configuration (DeepSpeed's flags)")
    group.add_argument("--deepspeed", default=False, action="store_true", help="accepted for DeepSpeed scripts")
    group.add_argument("--deepspeed_config", default=None, type=str, help="the DeepSpeed-style JSON config")
    if not any("--local_rank" in a.option_strings for a in parser._actions):
        group.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", "0")))
    return parser


def _warn_overridden(config: EngineConfig) -> None:
    """Warn once about settings the daemon overrides: it places the state in its own pool and swap."""
    socket = resolve_daemon_socket(config.offload)
    if not socket:
        return
    for dotted, target in (("zero_optimization.offload_optimizer", config.zero.offload_optimizer),
                           ("zero_optimization.offload_param", config.zero.offload_param)):
        if target.device == OffloadDevice.NVME and target.nvme_path:
            logger.warning("%s.nvme_path %s is not used: the daemon at %s holds this state, in its pool and its "
                           "own swap paths", dotted, target.nvme_path, socket)
    if config.offload.swap_capacity_bytes is not None:
        logger.warning("offload.swap_capacity_bytes is not used: the daemon at %s sizes its own swap", socket)


def _note_inert_settings(config: EngineConfig) -> None:
    """Say once which accepted settings do not change what this engine does, and why."""
    zero, inert = config.zero, []
    if not zero.contiguous_gradients:
        inert.append("zero_optimization.contiguous_gradients=false (gradients always land in flat buffers)")
    if not zero.reduce_scatter:
        inert.append("zero_optimization.reduce_scatter=false (stages 1-2 always reduce-scatter buckets)")
    if zero.overlap_comm:
        inert.append("zero_optimization.overlap_comm (buckets are always reduced while backward runs)")
    if zero.round_robin_gradients:
        inert.append("zero_optimization.round_robin_gradients")
    off = zero.offload_optimizer
    if off.pipeline_read or off.pipeline_write:
        inert.append("offload_optimizer.pipeline_read/pipeline_write (NVMe sub-groups are always pipelined)")
    if off.fast_init:
        inert.append("offload_optimizer.fast_init")
    param = zero.offload_param
    if zero.stage == 3 and param.device != OffloadDevice.NONE:  # buffer_count acts with nvme: the shard window
        inert.append("offload_param.buffer_size (host buffers are sized from the largest param shard)")
        inert.append("offload_param.max_in_cpu (with nvme, at most buffer_count shards are in host memory)"
                     if param.device == OffloadDevice.NVME else "offload_param buffer_count/max_in_cpu with cpu "
                     "(every shard is in host memory)")
    for item in inert:
        logger.info("accepted, no effect here: %s", item)


def _ranks() -> RankInfo:
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    # group None: the default (world) group, not held (see [Note: world group lifetime])
    return RankInfo(rank=rank, world_size=world, local_rank=local, device=device, group=None)


def _renamed_groups(model_parameters: Iterable, names: dict[int, str], now: dict[str, torch.nn.Parameter]) -> list:
    """``model_parameters`` (params, or param groups) with each of the model's old param objects replaced by
    the param of the same name now (a model built under ``init_context`` gets new ones); others as they were."""
    def follow(p):
        name = names.get(id(p))
        return now[name] if name is not None and name in now else p
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return [dict(g, params=[follow(p) for p in g["params"]]) for g in items]
    return [follow(p) for p in items]


def _param_groups(model: torch.nn.Module, model_parameters: Iterable | None) -> list[dict[str, Any]]:
    """torch-style param groups (dicts with "params") over trainable parameters of ``model``."""
    items = list(model.parameters() if model_parameters is None else model_parameters)
    if items and isinstance(items[0], dict):
        groups = [dict(g, params=[p for p in g["params"] if p.requires_grad]) for g in items]
    else:
        groups = [{"params": [p for p in items if p.requires_grad]}]
    owned = {id(p) for p in model.parameters()}
    for g in groups:
        for p in g["params"]:
            if id(p) not in owned:
                raise ConfigError("model_parameters holds a tensor that is not a parameter of the model")
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ConfigError("the model has no trainable parameters")
    return groups


def _refuse_adapters_on_meta(model: torch.nn.Module) -> None:
    """PEFT's adapters over a model built under ``init_context`` are not supported: the init replay and the
    pretrained load know the base model's names, not the wrapper's, and would give the adapters the base's
    init ([Note: init replay] in offload.hf.model_init)."""
    if any(type(m).__module__.startswith("peft.") for m in model.modules()) \
            and any(p.is_meta for p in model.parameters()):
        raise ConfigError("a PEFT model over a base built under offload.init_context is not supported: build the base "
                          "whole (from_pretrained outside the context), then get_peft_model; stage 3 partitions and "
                          "offloads its frozen weights at initialize")


def _compute_dtype(config: EngineConfig) -> torch.dtype:
    if config.fp16.enabled:
        return torch.float16
    if config.bf16.enabled:
        return torch.bfloat16
    return torch.float32


def _scaler(config: EngineConfig) -> LossScaler:
    fp16 = config.fp16
    if not fp16.enabled:
        return LossScaler(LossScalerConfig(dynamic=False))
    return LossScaler(LossScalerConfig(
        dynamic=fp16.loss_scale == 0, static_scale=fp16.loss_scale or 1.0, initial_scale_power=fp16.initial_scale_power,
        window_steps=fp16.loss_scale_window, hysteresis=fp16.hysteresis,
        consecutive_hysteresis=fp16.consecutive_hysteresis, min_scale=fp16.min_loss_scale))


def _flatten(model: torch.nn.Module, layout: FlatLayout, params: list[torch.nn.Parameter],
             dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Move the params into one flat buffer (see [Note: flat layout]); each param becomes a view of it."""
    flat = torch.zeros(layout.total_numel, dtype=dtype, device=device)
    with torch.no_grad():
        for slot, p in zip(layout.slots, params):
            view = flat[slot.offset:slot.offset + slot.numel].view(slot.shape)
            view.copy_(p.detach())
            p.data = view
    return flat


def _node_buffers(cfg: EngineConfig, layout: FlatLayout, ranks: RankInfo, shard: bool,
                  params: list[torch.nn.Parameter], flat: torch.Tensor):
    """Stages 1-2 on the CPU over several ranks of one node: the shared param and gradient buffers, the
    params moved into them (each rank's own shards written: [Note: node-shared buffers]); else None."""
    if not (shard and ranks.device.type == "cpu" and cfg.offload.node_shared_buffers):
        return None
    node = open_node_buffers(layout.total_numel, flat.dtype, group=ranks.group, rank=layout.rank,
                             world=layout.world_size)
    if node is None:
        return None
    write_own_shards(node, [(b.shard_start(layout.rank), b.shard_numel) for b in layout.buckets], flat)
    with torch.no_grad():
        for slot, p in zip(layout.slots, params):
            p.data = node.params[slot.offset:slot.offset + slot.numel].view(slot.shape)
    return node


def _scheduler(lr_scheduler: Any, config: EngineConfig, optimizer: torch.optim.Optimizer) -> Any:
    """The LR scheduler over the engine's optimizer: the caller's (a factory called with it, or one built over
    the client optimizer, re-pointed at the engine's, whose param groups it then drives: the client optimizer
    is only read), else the config's, else None."""
    if lr_scheduler is not None:
        if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            return lr_scheduler(optimizer)
        client = getattr(lr_scheduler, "optimizer", None)
        if isinstance(client, torch.optim.Optimizer) and client is not optimizer:
            if len(client.param_groups) != len(optimizer.param_groups):
                raise ConfigError(f"lr_scheduler drives an optimizer of {len(client.param_groups)} param groups, the "
                                  f"engine's has {len(optimizer.param_groups)}: build it over the optimizer passed "
                                  "to initialize(optimizer=...), or pass a function of the optimizer")
            for mine, theirs in zip(optimizer.param_groups, client.param_groups):
                mine["lr"] = theirs["lr"]  # where the scheduler has put it (its first step ran at construction)
                if "initial_lr" in theirs:
                    mine["initial_lr"] = theirs["initial_lr"]
            lr_scheduler.optimizer = optimizer
        return lr_scheduler
    if config.scheduler is not None:
        return build_scheduler(config.scheduler, optimizer)
    return None


def _dataloader(training_data: Any, config: EngineConfig, ranks: RankInfo, collate_fn: Callable | None) -> DataLoader:
    sampler = DistributedSampler(training_data, num_replicas=ranks.world_size, rank=ranks.rank, shuffle=True)
    return DataLoader(training_data, batch_size=config.batch.micro_batch_size_per_gpu, sampler=sampler,
                      collate_fn=collate_fn, drop_last=True)


def initialize(args: Any = None, model: torch.nn.Module | None = None, optimizer: Any = None,
               model_parameters: Iterable | None = None, training_data: Any = None, lr_scheduler: Any = None,
               config: Any = None, collate_fn: Callable | None = None, config_params: Any = None,
               dist_init_required: bool | None = None) -> tuple[Engine, OffloadOptimizer, DataLoader | None, Any]:
    """DeepSpeed's ``initialize``: returns ``(engine, optimizer, training_dataloader, lr_scheduler)``."""
    if model is None:
        raise ConfigError("initialize() needs model=")
    client = None
    if optimizer is not None:  # its kind, defaults and param groups, as the config's section would give them
        client, client_groups = read_client_optimizer(optimizer)
        if model_parameters is not None:
            logger.info("initialize(): model_parameters ignored: the optimizer's param groups are used")
        model_parameters = client_groups
    source = config if config is not None else config_params
    if source is None and args is not None:
        source = getattr(args, "deepspeed_config", None)
    if source is None:
        raise ConfigError("no config: pass config= (a dict or a JSON path), or args with --deepspeed_config")
    if dist_init_required is not False:
        init_distributed()
    quiet_omp_waits()  # [Note: OpenMP waits]: torch's team sleeps rather than spins on a shared node
    ranks = _ranks()
    cfg = read_config(source, world_size=ranks.world_size, client_optimizer=client)
    if cfg.optimizer is None:
        raise ConfigError("the config has no \"optimizer\" section: name Adam or AdamW there, or pass "
                          "initialize(optimizer=CPUAdam(...))")
    zero = cfg.zero
    if zero.stage != 3 and zero.offload_param.device != OffloadDevice.NONE:
        raise ConfigError("zero_optimization.offload_param needs zero_optimization.stage 3")
    _note_inert_settings(cfg)
    _warn_overridden(cfg)

    dtype = _compute_dtype(cfg)
    stage3 = zero.stage == 3
    if stage3:
        _refuse_adapters_on_meta(model)
        register_known_reads(model)  # [Note: external parameters]: PEFT's DoRA reads its base layer's weight
    record = init_record_of(model) if stage3 and init_fn_of(model) is None else None
    init_steps = plan_steps(model, record) if record is not None else None  # on the meta params, before they go
    before = {id(p): n for n, p in model.named_parameters()}  # the client's groups name these objects
    meta = stage3 and replace_meta_params(model, dtype, ranks.device)  # built under offload.init_context
    if meta and model_parameters is not None:  # the meta params are new objects now: follow them by name
        model_parameters = _renamed_groups(model_parameters, before, dict(model.named_parameters()))
    groups = _param_groups(model, model_parameters)
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for g in groups for p in g["params"]]
    masters = None if stage3 else [p.detach().to("cpu", torch.float32, copy=True) for p in params]  # before casts
    if not meta:
        model.to(device=ranks.device)
        if dtype != torch.float32:
            model.to(dtype=dtype)
    device_kind = zero.offload_optimizer.device
    offloaded = device_kind != OffloadDevice.NONE
    sub_group = sub_group_numel(zero.sub_group_size, offloaded=offloaded)
    shard = zero.stage >= 1 and ranks.world_size > 1
    overlap = overlap_wanted(cfg.offload.overlap_step, device_type=ranks.device.type, stage=zero.stage,
                             offloaded=offloaded, delayed=cfg.offload.delayed_update)
    parts, node = None, None
    if stage3:
        parts = build_stage3(model, [g["params"] for g in groups], names, zero=zero, aio=cfg.aio,
                             checksum=cfg.offload.checksum, dtype=dtype, device=ranks.device, rank=ranks.rank,
                             world_size=ranks.world_size, group=ranks.group, sub_group_numel=sub_group,
                             param_init_fn=init_fn_of(model), offload=cfg.offload,
                             init_steps=init_steps if any(isinstance(s, InitStep) for s in init_steps or ()) else None,
                             pretrained=pending_load_of(model))
        layout = parts.optimizer_layout  # the trainable units only ([Note: frozen units] in offload.zero.units)
        flat_params = torch.empty(0, dtype=dtype, device=ranks.device)  # stage 3 holds no full copy
        flat_grads = None  # nor a full gradient buffer: [Note: unit gradients]
    else:
        layout = flat_layout([(names.get(id(p), f"param{i}"), tuple(p.shape), gi)
                              for gi, g in enumerate(groups) for i, p in enumerate(g["params"])],
                             stage=zero.stage, reduce_bucket_size=zero.reduce_bucket_size, world_size=ranks.world_size,
                             rank=ranks.rank, sub=sub_group, overlap=overlap)
        logger.info("rank %d: %s", ranks.rank, layout.describe())
        flat_params = _flatten(model, layout, params, dtype, ranks.device)
        node = _node_buffers(cfg, layout, ranks, shard, params, flat_params)
        if node is not None:  # [Note: node-shared buffers] in offload.zero.node_buffers
            flat_params, flat_grads = node.params, node.grads[layout.rank]
        else:
            flat_grads = torch.zeros_like(flat_params)

    t0 = time.perf_counter()
    on_device = device_share(zero.offload_optimizer.ratio, layout, ranks.device, rank=ranks.rank) if offloaded else frozenset()
    if on_device and len(on_device) == len(layout.sub_groups):  # nothing left to offload: as offload_optimizer none
        on_device, offloaded, overlap, device_kind = frozenset(), False, False, OffloadDevice.NONE
    plan = engine_optimizer_plan(cfg, layout, on_device=on_device) if offloaded else None  # [Note: memory plan] in offload.plan.memory
    window = plan.window if plan is not None else zero.offload_optimizer.buffer_count
    grads_nvme = plan is not None and plan.grads_nvme  # [Note: gradient tier] in offload.zero.grad_tier
    tier, verdict, payload, commit = _open_tier(cfg, plan, ranks) if plan is not None else (None, FRESH, None, None)
    logger.info("rank %d: optimizer state in %s", ranks.rank,
                tier.placement if tier is not None else f"{ranks.device.type} memory (not offloaded)")
    try:
        if tier is not None and tier.daemon and on_device:
            raise ConfigError(WITH_DAEMON)
        if tier is not None and tier.daemon and device_kind == OffloadDevice.NVME:
            window = plan.reattached_window(tier.store)
        if tier is not None and ranks.device.type == "cuda":
            tier.register_with_cuda()  # [Note: one registration per segment] in offload.gpu.registration
        storage = StateStorage(layout, tier=tier.store if tier else None, nvme=device_kind == OffloadDevice.NVME,
                               device=ranks.device, window=window,
                               state_format=StateFormat(cfg.offload.state_dtype, cfg.offload.master_dtype),
                               grad_window=window if grads_nvme else None,
                               grad_dtype=torch.bfloat16 if cfg.data_types.grad_accum_dtype == "bf16" else torch.float32,
                               on_device=on_device)
        if verdict == FINISH:  # an overlapped step's early sub-groups ([Note: speculative step] in offload.checkpoint.resume)
            storage.keep_written(payload["step_record"][0].get("early", ()))
        if verdict in (RESUME, FINISH, ROLLBACK):
            storage.adopt()
            if "rollback" in payload:  # undone; a FINISH then finishes it whole ([Note: pending step] in offload.checkpoint.resume)
                roll_back(tier.store, storage, payload["rollback"])
                if verdict == FINISH and payload["step_record"][0]["multiplier"] is not None:
                    commit.begin_recorded_step(payload["step_record"][0])  # a kill while finishing finishes it
        else:
            storage.allocate(parts.fill_master if parts else lambda sg, master: _fill_master(layout, sg, master, masters))
            if parts is not None:
                parts.let_go()
        del masters
        opt = cfg.optimizer
        defaults = {"lr": opt.lr, "betas": opt.betas, "eps": opt.eps, "weight_decay": opt.weight_decay}
        engine_box: list[Engine] = []
        facade = OffloadOptimizer([dict(g) for g in groups], defaults, lambda: engine_box[0].apply_update(),
                                  lambda: engine_box[0].zero_grad())
        fetcher = _fetcher(ranks.device) if offloaded else None
        adam = PartitionedAdam(layout, storage, flat_params, optimizer=facade, adamw_mode=opt.adamw_mode,
                               bias_correction=opt.bias_correction, group=ranks.group, comm_world=ranks.world_size,
                               gather=shard, params_out=parts.shards.params_out if parts else None,
                               after_step=parts.coordinator.after_step if parts else None, fetcher=fetcher,
                               node=node)
        reducer = UnitGradReducer(layout, params, group=ranks.group, comm_world=ranks.world_size, land=adam.land,
                                  fetcher=fetcher, device_units=device_buckets(layout, on_device)) \
            if stage3 else GradReducer(layout, flat_grads, params, stage=zero.stage, group=ranks.group,
                                       comm_world=ranks.world_size, land=adam.land, fetcher=fetcher, node=node,
                                       device_buckets=device_buckets(layout, on_device))
        scheduler = _scheduler(lr_scheduler, cfg, facade)
        loader = _dataloader(training_data, cfg, ranks, collate_fn) if training_data is not None else None
        engine = Engine(module=model, config=cfg, ranks=ranks, layout=layout, flat_params=flat_params, reducer=reducer,
                        adam=adam, tier=tier, optimizer=facade, lr_scheduler=scheduler, scaler=_scaler(cfg),
                        compute_dtype=dtype, training_dataloader=loader, stage3=parts)
        if cfg.offload.delayed_update:
            from offload.zero.delayed import DelayedUpdate

            engine.delayed = DelayedUpdate(adam, warmup_steps=cfg.offload.delayed_update_warmup_steps)
        if overlap_runs(overlap, stage=zero.stage, grads_nvme=grads_nvme, daemon=tier is not None and tier.daemon):
            engine.overlap = OverlappedStep(adam, gradient_clipping=cfg.gradient_clipping)
            reducer.land_early = True  # [Note: landing early] in offload.zero.overlap
        if cfg.offload.step_under_forward:  # [Note: the step under the next forward] in offload.zero.step_tail
            attach_tail(engine.overlap, adam, model, params, recorded=tier is not None and tier.daemon)
        if tier is not None and tier.daemon:
            engine.commit = commit or CommitRegion(tier.store, existing=False)
            if engine.overlap is not None:
                engine.overlap.commit = engine.commit
            adam.undo = open_undo(tier.store, existing=verdict in (RESUME, FINISH, ROLLBACK) and undo_exists(tier.store),
                                  slots=undo_slots(), max_elems=max(sg.numel for sg in layout.sub_groups),
                                  block_bytes=None if storage.format.fp32 else max(
                                      storage.format.state_bytes(sg) for sg in layout.sub_groups))
            _stop_on_sigterm(engine)
        if verdict == FINISH:  # [Note: restartable step] in offload.checkpoint.resume
            engine.finish_step(*payload["step_record"])
        if verdict in (RESUME, FINISH, ROLLBACK):
            if parts is not None:
                parts.reload_from_masters(adam)
            else:
                adam.write_params_from_master()
            if verdict != FINISH:
                engine.restore_small_state(payload)
            else:
                engine.commit.commit(engine.global_steps, engine.small_state())
            engine.resumed_step = engine.global_steps
            logger.warning("rank %d resumed from the daemon at step %d in %.2f s (no checkpoint loaded%s; "
                           "offload.resume \"never\" or OFFLOAD_RESUME=never starts fresh instead)",
                           ranks.rank, engine.global_steps, time.perf_counter() - t0,
                           "; the step it was killed in finished from its committed inputs" if verdict == FINISH
                           else "; the overlapped step it was killed in under backward undone" if verdict == ROLLBACK
                           else "")
        engine.reporter = reporter_for(tier, skipped_steps=engine.skipped_steps,
                                       resumed=verdict in (RESUME, FINISH, ROLLBACK))
        if parts is not None:
            parts.coordinator.park()  # [Note: parked params] in offload.zero.params
    except BaseException:
        if tier is not None:
            tier.close()
        if parts is not None:
            parts.close()
        raise
    engine_box.append(engine)
    close_at_exit(engine)  # [Note: close at exit] in offload.engine
    return engine, facade, loader, scheduler


def _open_tier(cfg: EngineConfig, plan: OptimizerPlan, ranks: RankInfo):
    """The tier for the optimizer state, and what a daemon session already holds (offload.checkpoint.resume):
    (tier, verdict, committed state, commit region)."""
    def open_() -> Tier:
        return open_tier(plan.tier, daemon_socket=resolve_daemon_socket(cfg.offload), job_id=resolve_job_id(cfg.offload),
                         rank=ranks.local_rank, aio=cfg.aio, checksum=cfg.offload.checksum,
                         huge_pages=cfg.offload.huge_pages, reconnect_seconds=cfg.offload.daemon_reconnect_seconds)

    tier = open_()
    if not tier.daemon:
        return tier, FRESH, None, None
    job = resolve_job_id(cfg.offload)
    if getattr(tier.store, "reattached", False) and resolve_resume(cfg.offload) == "never":
        tier.close()  # the session a killed run left: dropped, as asked
        tier = open_()
        logger.warning("rank %d: the daemon held a session of job %r from a run that did not end normally; "
                       "dropped (offload.resume \"never\"): starting fresh", ranks.rank, job)
        return tier, FRESH, None, None
    if not getattr(tier.store, "reattached", False):
        logger.info("rank %d: starting fresh (the daemon holds no session of job %r)", ranks.rank, job)
    try:
        verdict, step, payload, commit = inspect_session(tier.store)
        pending = payload is not None and "pending" in payload
        verdict, said, multiplier = agree(verdict, step, ranks.group, ranks.world_size, pending=pending,
                                          multiplier=step_multiplier(verdict, payload))
        if pending and verdict == FINISH:  # its peers passed the all-reduce ([Note: pending step] in offload.checkpoint.resume)
            payload = dict(payload, step_record=(dict(payload["pending"], multiplier=multiplier), 0, False))
            if multiplier is not None and "rollback" not in payload:  # (an overlapped step's: once rolled back)
                commit.record_multiplier(multiplier)  # an ordinary record now: a kill while finishing finishes it
            logger.warning("rank %d: killed just after its step's all-reduce, one step behind its peers (%s): "
                           "finishing that step from its record", ranks.rank, said)
    except BaseException:
        tier.close(keep_session=True)
        raise
    if verdict == TORN:
        last = (payload or {}).get("last_checkpoint")
        tier.close()  # the torn state is dropped: the next start is a fresh one
        raise StateTornError(
            f"rank {ranks.rank}: the daemon's copy of the training state is torn ({said}): a trainer died inside "
            f"an optimizer step where it cannot be finished (inside a sub-group's Adam pass with no undo log, or in a "
            f"delayed step: [Note: restartable step] in offload.checkpoint.resume). It was discarded; restart and load the "
            f"last checkpoint ({last or 'none was saved by this job since it started'}).")
    if verdict == FRESH and getattr(tier.store, "reattached", False):
        tier.close()  # a session without a commit (a start that died early): begin again
        tier = open_()
        logger.warning("rank %d: the daemon's session for this job never committed a step (a start that died "
                       "early): starting fresh", ranks.rank)
    return tier, verdict, payload, commit


def _fetcher(device: torch.device):
    """The copy streams of a GPU model whose optimizer state is on the host (None on the CPU)."""
    if device.type != "cuda":
        return None
    from offload.gpu.select import startup_policy
    from offload.gpu.transfers import Fetcher

    return Fetcher(device, policy=startup_policy(device))  # [Note: batch threshold] in offload.gpu.select


def _stop_on_sigterm(engine: Engine) -> None:
    """SIGTERM (a scheduler preempting the job) finishes the step, commits and detaches (Engine.step)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def on_sigterm(signum, frame) -> None:
        logger.warning("rank %d: SIGTERM; stopping at the next step boundary", engine.global_rank)
        engine.stop_requested = True

    signal.signal(signal.SIGTERM, on_sigterm)


def _fill_master(layout: FlatLayout, sg, master: torch.Tensor, masters: list[torch.Tensor]) -> None:
    """Copy the fp32 values of the params a sub-group covers into its master block."""
    for piece in sg.pieces:
        for slot, param_off, piece_off, n in layout.param_runs(piece):
            at = piece.sub_start + piece_off
            master[at:at + n].copy_(masters[slot.index].view(-1)[param_off:param_off + n])
