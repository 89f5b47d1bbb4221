"""``engine.save_16bit_model``: the module's weights in the compute dtype, as one plain state dict file.

DeepSpeed's semantics: with stage 3 the parameters are partitioned, so they are gathered only when
``stage3_gather_16bit_weights_on_model_save`` is true; otherwise nothing is saved and the call
returns False (a checkpoint and ``offload consolidate`` give the fp32 weights instead). With stages
0-2 the module holds its weights and they are saved as they are. Rank 0 writes the file; every rank
calls it. Tied parameters stay tied in the file (one tensor under every name), as
``module.state_dict()`` has them.
"""
from __future__ import annotations

import contextlib
import logging
import os

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

__all__ = ["save_16bit_model"]


def _state(module: torch.nn.Module, exclude_frozen: bool) -> dict[str, torch.Tensor]:
    """A CPU copy of the state dict, one copy per distinct tensor (ties kept)."""
    copies: dict[int, torch.Tensor] = {}
    frozen = {id(p) for p in module.parameters() if not p.requires_grad} if exclude_frozen else set()
    out = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if id(value) in frozen:
            continue
        copy = copies.get(id(value))
        if copy is None:
            copy = copies[id(value)] = value.detach().to("cpu", copy=True)
        out[key] = copy
    return out


def save_16bit_model(engine, save_dir: str, save_filename: str = "pytorch_model.bin", *,
                     exclude_frozen_parameters: bool = False) -> bool:
    """Write ``save_dir/save_filename`` (torch.save of the state dict); True if it was written."""
    stage3 = getattr(engine, "stage3", None)
    if stage3 is not None and not engine.config.zero.stage3_gather_16bit_weights_on_model_save:
        logger.warning("save_16bit_model: not saved: stage 3 keeps the parameters partitioned; set "
                       "zero_optimization.stage3_gather_16bit_weights_on_model_save to gather them, or save a "
                       "checkpoint and run `offload consolidate` for the fp32 weights")
        return False
    with stage3.coordinator.gathered() if stage3 is not None else contextlib.nullcontext():
        state = _state(engine.module, exclude_frozen_parameters)
    path = os.path.join(save_dir, save_filename)
    if engine.global_rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        torch.save(state, path)
        logger.info("saved the %s weights to %s", engine.compute_dtype, path)
    if dist.is_initialized():
        dist.barrier()
    return True
