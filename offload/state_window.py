"""How many sub-groups' state blocks (and, with the gradient tier on NVMe, their accumulators) the
optimizer's tier holds in host memory at once, and the tier plan that follows from it.

Embedded, the window is what the host budget holds (``offload.zero.window.window_size``); through a
daemon without ``offload.host_memory_bytes``, what its pool gives (``offload.daemon_window``); never
fewer than ``buffer_count``. With ``offload.gradient_tier`` on NVMe a place in the window is a state
block and its accumulator together, and never fewer than the sub-groups one bucket lands into, plus
one ([Note: gradient tier] in offload.zero.grad_tier).
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from offload.config import EngineConfig, OffloadDevice, resolve_daemon_socket
from offload.tiers import TierPlan, plan_bytes
from offload.zero.grad_tier import gradients_on_nvme
from offload.zero.layout import FlatLayout
from offload.zero.state_format import StateFormat
from offload.zero.window import window_size

__all__ = ["grad_dtype", "grads_to_nvme", "reattached_state_window", "state_window", "tier_plan"]


def _state_bytes(cfg: EngineConfig, layout: FlatLayout) -> list[int]:
    """Each sub-group's state block in bytes, at ``offload.state_dtype`` and ``offload.master_dtype``."""
    fmt = StateFormat(cfg.offload.state_dtype, cfg.offload.master_dtype)
    return [fmt.state_bytes(sg) for sg in layout.sub_groups]


def grad_dtype(cfg: EngineConfig) -> torch.dtype:
    """The gradient accumulators' dtype (``data_types.grad_accum_dtype``)."""
    return torch.bfloat16 if cfg.data_types.grad_accum_dtype == "bf16" else torch.float32


def tier_plan(cfg: EngineConfig, layout: FlatLayout, *, window: int, grads_nvme: bool) -> TierPlan:
    nvme = cfg.zero.offload_optimizer.device == OffloadDevice.NVME
    return plan_bytes([sg.numel for sg in layout.sub_groups], window=window, nvme=nvme,
                      nvme_path=cfg.zero.offload_optimizer.nvme_path if nvme else None,
                      state_bytes=_state_bytes(cfg, layout), grads_nvme=grads_nvme, grad_itemsize=grad_dtype(cfg).itemsize)


def grads_to_nvme(cfg: EngineConfig, layout: FlatLayout, *, log: bool = True) -> bool:
    """``offload.gradient_tier`` resolved for this layout (stage 3's partition); "auto" against the budget
    the window is sized from: the daemon's pool through a daemon without ``offload.host_memory_bytes``."""
    nvme = cfg.zero.offload_optimizer.device == OffloadDevice.NVME
    socket = resolve_daemon_socket(cfg.offload)
    budget = None
    if socket and cfg.offload.host_memory_bytes is None:
        from offload.daemon_window import daemon_budget_bytes

        budget = functools.partial(daemon_budget_bytes, socket)
    return gradients_on_nvme(cfg.offload.gradient_tier, stage=cfg.zero.stage, optimizer_nvme=nvme,
                             partition_numel=sum(sg.numel for sg in layout.sub_groups),
                             host_memory_bytes=cfg.offload.host_memory_bytes, log=log,
                             grad_itemsize=grad_dtype(cfg).itemsize, budget=budget)


def _floor(cfg: EngineConfig, layout: FlatLayout, grads_nvme: bool) -> int:
    floor = cfg.zero.offload_optimizer.buffer_count
    if grads_nvme:  # a bucket's pieces land in one pass, so all its sub-groups' accumulators are in at once
        spans: dict[int, set[int]] = {}
        for sg in layout.sub_groups:
            for piece in sg.pieces:
                spans.setdefault(piece.bucket, set()).add(sg.index)
        floor = max(floor, 1 + max((len(s) for s in spans.values()), default=1))
    return floor


def state_window(cfg: EngineConfig, layout: FlatLayout, *, grads_nvme: bool) -> int:
    """Places in the window with the optimizer state on nvme (see the module docstring)."""
    floor = _floor(cfg, layout, grads_nvme)
    plan = tier_plan(cfg, layout, window=0, grads_nvme=grads_nvme)
    socket = resolve_daemon_socket(cfg.offload)
    if socket and cfg.offload.host_memory_bytes is None:
        from offload.daemon_window import daemon_state_window, session_terms

        return daemon_state_window(socket, plan.state_bytes, floor=floor, **session_terms(plan))
    return window_size(plan.state_bytes, floor=floor, fixed_bytes=plan.resident_bytes,
                       host_memory_bytes=cfg.offload.host_memory_bytes, what="optimizer state")


def reattached_state_window(cfg: EngineConfig, layout: FlatLayout, tier: Any, window: int, *,
                            grads_nvme: bool) -> int:
    """The window of a session reattached in the daemon: what its quota holds now."""
    from offload.daemon_window import reattached_window, session_terms

    plan = tier_plan(cfg, layout, window=0, grads_nvme=grads_nvme)
    return reattached_window(tier.store, plan.state_bytes, window, floor=_floor(cfg, layout, grads_nvme),
                             **session_terms(plan))
