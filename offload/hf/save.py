"""``engine.save_16bit_model``: the module's weights in the compute dtype.

With no file name (the default) it writes what ``from_pretrained`` loads: sharded safetensors with
their index and, for a Hugging Face model, its ``config.json`` and (one that generates) its
``generation_config.json`` (``offload.hf.safetensors_out``), under the
names ``save_pretrained`` writes (Mixtral's experts one tensor each: ``offload.hf.names``). It
streams: at stage 3 one unit is gathered at a time (every rank takes part; rank 0 writes), so no
process holds the whole model, and it saves whatever ``stage3_gather_16bit_weights_on_model_save``
says (the flag exists because DeepSpeed gathers the whole model for it).

With a file name (``"pytorch_model.bin"``) it is DeepSpeed's call, one plain state dict file.
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
from collections.abc import Iterator

import torch
import torch.distributed as dist

from offload.hf.names import original_format
from offload.hf.safetensors_out import (DEFAULT_MAX_SHARD_SIZE_BYTES, ShardedWriter, generation_config_json,
                                        model_config_json, write_config)

logger = logging.getLogger(__name__)

__all__ = ["consolidated_16bit_state_dict", "gathered_state", "save_16bit_model"]


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


def gathered_state(engine, exclude_frozen: bool) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """The module's state dict in order: (key, tensor, first), ``first`` False for a tied tensor met before. At
    stage 3 the tensor's unit is gathered while it is yielded, one unit at a time (every rank must iterate)."""
    module, stage3 = engine.module, getattr(engine, "stage3", None)
    unit_of: dict[int, int] = {}
    if stage3 is not None:
        by_name = {stage3.layout.slots[i].name: b.index for b in stage3.layout.buckets for i in b.slots}
        unit_of = {id(p): by_name[n] for n, p in module.named_parameters() if n in by_name}
    seen: set[int] = set()
    held, current = contextlib.ExitStack(), None
    with held, torch.no_grad():
        for key, value in module.state_dict(keep_vars=True).items():
            if exclude_frozen and isinstance(value, torch.nn.Parameter) and not value.requires_grad:
                continue
            unit = unit_of.get(id(value))
            if unit is not None and unit != current:  # one unit gathered at a time, in state dict order
                held.close()
                held.enter_context(stage3.coordinator.gathered_units([unit], free=True))
                current = unit
            yield key, value, id(value) not in seen
            seen.add(id(value))


def consolidated_16bit_state_dict(engine, exclude_frozen: bool = False) -> dict[str, torch.Tensor]:
    """CPU copies in the compute dtype, ties kept; at stage 3 rank 0 gets them and the others an empty dict."""
    keep = getattr(engine, "stage3", None) is None or engine.global_rank == 0
    copies: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for key, value, first in gathered_state(engine, exclude_frozen):
        if keep:
            if first:
                copies[id(value)] = value.detach().to("cpu", copy=True)
            out[key] = copies[id(value)]
    return out


def _save_safetensors(engine, save_dir: str, exclude_frozen: bool, max_shard_size_bytes: int) -> None:
    module = engine.module
    writer = ShardedWriter(save_dir, max_shard_size_bytes=max_shard_size_bytes) if engine.global_rank == 0 else None
    for key, value, first in gathered_state(engine, exclude_frozen):
        if first and writer is not None:
            for name, tensor in original_format(module, key, value):  # [Note: converted names]
                writer.add(name, tensor)
    if writer is not None:
        names = writer.close()
        write_config(save_dir, model_config_json(module), generation_config_json(module))
        logger.info("saved the %s weights to %s: %d safetensors file(s), %d bytes", engine.compute_dtype, save_dir,
                    len(names), writer.total_bytes)


def save_16bit_model(engine, save_dir: str, save_filename: str | None = None, *,
                     exclude_frozen_parameters: bool = False,
                     max_shard_size_bytes: int = DEFAULT_MAX_SHARD_SIZE_BYTES) -> bool:
    """Write ``save_dir`` as sharded safetensors (no ``save_filename``), or ``save_dir/save_filename``
    (torch.save of the state dict); True if it was written."""
    if save_filename is None:
        _save_safetensors(engine, save_dir, exclude_frozen_parameters, max_shard_size_bytes)
        if dist.is_initialized():
            dist.barrier()
        return True
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
