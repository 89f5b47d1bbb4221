"""Checkpoint names and the model's names, as transformers converts between them (Mixtral's experts).

[Note: converted names] A transformers 5 model may hold a tensor under another name or layout than its
checkpoints: Mixtral keeps each layer's experts fused (``mlp.experts.gate_up_proj`` of shape
``[experts, 2 * intermediate, hidden]``, ``mlp.experts.down_proj``) while its checkpoints, and its own
``save_pretrained``, have one tensor per expert and projection
(``block_sparse_moe.experts.N.w1.weight``, ``w3``, ``w2``). transformers describes this as a list of weight
transforms for the model (``conversion_mapping.get_model_conversion_mapping``): renamings, and
converters whose operations stack per-expert tensors (``MergeModulelist(dim=0)``) and concatenate the
stacks (``Concatenate(dim=1)``).

Loading: each checkpoint name is renamed with transformers' own ``rename_source_key``, and a converted
tensor is described as the checkpoint tensors whose flattened contents, one after another, are its
flattened contents (a ``Source``). That holds for the operations here (a stack along dim 0 lays the
tensors one after another; a concatenation along dim 1 of stacks lays, for each expert, its piece of
each source one after another), so each rank reads only its piece of each source tensor, as for a plain
tensor ([Note: streaming reads] in ``offload.hf.load``). Other operations (transposes, interleaves,
RoPE permutations) do not lay the sources end to end: a checkpoint that needs one is refused with the
names, not read whole.

Saving: each tensor goes through transformers' ``revert_weight_conversion`` alone, so the names and
layout written are the ones ``save_pretrained`` writes, one tensor at a time.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import sys
from typing import Any, Iterable

import torch

from csrc import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["Source", "checkpoint_sources", "model_for_names", "original_format"]


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one model tensor's values are in a checkpoint."""

    shape: tuple[int, ...]
    """The tensor's shape as the model has it."""
    pieces: tuple[tuple[str, int], ...]
    """(checkpoint name, element count): the tensor flattened is these tensors flattened, one after another."""

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(k for k, _ in self.pieces)


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _transformers_model(model: torch.nn.Module) -> bool:
    if sys.modules.get("transformers") is None:
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def _conversions(model: torch.nn.Module) -> list:
    from transformers.conversion_mapping import get_model_conversion_mapping

    return list(get_model_conversion_mapping(model))


def checkpoint_sources(model: torch.nn.Module, shapes: dict[str, tuple[int, ...]], model_keys: Iterable[str],
                       conversions: list | None = None) -> dict[str, Source]:
    """Model state-dict name -> its ``Source`` among the checkpoint's tensors (name -> shape). A name the
    checkpoint has verbatim is its own source; for a transformers model the rest go through its weight
    transforms (``conversions``: from_pretrained's, else the model's default ones)."""
    keys = set(model_keys)
    out = {k: Source(tuple(s), ((k, _numel(s)),)) for k, s in shapes.items() if k in keys}
    rest = [k for k in shapes if k not in keys]
    if not rest or not _transformers_model(model):
        return out
    from transformers.core_model_loading import (WeightConverter, WeightRenaming, apply_renamings, dot_natural_key,
                                                 rename_source_key)

    conv = _conversions(model) if conversions is None else list(conversions)
    renamings = [c for c in conv if isinstance(c, WeightRenaming)]
    converters = [c for c in conv if isinstance(c, WeightConverter)]
    present = dict.fromkeys(keys, True)  # transformers looks names up with .get() to add or strip a prefix
    fused: dict[str, tuple[Any, dict[str, list[str]]]] = {}
    for key in sorted(rest, key=dot_natural_key):  # expert 2 before expert 10, as transformers orders them
        target, pattern = rename_source_key(key, renamings, converters, getattr(model, "base_model_prefix", None),
                                            present)
        if target not in keys or target in out:
            continue
        if pattern is None:
            out[target] = Source(tuple(shapes[key]), ((key, _numel(shapes[key])),))
            continue
        renamed = apply_renamings(key, renamings)
        converter = next(c for c in converters if c.rename_source_key(renamed)[1] is not None)
        fused.setdefault(target, (converter, {}))[1].setdefault(pattern, []).append(key)
    for target, (converter, by_pattern) in fused.items():
        out[target] = _fused_source(target, converter, by_pattern, shapes)
    return out


def _fused_source(target: str, converter: Any, by_pattern: dict[str, list[str]],
                  shapes: dict[str, tuple[int, ...]]) -> Source:
    """The ``Source`` of a tensor a converter builds ([Note: converted names])."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    lists = [by_pattern[p] for p in converter.source_patterns if p in by_pattern]
    ops = [(type(op), getattr(op, "dim", None)) for op in converter.operations]
    first = tuple(shapes[lists[0][0]])
    if ops == [(MergeModulelist, 0)] and len(lists) == 1:
        order, shape = lists[0], (len(lists[0]),) + first
    elif ops == [(MergeModulelist, 0), (Concatenate, 1)] and len({len(l) for l in lists}) == 1:
        order = [l[e] for e in range(len(lists[0])) for l in lists]
        shape = (len(lists[0]), sum(shapes[l[0]][0] for l in lists)) + first[1:]
        if any(tuple(shapes[k])[1:] != first[1:] for k in order):
            raise ConfigError(f"{target}: the checkpoint tensors {', '.join(order[:4])} do not share their trailing "
                              "dimensions, so they cannot be concatenated into it")
    elif ops == [(Concatenate, 0)] and all(len(l) == 1 for l in lists):
        order = [l[0] for l in lists]
        shape = (sum(shapes[k][0] for k in order),) + first[1:]
    else:
        names = [k for l in lists for k in l]
        raise ConfigError(f"load_pretrained cannot read {target} piece by piece: transformers builds it from "
                          f"{', '.join(names[:4])}{' ...' if len(names) > 4 else ''} with "
                          f"{[type(op).__name__ for op in converter.operations]}, which do not lay the checkpoint "
                          "tensors end to end; load this checkpoint with from_pretrained outside init_context")
    if any(tuple(shapes[k]) != tuple(shapes[l[0]]) for l in lists for k in l):
        raise ConfigError(f"{target}: the checkpoint tensors it stacks ({', '.join(lists[0][:4])} ...) differ in shape")
    return Source(tuple(shape), tuple((k, _numel(shapes[k])) for k in order))


def model_for_names(config_json: str | None) -> torch.nn.Module | None:
    """The model a ``config.json`` text describes, built on the meta device (no memory), for
    ``original_format`` where only the checkpoint's config is at hand (``offload consolidate``); None without
    transformers or a config it builds."""
    if config_json is None:
        return None
    try:
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        return None
    try:
        fields = json.loads(config_json)
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        archs = getattr(config, "architectures", None) or []
        cls = getattr(transformers, archs[0], None) if archs else None
        with torch.device("meta"):
            return cls(config) if cls is not None else AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # the names stay the engine's; from_pretrained reads those too
        logger.warning("could not build the model of the saved config.json on the meta device (%s): the tensors "
                       "keep the model's own names", exc)
        return None


def original_format(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` as ``save_pretrained`` writes it: for a transformers model through its
    ``revert_weight_conversion`` (a fused expert tensor becomes one tensor per expert and projection);
    otherwise unchanged."""
    if not _transformers_model(model):
        return [(name, tensor)]
    from transformers.core_model_loading import revert_weight_conversion

    return list(revert_weight_conversion(model, {name: tensor}).items())
