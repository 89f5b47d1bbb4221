"""Stage 3's units: which parameters are gathered together, and which modules need which units.

[Note: stage-3 units] A unit is a set of parameters that is all-gathered, used and released
as one; it is one bucket of the layout ([Note: flat layout] with a ``bucket_plan``), so its
gradients are also reduce-scattered as one and its shards are consecutive in the rank's
partition. Units are cut per module, in registration order (the order forward usually runs
in): the trainable parameters a module owns directly (``recurse=False``) and that are not
persistent form one unit per param group. Parameters with fewer than
``stage3_param_persistence_threshold`` elements are persistent (DeepSpeed's rule): they go
into one unit per param group that stays gathered for good, so small biases and norms cost
no collective per use. A tied parameter belongs to the first module that owns it; every
module that owns it needs that unit (``UnitPlan.module_units``), and so does every module that
registered it as external ([Note: external parameters]).

[Note: frozen units] Parameters that are not trained (``requires_grad=False``: a LoRA model's
base weights) are partitioned and offloaded as the trainable ones are, in units of their own
(one extra param group, so no unit mixes the two), placed after every trainable unit. The
layout over all units then begins with exactly the layout over the trainable units (the same
buckets, offsets and shards), and the optimizer and the gradients use that prefix
(``Stage3Parts.optimizer_layout``): the optimizer state covers the trainable params only; a
checkpoint writes the frozen params from their shards (``offload.checkpoint.dcp``). A frozen unit
gets no gradient, so backward releases it when the module's backward has computed its inputs'
gradients, not when its params' gradients are accumulated ([Note: frozen units in backward]).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import torch

from offload.zero.external import external_parameters

logger = logging.getLogger(__name__)

__all__ = ["UnitPlan", "plan_units"]


@dataclasses.dataclass(frozen=True)
class UnitPlan:
    """The buckets of a stage-3 layout and how modules map onto them."""

    buckets: tuple[tuple[int, ...], ...]
    """Param indexes (into the trainable params in group order, then the frozen ones) per unit, in unit order."""
    persistent: frozenset[int]
    """Units that stay gathered."""
    module_units: tuple[tuple[torch.nn.Module, tuple[int, ...]], ...]
    """(module, units its own params are in) for every module that owns partitioned params."""
    trainable_units: int = -1
    """Units ``0 .. trainable_units - 1`` hold the trainable params, the rest the frozen ones ([Note: frozen
    units]); -1: all of them."""

    def __post_init__(self) -> None:
        if self.trainable_units < 0:
            object.__setattr__(self, "trainable_units", len(self.buckets))

    def is_frozen(self, u: int) -> bool:
        return u >= self.trainable_units


def plan_units(model: torch.nn.Module, groups: Sequence[Sequence[torch.nn.Parameter]], *,
               persistence_threshold: int, frozen: Sequence[torch.nn.Parameter] = ()) -> UnitPlan:
    """Cut the trainable params of ``groups`` (lists of params, the optimizer's param groups) into units, and
    the ``frozen`` params (not trained) into units of their own after them ([Note: frozen units])."""
    index_of: dict[int, int] = {}
    group_of: dict[int, int] = {}
    frozen_group = len(groups)
    for gi, params in enumerate([*groups, frozen]):
        for p in params:
            group_of[id(p)] = gi
            index_of[id(p)] = len(index_of)
    group_of_index = {index_of[k]: g for k, g in group_of.items()}
    buckets: list[tuple[int, ...]] = []
    unit_of: dict[int, int] = {}
    persistent_members: dict[int, list[int]] = {}
    owners: list[tuple[torch.nn.Module, list[torch.nn.Parameter]]] = []
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if id(p) in index_of]
        if not own:
            continue
        owners.append((module, own))
        fresh: dict[int, list[int]] = {}
        for p in own:
            i = index_of[id(p)]
            if i in unit_of or any(i in m for m in persistent_members.values()) \
                    or any(i in m for m in fresh.values()):
                continue  # tied: it belongs to the first module that owns it
            target = persistent_members if p.numel() < persistence_threshold else fresh
            target.setdefault(group_of[id(p)], []).append(index_of[id(p)])
        for members in fresh.values():
            for i in members:
                unit_of[i] = len(buckets)
            buckets.append(tuple(members))
    placed = set(unit_of) | {i for m in persistent_members.values() for i in m}
    stray = [i for i in range(len(index_of)) if i not in placed]
    if stray:  # a param group holding tensors no module owns directly cannot happen; keep the plan whole anyway
        logger.warning("stage 3: %d params owned by no module: made persistent", len(stray))
        for i in stray:
            persistent_members.setdefault(group_of_index[i], []).append(i)
    persistent = set()
    for members in persistent_members.values():
        for i in members:
            unit_of[i] = len(buckets)
        persistent.add(len(buckets))
        buckets.append(tuple(members))
    cold = {u for u, members in enumerate(buckets) if group_of_index[members[0]] == frozen_group}
    if cold:  # the frozen units after the trainable ones, each side in its order
        order = [u for u in range(len(buckets)) if u not in cold] + sorted(cold)
        new = {old: k for k, old in enumerate(order)}
        buckets = [buckets[old] for old in order]
        unit_of = {i: new[u] for i, u in unit_of.items()}
        persistent = {new[u] for u in persistent}
    readers = {id(m): m for m, _ in owners}
    for module in model.modules():  # [Note: external parameters]
        if id(module) not in readers and external_parameters(module):
            readers[id(module)] = module
            owners.append((module, []))
    module_units = tuple((m, tuple(sorted({unit_of[index_of[id(p)]]
                                           for p in [*own, *external_parameters(m)] if id(p) in index_of}
                                          - persistent)))
                         for m, own in owners)
    return UnitPlan(tuple(buckets), frozenset(persistent), tuple(x for x in module_units if x[1]),
                    trainable_units=len(buckets) - len(cold))
