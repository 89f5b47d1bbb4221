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
    if config.offload.step_under_forward and (config.offload.overlap_step is False or config.zero.stage == 3
                                              or not _offloaded(config.zero.offload_optimizer.device)
                                              or config.offload.delayed_update):
        raise ConfigError("offload.step_under_forward needs the overlapped step (offload.overlap_step true or \"auto\", "
                          "zero_optimization.stage 0-2, offload_optimizer.device cpu or nvme, no offload.delayed_update): "
                          f"this config has overlap_step {config.offload.overlap_step!r}, stage {config.zero.stage}, "
                          f"offload_optimizer {config.zero.offload_optimizer.device.value}, delayed_update "
                          f"{config.offload.delayed_update}")
    if config.zero.offload_optimizer.ratio != 1.0:  # [Note: GPU-resident share] in offload.zero.device_share
        _ratio_supported(config)
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


def _ratio_supported(config: Any) -> None:
    """``offload_optimizer.ratio`` below 1 (or "auto") in a combination it cannot run in: a ConfigError that
    says which."""
    key = "zero_optimization.offload_optimizer.ratio"
    what = f"{key} {config.zero.offload_optimizer.ratio!r}"
    if not _offloaded(config.zero.offload_optimizer.device):
        raise ConfigError(f"{what} needs offload_optimizer.device cpu or nvme (with none the whole state is on the "
                          "device already): drop the key or offload the optimizer")
    if config.offload.gradient_tier == "nvme":
        raise ConfigError(f"{what} and offload.gradient_tier \"nvme\" are exclusive (the kept share's accumulators "
                          "are on the device, the rest stay in host memory): set gradient_tier \"auto\" or \"host\"")
    if config.offload.delayed_update:
        raise ConfigError(f"{what} and offload.delayed_update are exclusive (the delayed update steps the whole "
                          "state beside the next forward): turn one of them off")
    if config.offload.state_dtype != "fp32" or config.offload.master_dtype != "fp32":
        raise ConfigError(f"{what} needs offload.state_dtype and offload.master_dtype \"fp32\" (the device's share "
                          "is stepped by torch's fused AdamW, in fp32)")
    if config.offload.daemon_socket:
        raise ConfigError(f"{what} is not supported with a node daemon (offload.daemon_socket): the device's share "
                          "of the state would not outlive this process, and a restart could not resume it")
