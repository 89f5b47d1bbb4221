"""A client optimizer handed to ``initialize(optimizer=...)``, read as the config's "optimizer" section.

DeepSpeed scripts that offload the optimizer often build it themselves
(``optimizer = DeepSpeedCPUAdam(model.parameters(), lr=...)``) and pass it to ``initialize``.
The engine runs its own partitioned Adam over the offloaded state, so what it takes from the
client is what that Adam needs: the kind (Adam or AdamW), the defaults and each param group's
params and hyperparameters. Accepted: ``cpu_adam.CPUAdam`` / ``CPUAdamW`` (the role of
DeepSpeedCPUAdam here) and ``torch.optim.Adam`` / ``AdamW``; anything else, AMSGrad or
maximize is an error that names it. The client's own state, if it has stepped, is not carried
over (a warning says so): the engine's optimizer, returned by ``initialize``, is the one to use.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from csrc import ConfigError
from cpu_adam import CPUAdam

logger = logging.getLogger(__name__)

__all__ = ["read_client_optimizer"]

_HYPERS = ("lr", "betas", "eps", "weight_decay")


def _decoupled(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """Whether the group decays weights as AdamW does."""
    if isinstance(optimizer, (CPUAdam, torch.optim.AdamW)):
        return bool(group.get("decoupled_weight_decay", True))
    return bool(group.get("decoupled_weight_decay", False))  # torch.optim.Adam: L2 unless asked


def read_client_optimizer(optimizer: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The DeepSpeed "optimizer" section equivalent to ``optimizer``, and its param groups (dicts
    with "params" and the group's lr, betas, eps and weight_decay)."""
    if not isinstance(optimizer, (CPUAdam, torch.optim.Adam, torch.optim.AdamW)):
        raise ConfigError(f"initialize(optimizer=...) got a {type(optimizer).__module__}.{type(optimizer).__name__}; "
                          "this engine runs Adam or AdamW: pass cpu_adam.CPUAdam/CPUAdamW or torch.optim.Adam/AdamW, "
                          "or name the optimizer in the config's \"optimizer\" section")
    groups = optimizer.param_groups
    for i, group in enumerate(groups):
        for key in ("amsgrad", "maximize"):
            if group.get(key):
                raise ConfigError(f"initialize(optimizer=...): param group {i} has {key}=True, which the CPU Adam "
                                  "does not run")
    modes = {(_decoupled(optimizer, g), bool(g.get("bias_correction", True))) for g in groups}
    if len(modes) != 1:
        raise ConfigError("initialize(optimizer=...): the param groups differ in weight decay mode or bias "
                          "correction; the engine runs one of each for all groups")
    adamw_mode, bias_correction = modes.pop()
    first = groups[0]
    section = {"type": "AdamW" if adamw_mode else "Adam",
               "params": {"lr": float(first["lr"]), "betas": [float(b) for b in first["betas"]],
                          "eps": float(first["eps"]), "weight_decay": float(first["weight_decay"]),
                          "adam_w_mode": adamw_mode, "bias_correction": bias_correction}}
    if optimizer.state:
        logger.warning("initialize(optimizer=...): the client optimizer has state for %d params; the engine "
                       "starts its own (load a checkpoint to resume)", len(optimizer.state))
    return section, [{"params": list(g["params"]), **{k: g[k] for k in _HYPERS}} for g in groups]
