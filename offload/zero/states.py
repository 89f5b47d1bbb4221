"""The optimizer state of this rank's partition, per sub-group, wherever it lives.

Each sub-group has two buffers:
- its state block, ``[master | exp_avg | exp_avg_sq]`` (3 x numel fp32, or the smaller layouts of
  ``offload.state_dtype`` bf16 / int8, see ``offload.zero.state_format``): the unit of NVMe I/O;
- its gradient accumulator (numel fp32, or bf16 with ``data_types.grad_accum_dtype``): resident,
  written as buckets land; or, with ``grad_window`` (stage 3's ``offload.gradient_tier`` nvme), on
  NVMe but for a window of them (``offload.zero.grad_tier``, [Note: gradient tier]).

With ``offload_optimizer`` none they are torch tensors on the model's device. With cpu or
nvme they are regions of the tier (the embedded ``TierStore`` or the daemon's
``TierClient``: the same verbs), seen through ``host_view`` with no copy. With nvme the
state blocks go back to NVMe after each step and are prefetched for the next one, at
most ``window`` of them in host memory at once (``offload.zero.window.HostWindow``).
With ``on_device`` (``offload_optimizer.ratio`` below 1) those sub-groups are device tensors, as with
none, while the others are the tier's ([Note: GPU-resident share] in offload.zero.device_share).
"""
from __future__ import annotations

import enum
import logging
from typing import Any, Callable, Iterable

import torch

from csrc import ConfigError
from offload.zero.grad_tier import GradTier
from offload.zero.layout import FlatLayout, SubGroup
from offload.zero.state_format import StateFormat
from offload.zero.window import HostWindow

logger = logging.getLogger(__name__)

__all__ = ["Placement", "StateStorage"]

F32 = 4  # bytes per element


class Placement(enum.Enum):
    """Where a sub-group's state block is, and who owns its memory."""

    DEVICE = "device"  # a torch tensor on the model's device, owned by this object (offload none)
    HOST = "host"  # a host region of the tier, resident for good (offload cpu)
    NVME = "nvme"  # on NVMe: the tier owns the extents; no host memory is held
    IN_FLIGHT = "in_flight"  # a prefetch or evict owns the host copy until it is waited for
    RESIDENT = "resident"  # prefetched and waited for: the host copy is ours to read and write


