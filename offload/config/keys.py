"""Which DeepSpeed config keys exist, which this engine acts on, and which it only accepts.

Taken from DeepSpeed's own config code (v0.18-0.19): ``deepspeed/runtime/constants.py``
and ``config.py`` (top-level keys), ``zero/config.py`` and ``zero/offload_config.py``
(pydantic models with ``extra="forbid"``, field aliases accepted by name too),
``precision_config.py`` (fp16, bf16), ``swap_tensor/constants.py`` (aio),
``lr_schedules.py`` (scheduler params, passed to the schedule as keyword arguments)
and ``engine.py::_configure_basic_optimizer`` (Adam/AdamW params, passed to the
optimizer as keyword arguments). A key in none of these tables is an error.

Each section's table says, per JSON key:
- ``acted``: the dataclass field it fills (two keys may fill one field: an alias);
- ``ignored``: DeepSpeed has it, this engine does not act on it; logged once, value unread;
- ``unused``: acted-on keys whose value is checked and kept but not used yet; logged as ignored;
- ``special``: read by hand in ``offload.config`` (subsections, legacy forms, checks).
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Mapping

__all__ = ["KeyTable", "TABLES", "SCHEDULER_PARAMS", "STAGE3_FIELDS", "DEPRECATED"]


@dataclass(frozen=True)
class KeyTable:
    """The known keys of one config section."""

    acted: Mapping[str, str] = field(default_factory=dict)
    """JSON key -> the dataclass field it fills."""
    ignored: frozenset[str] = frozenset()
    """DeepSpeed keys accepted and logged as ignored."""
    special: frozenset[str] = frozenset()
    """Keys the reader handles itself."""
    unused: frozenset[str] = frozenset()
    """Acted-on keys whose value is kept in the dataclass but not used; logged as ignored."""
    auto: frozenset[str] = frozenset()
    """This project's keys for which "auto" is a value of their own, not HF Trainer's placeholder."""

    @property
    def known(self) -> frozenset[str]:
        return frozenset(self.acted) | self.ignored | self.special


def _same(*names: str) -> dict[str, str]:
    return {name: name for name in names}


TOP = KeyTable(
    acted=_same("gradient_clipping", "steps_per_print", "wall_clock_breakdown"),
    special=frozenset({
        "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
        "optimizer", "scheduler", "fp16", "bf16", "bfloat16", "zero_optimization", "aio",
        "offload",        # this project's own section
        "data_types",
        "checkpoint",
        "allgather_size",  # read only with the legacy "zero_optimization": true
    }),
    ignored=frozenset({
        # monitoring, profiling, logging
        "tensorboard", "wandb", "csv_monitor", "comet", "flops_profiler", "comms_logger",
        "memory_breakdown", "dump_state", "timers", "eigenvalue",
        # features this engine does not have
        "activation_checkpointing", "sparse_attention", "pipeline", "progressive_layer_drop",
        "curriculum_learning", "data_efficiency", "compression_training", "quantize_training",
        "weight_quantization", "hybrid_engine", "compile", "tensor_parallel", "elasticity",
        "autotuning", "amp", "torch_autocast", "nebula", "datastates_ckpt",
        "sequence_parallel_size", "use_data_before_expert_parallelism",
        "vocabulary_size", "dataloader_drop_last", "graph_harvesting",
        # gradient communication details
        "prescale_gradients", "gradient_predivide_factor", "communication_data_type",
        "seq_parallel_comm_data_type", "sparse_gradients", "disable_allgather",
        # optimizer guards that only matter to DeepSpeed's own optimizer choice
        "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
    }),
)

OPTIMIZER = KeyTable(special=frozenset({"type", "params"}), ignored=frozenset({"legacy_fusion"}))

OPTIMIZER_PARAMS = KeyTable(
    acted={**_same("lr", "betas", "eps", "weight_decay", "bias_correction"), "adam_w_mode": "adamw_mode"},
    special=frozenset({"amsgrad", "maximize", "max_grad_norm"}),
    ignored=frozenset({
        "torch_adam",             # DeepSpeed: use torch's Adam instead of its fused/CPU one
        "fused", "foreach", "capturable", "differentiable",  # torch Adam implementation choices
        "set_grad_none",          # FusedAdam
        "fp32_optimizer_states",  # DeepSpeedCPUAdam; our moments follow offload.state_dtype
    }),
)

SCHEDULER = KeyTable(special=frozenset({"type", "params"}))

_WARMUP = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration")
SCHEDULER_PARAMS: Mapping[str, KeyTable] = types.MappingProxyType({
    "WarmupLR": KeyTable(acted=_same(*_WARMUP)),
    "WarmupDecayLR": KeyTable(acted=_same(*_WARMUP, "total_num_steps")),
    "WarmupCosineLR": KeyTable(acted=_same("total_num_steps", "warmup_min_ratio", "warmup_num_steps",
                                           "cos_min_ratio", "warmup_type", "last_batch_iteration")),
})

FP16 = KeyTable(
    acted=_same("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                "consecutive_hysteresis", "min_loss_scale"),
    ignored=frozenset({"auto_cast", "fp16_master_weights_and_grads", "fused_mode"}),
)

BF16 = KeyTable(
    acted=_same("enabled"),
    ignored=frozenset({"immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
                       "bf16_optimizer_states"}),
)

# The stage-3 keys: DeepSpeed's aliases (stage3_*) and its field names, both accepted.
_STAGE3 = {
    "stage3_prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold": "stage3_param_persistence_threshold",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "stage3_max_live_parameters": "stage3_max_live_parameters",
    "max_live_parameters": "stage3_max_live_parameters",
    "stage3_max_reuse_distance": "stage3_max_reuse_distance",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
}
STAGE3_FIELDS = frozenset(_STAGE3.values())
"""ZeroConfig fields that only stage 3 uses: logged as ignored for stages 0-2."""

ZERO = KeyTable(
    acted={**_same("stage", "sub_group_size", "overlap_comm", "contiguous_gradients", "reduce_scatter",
                   "reduce_bucket_size", "allgather_partitions", "allgather_bucket_size",
                   "round_robin_gradients"), **_STAGE3},
    special=frozenset({"offload_optimizer", "offload_param",
                       "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory"}),
    ignored=frozenset({
        "use_multi_rank_bucket_allreduce", "load_from_fp32_weights", "elastic_checkpoint",
        "ignore_unused_parameters", "legacy_stage1", "zenflow", "leaf_module",
        "stage3_model_persistence_threshold", "model_persistence_threshold",
        "stage3_module_granularity_threshold", "module_granularity_threshold",
        "stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params",
        "stage3_allgather_sequential", "allgather_sequential",
        "stage3_partition_stream_chunk_size", "partition_stream_chunk_size",
        "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
        "zero_quantized_gradients", "zeropp_loco_param", "mics_shard_size",
        "mics_hierarchical_params_gather", "memory_efficient_linear", "pipeline_loading_checkpoint",
        "override_module_apply", "log_trace_cache_warnings", "enable_sanity_checks",
        "save_muon_momentum_buffer_in_memory",
    }),
)

OFFLOAD_OPTIMIZER = KeyTable(
    acted=_same("device", "nvme_path", "pin_memory", "buffer_count", "pipeline_read", "pipeline_write",
                "fast_init", "ratio"),
    auto=frozenset({"ratio"}),  # sized from the GPU memory left (offload.zero.device_share)
    ignored=frozenset({"super_offload", "cpuadam_cores_perc", "convert_grad_on_cpu"}),
)

OFFLOAD_PARAM = KeyTable(
    acted=_same("device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu"),
)

AIO = KeyTable(
    acted={**_same("block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events",
                   "use_gds"), "thread_count": "intra_op_parallelism"},
    unused=frozenset({"use_gds"}),
)

DATA_TYPES = KeyTable(acted=_same("grad_accum_dtype"))

OFFLOAD = KeyTable(
    acted=_same("daemon_socket", "daemon_reconnect_seconds", "job_id", "resume", "host_memory_bytes", "swap_capacity_bytes", "checksum",
                "delayed_update", "delayed_update_warmup_steps", "release_host_heap", "overlap_step",
                "step_under_forward", "state_dtype", "master_dtype", "gradient_tier", "node_shared_buffers", "huge_pages"),
    auto=frozenset({"overlap_step", "gradient_tier", "huge_pages", "resume"}),
)

CHECKPOINT = KeyTable(
    acted=_same("keep_last"),  # this project's: DeepSpeed has no retention setting
    ignored=frozenset({"tag_validation", "load_universal", "use_node_local_storage", "parallel_write", "writer"}),
)

DEPRECATED: Mapping[str, str] = types.MappingProxyType({
    "aio.thread_count": "aio.intra_op_parallelism",
    "bfloat16": "bf16",
    "zero_optimization.cpu_offload": "zero_optimization.offload_optimizer",
    "zero_optimization.cpu_offload_param": "zero_optimization.offload_param",
    "zero_optimization.cpu_offload_use_pin_memory": "offload_optimizer/offload_param.pin_memory",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save":
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
})
"""Older DeepSpeed spellings that still work: dotted key -> what replaced it (logged once)."""

TABLES: Mapping[str, KeyTable] = types.MappingProxyType({
    "": TOP,
    "optimizer": OPTIMIZER,
    "optimizer.params": OPTIMIZER_PARAMS,
    "scheduler": SCHEDULER,
    "fp16": FP16,
    "bf16": BF16,
    "zero_optimization": ZERO,
    "zero_optimization.offload_optimizer": OFFLOAD_OPTIMIZER,
    "zero_optimization.offload_param": OFFLOAD_PARAM,
    "aio": AIO,
    "offload": OFFLOAD,
    "checkpoint": CHECKPOINT,
})
"""Section dotted path ("" for the top level) -> its table; scheduler.params is per type."""
