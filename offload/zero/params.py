"""Stage 3: gather a unit's parameters before a module uses them, release them after.

[Note: unit buffers] Every unit ([Note: stage-3 units]) has one full buffer on the model's
device (the compute dtype, ``bucket.numel`` elements), made once; its parameters' ``.data``
are views of it for good. Releasing a unit resizes the buffer's storage to 0 bytes and
gathering resizes it back and all-gathers the shards into it (FSDP2 does the same). So
every tensor autograd saved that views a parameter (``weight.t()`` in a linear layer) sees
the gathered values again in backward, and nothing is held in between.

When: a module's forward pre-hook gathers the units its own parameters are in, its forward
hook releases them and registers a hook on its outputs' gradients that gathers them again
before the module's backward; a unit is released in backward once every one of its
parameters' gradients has been accumulated (or when backward ends). Persistent units stay
gathered. After an optimizer step the shards are new: every gathered unit is refreshed.

[Note: gather by alias] With one rank computing on the CPU and the shards in host memory for
good (offload_param cpu or none), a shard is the unit's full params, in the compute dtype and
the same layout: gathering points the parameters' ``.data`` at the shard instead of copying it
(DeepSpeed does the same with one rank), and releasing points them back at the empty unit
buffer. Tensors autograd saved from a gathered unit view the shard, whose memory stays; the
step writes the new params into the shards after backward, and ``after_step`` frees (un-points)
every unit as before. A gathered unit then holds no memory of its own (``peak_live_bytes``
counts none), and forward and backward skip two copies of the model per step.

[Note: frozen units in backward] A frozen unit ([Note: frozen units] in ``offload.zero.units``) is
gathered again before its module's backward, as any unit (the module needs its weights for its
inputs' gradients), but no gradient of its params ever comes to release it. So its module's
forward pre-hook also hooks the gradients of the module's inputs that require one: once they are
complete, the module's backward is past, and the unit is released (each forward with grad owes one
such release; backward's end releases what is left). Inputs that need no gradient (a frozen
embedding's output) leave the module nothing to compute in backward: its output needs no gradient
either, and the unit is not gathered again at all.

[Note: fetch order] Every step records the order units are fetched in (forward and
backward). The last step's order drives the next: when unit u is fetched at position i,
the shards of the units after i are prefetched from NVMe to host memory, up to
``prefetch_bucket_numel`` elements ahead. A released unit is kept gathered when it is
used again within ``max_reuse_distance_numel`` elements of other fetches; gathered
non-persistent units never exceed ``max_live_numel`` elements unless the units in use at
once alone do (kept units are dropped first). A step whose order differs replaces it.
On a GPU with the params offloaded and one rank, the units ahead are also copied into device
memory ahead of use, through the copy streams ([Note: unit fetches] in ``offload.zero.unit_fetch``).

[Note: parked params] A view of a released unit buffer has its shape but no memory, and most of
torch's ops read it without a check (``clone``, ``sum``, ``torch.save``): the process dies of a
segmentation fault. Inside forward and backward the engine's own reads are gathered and a stray
read fails with "storage of size 0" (``offload.zero.external``); outside them a script may read
anything (``model.state_dict()``, a weight's norm for its log). So when control goes back to the
caller (after ``initialize``, ``engine.backward``, ``engine.step``, a forward without grad, a
``gathered`` block), each parameter of a unit not gathered is parked: its ``.data`` is an empty
tensor (0 elements, as DeepSpeed leaves a ZeRO-3 param), and the first gather after puts every
parked one back on its view (``unpark``: in ``fetch``, so a direct call of the module works too).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import weakref
from typing import Any, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from offload.zero.collectives import all_gather_single
from offload.zero.layout import FlatLayout
from offload.zero.shards import ShardStore
from offload.zero.unit_fetch import UnitFetches
from offload.zero.units import UnitPlan

logger = logging.getLogger(__name__)

__all__ = ["FetchStats", "ParamCoordinator", "Stage3Config", "is_partitioned"]

_PARTITIONED: dict[int, weakref.ref] = {}
"""Every parameter a coordinator has taken over, by id (parked ones look like any empty tensor; a tensor's
``==`` is elementwise, so no WeakSet)."""


def is_partitioned(param: torch.Tensor) -> bool:
    """Whether ``param`` is a stage-3 parameter (its values in shards, gathered only around its use)."""
    ref = _PARTITIONED.get(id(param))
    return ref is not None and ref() is param


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stage3Config:
    """How far ahead to fetch and how much to keep (DeepSpeed's stage3_* keys)."""

    prefetch_bucket_numel: int = 50_000_000
    """Elements of shards prefetched ahead of use along the recorded order."""
    max_live_numel: int = 1_000_000_000
    """Elements of gathered non-persistent params at most (unless the units in use alone exceed it)."""
    max_reuse_distance_numel: int = 1_000_000_000
    """Keep a released unit gathered if it is fetched again within this many elements."""

    def __post_init__(self) -> None:
        for name in ("prefetch_bucket_numel", "max_live_numel", "max_reuse_distance_numel"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"Stage3Config.{name} must be an integer >= 0, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FetchStats:
    """What the parameter fetches did."""

    gathers: int
    """Units gathered (all-gathered, or copied from the shard with one rank)."""
    peak_live_bytes: int
    """The most bytes held by gathered unit buffers at once (their storages measured)."""
    peak_live_numel: int
    """The most elements of gathered non-persistent units at once."""
    fetch_wait_seconds: float
    """Time fetches waited on shard I/O."""
    prefetches: int
    """Shard prefetches started."""
    device_prefetches: int = 0
    """Units whose copy to the device was started ahead of use ([Note: unit fetches])."""


class ParamCoordinator:
    """Hooks on the model's modules and params; gathers and releases units (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, layout: FlatLayout, plan: UnitPlan, shards: ShardStore,
                 params: Sequence[torch.nn.Parameter], *, config: Stage3Config, group: dist.ProcessGroup | None,
                 world_size: int, fetcher: Any = None) -> None:
        """``fetcher`` (``offload.gpu.Fetcher``; offloaded params, one rank): units are copied to the device
        through it, ahead of use ([Note: unit fetches]); None: plain copies when a module needs them."""
        self.layout = layout
        self.plan = plan
        self.shards = shards
        self.config = config
        self.group = group
        self.world_size = world_size
        self._numel = [b.numel for b in layout.buckets]
        self._full = [torch.empty(b.numel, dtype=shards.dtype, device=shards.device) for b in layout.buckets]
        self._unit_of_param: list[int] = [0] * len(params)
        with torch.no_grad():
            for b in layout.buckets:
                for i in b.slots:
                    slot = layout.slots[i]
                    self._unit_of_param[i] = b.index
                    params[i].data = self._full[b.index][slot.offset - b.start:slot.offset - b.start + slot.numel] \
                        .view(slot.shape)
        for full in self._full:
            full.untyped_storage().resize_(0)
        self._params = list(params)
        for gone in [k for k, ref in _PARTITIONED.items() if ref() is None]:
            del _PARTITIONED[gone]
        _PARTITIONED.update((id(p), weakref.ref(p)) for p in self._params)
        self._empty = [p.data for p in self._params]  # the views of the unit buffers, for a release
        self._nothing = torch.empty(0, dtype=shards.dtype, device=shards.device)  # [Note: parked params]
        self._parked: set[int] = set()  # units whose params point at ``_nothing``
        # [Note: gather by alias] one rank computing on the CPU with the shards in host memory for good
        self._alias = world_size == 1 and fetcher is None and shards.device.type == "cpu" and not shards.nvme
        self._aliased = [False] * len(layout.buckets)
        self._fwd_refs = [0] * len(layout.buckets)
        self._bwd_pending = [0] * len(layout.buckets)  # params of a unit whose grads backward still owes
        self._kept: list[int] = []  # released but still gathered (reuse), oldest first
        self._order: list[int] = []  # the last step's fetch order ([Note: fetch order])
        self._trace: list[int] = []
        self._pos = 0
        self._backward_queued = False
        self.gathers = 0
        self.peak_live_bytes = 0
        self.peak_live_numel = 0
        self.fetch_wait_seconds = 0.0
        self.device_prefetches = 0
        self._device = None
        if fetcher is not None and world_size == 1 and shards.tier is not None:
            self._device = UnitFetches(fetcher, shards, self._full, max_pinned=shards.window - 1 if shards.nvme else None)
        self._handles = []
        for module, units in plan.module_units:
            frozen = tuple(u for u in units if plan.is_frozen(u))
            if frozen:  # [Note: frozen units in backward]
                self._handles.append(module.register_forward_pre_hook(self._pre_forward(units, frozen),
                                                                      with_kwargs=True))
            else:
                self._handles.append(module.register_forward_pre_hook(self._pre_forward(units)))
            self._handles.append(module.register_forward_hook(self._post_forward(units)))
        for i, p in enumerate(params):
            u = self._unit_of_param[i]
            if u not in plan.persistent and not plan.is_frozen(u):
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_done(u)))

    # -- gather and release ----------------------------------------------------------------

    def is_gathered(self, u: int) -> bool:
        return self._aliased[u] or self._full[u].untyped_storage().nbytes() > 0

    def _live_numel(self) -> int:
        return sum(self._numel[u] for u in range(len(self._full))
                   if u not in self.plan.persistent and self.is_gathered(u))

    def _gather(self, u: int) -> None:
        if self._parked:
            self.unpark()  # before an alias points a unit's params at its shard
        if self._device is None:
            self._copy_in(u)
        else:
            if not self._device.in_flight(u):
                waited = self._device.acquire_wait_seconds
                self._device.start([u])
                self.fetch_wait_seconds += self._device.acquire_wait_seconds - waited
            self._device.ready(u)
        self._count_gathered(1)

    def _count_gathered(self, units: int) -> None:
        self.gathers += units
        live = sum(f.untyped_storage().nbytes() for f in self._full)
        self.peak_live_bytes = max(self.peak_live_bytes, live)
        self.peak_live_numel = max(self.peak_live_numel, self._live_numel())

    def _copy_in(self, u: int) -> None:
        """The plain gather: the shard copied (one rank) or all-gathered into the unit's buffer; or, one
        rank on the CPU, the params pointed at the shard itself ([Note: gather by alias])."""
        if self._alias:
            shard = self.shards.acquire(u)  # held until the unit is freed (a host shard never moves)
            b = self.layout.buckets[u]
            for i in b.slots:
                slot = self.layout.slots[i]
                self._params[i].data = shard[slot.offset - b.start:slot.offset - b.start + slot.numel].view(slot.shape)
            self._aliased[u] = True
            return
        full = self._full[u]
        full.untyped_storage().resize_(full.numel() * full.element_size())
        t0 = time.perf_counter()
        shard = self.shards.acquire(u)
        self.fetch_wait_seconds += time.perf_counter() - t0
        try:
            with torch.no_grad():
                if self.world_size == 1:
                    full.copy_(shard)
                else:
                    all_gather_single(full, shard.to(full.device, copy=True), group=self.group)
        finally:
            self.shards.release(u, dirty=False)

    def _free(self, u: int) -> None:
        if self._device is not None:
            self._device.forget(u)
        if self._aliased[u]:
            for i in self.layout.buckets[u].slots:
                self._params[i].data = self._empty[i]
            self._aliased[u] = False
            self.shards.release(u, dirty=False)
        self._full[u].untyped_storage().resize_(0)

    def _in_use(self, u: int) -> bool:
        return self._fwd_refs[u] > 0 or self._bwd_pending[u] > 0

    def park(self) -> None:
        """Each parameter of a unit not gathered to an empty tensor, till the next gather ([Note: parked params])."""
        for u, b in enumerate(self.layout.buckets):
            if u not in self._parked and not self.is_gathered(u):
                for i in b.slots:
                    self._params[i].data = self._nothing
                self._parked.add(u)

    def unpark(self) -> None:
        """Every parked parameter back on its view of its unit buffer."""
        for u in self._parked:
            for i in self.layout.buckets[u].slots:
                self._params[i].data = self._empty[i]
        self._parked.clear()

    def fetch(self, u: int) -> None:
        """Make unit ``u`` gathered (recording the order, prefetching along the last one)."""
        if self._parked:
            self.unpark()
        self._trace.append(u)
        self._advance(u)
        if u in self._kept:
            self._kept.remove(u)
        if self.is_gathered(u):
            if self._device is not None:
                self._device.ready(u)  # started ahead: the compute stream waits for its copy
        else:
            while self._kept and self._live_numel() + self._numel[u] > self.config.max_live_numel:
                self._free(self._kept.pop(0))
            self._gather(u)
        if self._device is not None:
            self._prefetch_to_device()

    def _prefetch_to_device(self) -> None:
        """Start the copies of the units after the current position along the last order, within the
        prefetch budget and ``max_live_numel``, whose shards are in host memory ([Note: unit fetches])."""
        self._device.settle()
        room = self._device.room()
        budget = self.config.prefetch_bucket_numel
        live = self._live_numel()
        picked: list[int] = []
        for v in self._order[self._pos:]:
            if budget < self._numel[v] or (room is not None and len(picked) >= room):
                break
            budget -= self._numel[v]
            if v in self.plan.persistent or v in picked or self.is_gathered(v):
                continue
            if live + self._numel[v] > self.config.max_live_numel or not self.shards.ready(v):
                break
            picked.append(v)
            live += self._numel[v]
        if picked:
            self._device.start(picked)
            self.device_prefetches += len(picked)
            self._count_gathered(len(picked))

    def _advance(self, u: int) -> None:
        """Find ``u`` in the last order from the current position; prefetch the shards after it."""
        try:
            self._pos = self._order.index(u, self._pos) + 1
        except ValueError:
            return
        self._prefetch_ahead([] if self.is_gathered(u) else [u])  # u itself first: what is ahead never takes its room

    def _prefetch_ahead(self, ahead: list[int]) -> None:
        """Prefetch ``ahead``, then the shards after the current position, within the bucket budget."""
        budget = self.config.prefetch_bucket_numel
        for v in self._order[self._pos:]:
            if budget < self.layout.buckets[v].shard_numel:
                break
            budget -= self.layout.buckets[v].shard_numel
            if not self.is_gathered(v) and v not in ahead:
                ahead.append(v)
        self.shards.prefetch(ahead)

    def _reuse_distance(self, u: int) -> int | None:
        """Elements fetched before ``u`` is fetched again along the last order; None: not again."""
        distance = 0
        for v in self._order[self._pos:]:
            if v == u:
                return distance
            distance += self._numel[v]
        return None

    def release(self, u: int) -> None:
        """Done with ``u`` for now: keep it if it is reused soon and there is room, else free it."""
        if u in self.plan.persistent or self._in_use(u) or not self.is_gathered(u):
            return
        distance = self._reuse_distance(u)
        if distance is not None and distance <= self.config.max_reuse_distance_numel \
                and self._live_numel() <= self.config.max_live_numel:
            if u not in self._kept:
                self._kept.append(u)
            return
        self._free(u)

    # -- hooks -----------------------------------------------------------------------------

    def _pre_forward(self, units: tuple[int, ...], frozen: tuple[int, ...] = ()):
        if frozen:
            def hook_frozen(module, args, kwargs):
                for u in units:
                    self._fwd_refs[u] += 1
                    self.fetch(u)
                if torch.is_grad_enabled():
                    inputs = [t for t in tree_flatten((args, kwargs))[0]
                              if isinstance(t, torch.Tensor) and t.requires_grad]
                    if inputs:
                        torch.autograd.graph.register_multi_grad_hook(
                            inputs, lambda grads: self._frozen_backward_done(frozen), mode="all")
                return None
            return hook_frozen

        def hook(module, args):
            for u in units:
                self._fwd_refs[u] += 1
                self.fetch(u)
        return hook

    def _post_forward(self, units: tuple[int, ...]):
        def hook(module, args, output):
            for u in units:
                self._fwd_refs[u] -= 1
                self.release(u)
            if torch.is_grad_enabled():
                tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                if tensors:
                    torch.autograd.graph.register_multi_grad_hook(tensors, self._pre_backward(units), mode="any")
            return None
        return hook

    def _pre_backward(self, units: tuple[int, ...]):
        def hook(grad):
            if not self._backward_queued:
                self._backward_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
            for u in units:
                if self.plan.is_frozen(u):
                    self._bwd_pending[u] += 1  # one module backward more owes its inputs' gradients
                elif self._bwd_pending[u] == 0:
                    self._bwd_pending[u] = len(self.layout.buckets[u].slots)
                self.fetch(u)
        return hook

    def _frozen_backward_done(self, units: tuple[int, ...]) -> None:
        """A module's backward computed its inputs' gradients: its frozen units are done with."""
        for u in units:
            if self._bwd_pending[u] > 0:
                self._bwd_pending[u] -= 1
                if self._bwd_pending[u] == 0:
                    self.release(u)

    def _grad_done(self, u: int):
        def hook(param):
            if self._bwd_pending[u] > 0:
                self._bwd_pending[u] -= 1
                if self._bwd_pending[u] == 0:
                    self.release(u)
        return hook

    def _after_backward(self) -> None:
        self._backward_queued = False
        if self._device is not None:  # every copy done before the step writes the shards they read
            self._device.settle(block=True)
        for u in range(len(self._full)):
            if self._bwd_pending[u]:
                self._bwd_pending[u] = 0
                self.release(u)

    # -- around the optimizer step ------------------------------------------------------------

    def after_step(self) -> None:
        """The shards changed: write them back, drop every stale gathered unit, regather persistent
        ones, and make this step's fetch order the one the next step follows."""
        if self._device is not None:
            self._device.settle(block=True)
        self.shards.flush()
        for u in range(len(self._full)):
            if self.is_gathered(u):
                self._free(u)
        self._kept.clear()
        for u in sorted(self.plan.persistent):
            self._gather(u)
        if self._trace and self._trace != self._order:
            logger.info("stage 3: fetch order recorded (%d fetches)", len(self._trace))
            self._order = self._trace
        self._trace, self._pos = [], 0
        self._prefetch_ahead([])  # the next forward's first units, while the caller does what it does between steps
        if self._device is not None:
            self._prefetch_to_device()

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every parameter gathered for the block (to read the whole model: DeepSpeed's GatheredParameters)."""
        with self.gathered_units(range(len(self._full))):
            yield

    @contextlib.contextmanager
    def gathered_units(self, wanted, *, free: bool = False) -> Iterator[None]:
        """The units ``wanted`` gathered for the block (every rank calls it with the same units); ``free``:
        freed after it unless in use (not kept for reuse: a walk over the model, as a save)."""
        units = [u for u in wanted if u not in self.plan.persistent]
        self.unpark()
        for u in units:
            self._fwd_refs[u] += 1
            if not self.is_gathered(u):
                self._gather(u)
        try:
            yield
        finally:
            for u in units:
                self._fwd_refs[u] -= 1
                if free and u in self._kept:
                    self._kept.remove(u)
                if free and not self._in_use(u) and self.is_gathered(u):
                    self._free(u)
                else:
                    self.release(u)
            self.park()  # [Note: parked params]: safe at any time, every gather unparks first

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """Every partitioned parameter, in the layout's slot order (the trainable ones, then the frozen ones)."""
        return list(self._params)

    def units_of(self, params: Iterable[torch.Tensor]) -> list[int]:
        """The units the given parameters are in (others ignored), in unit order."""
        index = {id(p): i for i, p in enumerate(self._params)}
        return sorted({self._unit_of_param[index[id(p)]] for p in params if id(p) in index})

    def stats(self) -> FetchStats:
        return FetchStats(gathers=self.gathers, peak_live_bytes=self.peak_live_bytes,
                          peak_live_numel=self.peak_live_numel, fetch_wait_seconds=self.fetch_wait_seconds,
                          prefetches=self.shards.prefetches_started, device_prefetches=self.device_prefetches)

    def close(self) -> None:
        if self._device is not None:
            self._device.settle(block=True)
        for h in self._handles:
            h.remove()
        self._handles = []
        self.unpark()
        for u in range(len(self._full)):
            self._free(u)
        self.park()  # the model outlives the engine: its released params stay safe to read