class StateStorage:
    """Sub-group state blocks and gradient accumulators over a tier (or device tensors)."""

    def __init__(self, layout: FlatLayout, *, tier: Any | None, nvme: bool, device: torch.device,
                 window: int, prefix: str = "", state_format: StateFormat | None = None,
                 grad_window: int | None = None, grad_dtype: torch.dtype = torch.float32,
                 on_device: frozenset[int] = frozenset()) -> None:
        """``grad_window``: the accumulators go to NVMe too, this many of them in host memory at most.
        ``grad_dtype``: the accumulators' (float32, or bfloat16 with an offloaded optimizer).
        ``on_device``: sub-groups whose state and (fp32) accumulator are tensors on ``device`` even so."""
        if nvme and tier is None:
            raise ConfigError("NVMe offload needs a tier")
        if grad_window is not None and tier is None:
            raise ConfigError("gradient accumulators on NVMe need the optimizer state offloaded (cpu or nvme)")
        if grad_dtype != torch.float32 and tier is None:
            raise ConfigError("bf16 gradient accumulators need the optimizer state offloaded (cpu or nvme)")
        if on_device and tier is not None and not (state_format or StateFormat()).fp32:
            raise ConfigError("a device-resident share of the optimizer state needs fp32 states and masters")
        if on_device and grad_window is not None:
            raise ConfigError("a device-resident share of the optimizer state keeps the accumulators off NVMe")
        self.grad_dtype = grad_dtype
        self.on_device = frozenset(on_device) if tier is not None else frozenset(range(len(layout.sub_groups)))
        """Sub-groups whose state is a tensor on ``device`` (all of them without a tier)."""
        self.layout = layout
        self.tier = tier
        self.nvme = nvme
        self.device = device
        self.window = max(2, window)
        self._prefix = prefix
        self.format = state_format or StateFormat()
        if tier is None and not self.format.fp32:
            raise ConfigError("offload.state_dtype bf16/int8 needs the optimizer state offloaded (cpu or nvme)")
        self._tensors: dict[str, torch.Tensor] = {}  # device tensors (none), or cached host views (cpu)
        self._placement = [Placement.DEVICE if sg.index in self.on_device else Placement.HOST for sg in layout.sub_groups]
        self._marked: set[int] = set()  # resident blocks marked dirty before they were written (will_write)
        self._window = HostWindow(tier, self._placement, Placement, size=self.window, name=self._state_name,
                                  label=lambda sg: f"sub-group {sg}", noun="blocks")
        # beside state blocks resident for good, every accumulator takes the largest one's page-rounded size
        # ([Note: accumulators alone on NVMe] in offload.plan.tier_plan)
        slot = None if nvme else -(-max(sg.numel for sg in layout.sub_groups) * grad_dtype.itemsize // 4096) * 4096
        self.grads_tier = None if grad_window is None else GradTier(tier, layout, window=grad_window,
                                                                    name=self._grad_name, kind=Placement,
                                                                    dtype=grad_dtype, region_bytes=slot)

    @property
    def io_wait_seconds(self) -> float:
        """Seconds spent waiting for prefetches and evicts since the start."""
        return self._window.io_wait_seconds + (self.grads_tier.io_wait_seconds if self.grads_tier else 0.0)

    # -- names and views ------------------------------------------------------------------

    def _state_name(self, sg: int) -> str:
        return f"{self._prefix}state.{sg}"

    def _grad_name(self, sg: int) -> str:
        return f"{self._prefix}grad.{sg}"

    def _view(self, name: str, numel: int, cache: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t = self._tensors.get(name)
        if t is None:
            t = torch.frombuffer(self.tier.host_view(name), dtype=dtype, count=numel)
            if cache:
                self._tensors[name] = t
        return t

    def allocate(self, fill_master: Callable[[SubGroup, torch.Tensor], None]) -> None:
        """Make every sub-group's buffers: master from ``fill_master``, moments zero, grads zero.
        With nvme each state block is written to NVMe as soon as it is filled."""
        for sg in self.layout.sub_groups:
            n = sg.numel
            if sg.index in self.on_device:
                self._tensors[self._state_name(sg.index)] = torch.zeros(3 * n, dtype=torch.float32, device=self.device)
                self._tensors[self._grad_name(sg.index)] = torch.zeros(n, dtype=torch.float32, device=self.device)
            else:
                if self.grads_tier is not None:
                    self.grads_tier.allocate(sg.index)
                else:
                    self.tier.allocate(self._grad_name(sg.index), n * self.grad_dtype.itemsize)
                    self._view(self._grad_name(sg.index), n, cache=True, dtype=self.grad_dtype).zero_()
                self._window.make_room()
                self.tier.allocate(self._state_name(sg.index), self.format.state_bytes(sg))
                self._placement[sg.index] = Placement.RESIDENT if self.nvme else Placement.HOST
                self.state(sg.index).zero_()
            fill_master(sg, self.format.master(sg, self.state(sg.index)))
            if self.nvme and sg.index not in self.on_device:
                self.release(sg.index, dirty=True)
        self.drain()

    def adopt(self) -> None:
        """Take over the regions a previous process of this session left in the tier (a resume):
        settle what was in flight, and with nvme write back what is still in host memory."""
        self.tier.flush()
        if self.on_device:
            raise ConfigError("a device-resident share of the optimizer state cannot be taken over from a tier")
        for sg in self.layout.sub_groups:  # the session's blocks must be of this run's state dtype
            held, want = self.tier.info(self._state_name(sg.index)).nbytes, self.format.state_bytes(sg)
            if held != want:
                raise ConfigError(f"the session's state block of sub-group {sg.index} is {held} bytes, this run's "
                                  f"{self.format.name} needs {want}: resume with the state and master dtypes "
                                  "it was started with")
        if self.nvme:
            names = [self._state_name(sg.index) for sg in self.layout.sub_groups]
            held = [n for n in names if self.tier.info(n).tier.value != "nvme"]
            if held:
                self.tier.wait_for_evict(self.tier.evict(held))
            self._placement[:] = [Placement.NVME for _ in self.layout.sub_groups]
        if self.grads_tier is not None:
            self.grads_tier.adopt()

    def keep_written(self, sgs: Iterable[int]) -> None:
        """Before ``adopt`` on a resume: blocks the killed process stepped but had not yet marked dirty (an
        overlapped step's early sub-groups, [Note: speculative step] in offload.checkpoint.resume) are marked now, so
        that their host copies are written back, not dropped for NVMe's."""
        sgs = list(sgs)
        if not self.nvme or not sgs:
            return
        self.tier.flush()
        for sg in sgs:
            name = self._state_name(sg)
            if self.tier.info(name).tier.value != "nvme":
                self.tier.mark_dirty(name)

    def grad(self, sg: int) -> torch.Tensor:
        """The fp32 gradient accumulator of a sub-group, resident (not with the gradient tier on NVMe)."""
        if self.grads_tier is not None:
            raise ConfigError("the gradient accumulators are on NVMe: use grad_for_landing / acquire_grad")
        name = self._grad_name(sg)
        t = self._tensors.get(name)
        return t if t is not None else self._view(name, self.layout.sub_groups[sg].numel, cache=True,
                                                  dtype=self.grad_dtype)

    # -- gradient accumulators, resident or on NVMe ([Note: gradient tier]) ------------------

    def grad_for_landing(self, sg: int, first: bool) -> torch.Tensor:
        """The accumulator a bucket's piece lands in (``first``: a cycle's first micro-step, overwriting it)."""
        return self.grad(sg) if self.grads_tier is None else self.grads_tier.for_landing(sg, first)

    def begin_landing(self) -> None:
        """Before a micro-step's backward (the gradient tier recounts what lands: ``GradTier.begin``)."""
        if self.grads_tier is not None:
            self.grads_tier.begin()

    def grad_landed(self, sg: int) -> None:
        """One piece of ``sg`` has landed (with the gradient tier, its last one this micro-step writes it back)."""
        if self.grads_tier is not None:
            self.grads_tier.landed(sg)

    def step_grads(self) -> list[torch.Tensor | None]:
        """The accumulators a step reads: the resident ones, or None each with the gradient tier on NVMe
        (the step acquires each beside its state block: ``acquire_grad``)."""
        if self.grads_tier is not None:
            return [None] * len(self.layout.sub_groups)
        return [self.grad(i) for i in range(len(self.layout.sub_groups))]

    def prefetch_grads(self, sgs: Iterable[int]) -> None:
        if self.grads_tier is not None:
            self.grads_tier.prefetch(sgs)

    def acquire_grad(self, sg: int) -> torch.Tensor:
        return self.grad(sg) if self.grads_tier is None else self.grads_tier.acquire(sg)

    def release_grad(self, sg: int) -> None:
        if self.grads_tier is not None:
            self.grads_tier.release(sg)

    def swap_grads(self, spare: list[torch.Tensor]) -> list[torch.Tensor]:
        """Land gradients in ``spare`` (one fp32 tensor per sub-group) from now on; returns the
        accumulators used until now (a delayed step reads them while the next ones land)."""
        if len(spare) != len(self.layout.sub_groups):
            raise ConfigError(f"swap_grads: {len(spare)} buffers for {len(self.layout.sub_groups)} sub-groups")
        old = [self.grad(i) for i in range(len(spare))]
        for i, t in enumerate(spare):
            if t.numel() != self.layout.sub_groups[i].numel or t.dtype != torch.float32:
                raise ConfigError(f"swap_grads: buffer {i} must be {self.layout.sub_groups[i].numel} fp32 elements")
            self._tensors[self._grad_name(i)] = t
        return old

    def state(self, sg: int) -> torch.Tensor:
        """The state block ``[master | exp_avg | exp_avg_sq]``; it must be resident (see ``acquire``)."""
        name = self._state_name(sg)
        where = self._placement[sg]
        if where == Placement.DEVICE:
            return self._tensors[name]
        group = self.layout.sub_groups[sg]
        if where == Placement.HOST:
            return self._view(name, self.format.block_numel(group), cache=True, dtype=self.format.block_dtype())
        if where != Placement.RESIDENT:
            raise ConfigError(f"sub-group {sg}'s state is {where.value}: acquire it first")
        return self._view(name, self.format.block_numel(group), cache=False, dtype=self.format.block_dtype())

    # -- the window (offload.zero.window) ------------------------------------------------

    def prefetch(self, sgs: Iterable[int]) -> None:
        """Start bringing state blocks to host memory, in order, while the window has room."""
        if self.nvme:
            self._window.prefetch(sgs)

    def acquire(self, sg: int) -> torch.Tensor:
        """The state block of ``sg``, waiting for (or starting) its prefetch."""
        if self.nvme and sg not in self.on_device:
            self._window.bring_in(sg)
        return self.state(sg)

    def prefetched(self, sg: int) -> bool:
        """Whether ``sg``'s block is in host memory or on its way there: ``acquire`` needs no room."""
        where = self._placement[sg]
        return where in (Placement.HOST, Placement.DEVICE, Placement.RESIDENT) or (
            where == Placement.IN_FLIGHT and sg not in self._window.evicting)

    def will_write(self, sg: int) -> None:
        """Before a resident block is written: mark it dirty now, so that whatever becomes of this process
        the daemon writes back the host copy (a restart finishes a pass from it: [Note: restartable step]
        in offload.checkpoint.resume), never drops it for the copy on NVMe."""
        if self.nvme and self._placement[sg] == Placement.RESIDENT and sg not in self._marked:
            self.tier.mark_dirty(self._state_name(sg))
            self._marked.add(sg)

    def release(self, sg: int, *, dirty: bool) -> None:
        """Done with a state block: with nvme, write it back if ``dirty`` and free its host copy (async)."""
        if not self.nvme or self._placement[sg] != Placement.RESIDENT:
            return
        if dirty and sg not in self._marked:
            self.tier.mark_dirty(self._state_name(sg))
        self._marked.discard(sg)
        self._window.evict(sg)

    def drain(self) -> None:
        """Wait for every evict in flight."""
        self._window.drain()
        if self.grads_tier is not None:
            self.grads_tier.drain()

    def cancel_prefetches(self) -> None:
        """Give back state blocks brought in for a step that will not run (an fp16 overflow)."""
        if self.grads_tier is not None:
            self.grads_tier.cancel()
        for sg, where in enumerate(self._placement):
            if where == Placement.IN_FLIGHT and sg not in self._window.evicting:
                self.acquire(sg)
            if self._placement[sg] == Placement.RESIDENT:
                self.release(sg, dirty=False)

    def poll(self) -> None:
        """Retire evicts that have finished, without waiting for any."""
        self._window.poll()

    def bytes_by_tier(self, *, poll: bool = True) -> dict[str, int]:
        """Bytes of state blocks per tier now (grads not counted); "in_flight" while a transfer has them.
        ``poll`` False: as last seen, without retiring evicts (while another thread steps)."""
        if poll:
            self.poll()
            if self.grads_tier is not None:
                self.grads_tier.poll()
        out = {"device": 0, "host": 0, "nvme": 0}
        for sg, where in zip(self.layout.sub_groups, self._placement):
            key = {Placement.DEVICE: "device", Placement.NVME: "nvme", Placement.IN_FLIGHT: "in_flight"}.get(where, "host")
            out[key] = out.get(key, 0) + self.format.state_bytes(sg)
        return out

    def close(self) -> None:
        """Free every region (the tier's memory and swap extents go back)."""
        if self.tier is None:
            self._tensors.clear()
            return
        self._window.settle("sub-group")
        if self.grads_tier is not None:
            self.grads_tier.settle()
        self._tensors.clear()
        for sg in self.layout.sub_groups:
            if sg.index in self.on_device:
                continue
            for name in (self._state_name(sg.index), self._grad_name(sg.index)):
                try:
                    self.tier.free(name)
                except ConfigError:
                    pass  # never allocated (a failed start)
