"""The checks across config sections: combinations of keys the engine cannot run, each a
``ConfigError`` that names the keys and what to set instead. ``EngineConfig`` runs them once its
sections are built (``offload.config.sections``)."""
from __future__ import annotations

from typing import Any

from csrc.errors import ConfigError

__all__ = ["check_combinations"]


def _offloaded(device: Any) -> bool:
    """An ``OffloadDevice`` other than none (by value: this module may not import the sections')."""
    return device.value != "none"


def check_combinations(config: Any) -> None:
    """Raise ``ConfigError`` for the first combination of ``config`` (an ``EngineConfig``) that cannot run."""
    if config.offload.delayed_update:  # [Note: delayed update] in offload.zero.delayed says why
        if not _offloaded(config.zero.offload_optimizer.device):
            raise ConfigError("offload.delayed_update needs zero_optimization.offload_optimizer.device "
                              "cpu or nvme (it overlaps the CPU's optimizer step with the next step)")
        if config.zero.stage == 3:
            raise ConfigError("offload.delayed_update is not supported with zero_optimization.stage 3 yet")
    if config.offload.state_dtype != "fp32" and not _offloaded(config.zero.offload_optimizer.device):
        raise ConfigError(f"offload.state_dtype {config.offload.state_dtype!r} needs zero_optimization."
                          "offload_optimizer.device cpu or nvme (the compressed moments are stepped by the CPU)")
    if config.offload.master_dtype == "bf16" and config.offload.state_dtype == "fp32":
        raise ConfigError("offload.master_dtype \"bf16\" needs offload.state_dtype \"bf16\" or \"int8\" (the bf16 "
                          "master is stepped with compressed moments; with fp32 moments it would save 2 of 16 "
                          "bytes a parameter): set offload.state_dtype too, or master_dtype \"fp32\"")
    if config.offload.overlap_step is True:  # [Note: overlapped step] in offload.zero.overlap says why
        _overlap_step_supported(config)
    if config.data_types.grad_accum_dtype == "bf16" and (
            not _offloaded(config.zero.offload_optimizer.device) or config.offload.delayed_update):
        raise ConfigError("data_types.grad_accum_dtype \"bf16\" needs zero_optimization.offload_optimizer.device "
                          "cpu or nvme, without offload.delayed_update (its accumulators are the CPU step's)")
    if config.offload.gradient_tier == "nvme" and (
            config.zero.stage != 3 or config.zero.offload_optimizer.device.value == "none"):
        raise ConfigError("offload.gradient_tier \"nvme\" needs zero_optimization.stage 3 with "
                          "offload_optimizer.device cpu or nvme (stages 0-2 keep one flat gradient buffer as large "
                          f"as the model; this config has stage {config.zero.stage}, offload_optimizer "
                          f"{config.zero.offload_optimizer.device.value}): set it \"host\" or \"auto\"")


def _overlap_step_supported(config: Any) -> None:
    """``offload.overlap_step: true`` in a combination it cannot run in: a ConfigError that says which."""
    if config.offload.delayed_update:
        raise ConfigError("offload.overlap_step and offload.delayed_update are exclusive (the delayed update "
                          "already overlaps the whole step): turn one of them off")
    if not _offloaded(config.zero.offload_optimizer.device):
        raise ConfigError("offload.overlap_step needs zero_optimization.offload_optimizer.device cpu or nvme "
                          "(it overlaps the CPU's optimizer step with backward)")
    if config.zero.stage == 3:
        raise ConfigError("offload.overlap_step is not supported with zero_optimization.stage 3 (the step "
                          "writes the param shards that backward's hooks gather from): set it false or \"auto\"")
