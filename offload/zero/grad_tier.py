"""Stage 3's gradient accumulators on NVMe: a window of them in host memory, the rest on disk.

[Note: gradient tier] A sub-group's accumulator (4 bytes per element of the partition, 2 with
``data_types.grad_accum_dtype`` bf16) is
written as backward lands its buckets and read once, by the sub-group's Adam pass. Resident
(``offload.gradient_tier`` "host") they are the largest part of a large model's host memory:
8.8 GiB of the 2.37B GPT's 12.45 GiB peak, and at 5B they alone exceed 16 GiB. With "nvme" they
are regions of the optimizer's tier like the state blocks, moved by the same ``HostWindow``:

- landing: a sub-group's accumulator is brought in when its first piece lands, without a read
  at a cycle's first micro-step (``tier.claim``: it is about to be overwritten), with one at
  later micro-steps (they add to it); once every piece of it has landed this micro-step it is
  marked dirty and evicted (written back while backward goes on). Backward lands the partition
  in reverse order, so only the accumulators of the buckets being landed are in host memory (the
  window holds at least the most sub-groups one bucket touches, plus one);
- the step: each sub-group's accumulator is prefetched beside its state block, read by the pass,
  and then dropped (clean: its evict writes nothing).

So the gradients cost their bytes per parameter written and read per step on NVMe (more at each
extra micro-step) and host memory for ``window`` of them. With the optimizer on cpu ("nvme" only, not
"auto") the state blocks stay in host memory and the accumulators alone go to NVMe, under
``offload_optimizer.nvme_path`` ([Note: accumulators alone on NVMe] in offload.plan.tier_plan). The clip norm is unchanged: it is
summed as the gradients land ([Note: landing] in offload.zero.optimizer). "auto" chooses NVMe
for stage 3 with the optimizer on NVMe when the accumulators alone exceed the host budget the
state window is sized from (``gradients_on_nvme``): through a daemon without
``offload.host_memory_bytes``, a rank's share of the daemon's pool (``offload.plan.daemon_pool``), not
this process's free memory; ``offload estimate`` says which applies.
"""
from __future__ import annotations

import enum
import logging
from typing import Any, Callable, Iterable

import torch

from csrc import ConfigError
from offload.zero.layout import FlatLayout
from offload.plan.budget import budget_bytes
from offload.zero.window import HostWindow

logger = logging.getLogger(__name__)

__all__ = ["GradTier", "gradients_on_nvme"]


def gradients_on_nvme(setting: str, *, stage: int, optimizer_nvme: bool, partition_numel: int,
                      host_memory_bytes: int | None, log: bool = True, grad_itemsize: int = 4,
                      budget: Callable[[], tuple[int | None, str]] | None = None) -> bool:
    """Whether ``offload.gradient_tier`` puts the accumulators on NVMe ([Note: gradient tier]).
    "nvme" in a config that cannot (not stage 3 with the optimizer offloaded) was refused when it was read;
    "auto" chooses NVMe only with the optimizer on NVMe.
    ``budget``: asked for (bytes or None, where from) in place of ``budget_bytes(host_memory_bytes)``, and only
    where "auto" has to judge (a daemon's pool: a STATUS round trip)."""
    if setting == "nvme":
        return True
    if setting != "auto" or stage != 3 or not optimizer_nvme:
        return False
    need = grad_itemsize * partition_numel
    budget, source = budget() if budget is not None else budget_bytes(host_memory_bytes)
    if budget is None:
        return False
    nvme = need > budget
    if log:
        logger.info("offload.gradient_tier auto: %s (accumulators %.2f GB %s the %.2f GB budget from %s)",
                    "nvme" if nvme else "host", need / 1e9, "exceed" if nvme else "fit in", budget / 1e9, source)
    return nvme


class GradTier:
    """The accumulators of every sub-group as tier regions ``grad.<sg>``, at most ``window`` in host memory."""

    def __init__(self, tier: Any, layout: FlatLayout, *, window: int, name, kind: type[enum.Enum],
                 dtype: torch.dtype = torch.float32, region_bytes: int | None = None) -> None:
        """``kind``: the state blocks' placement enum (``offload.zero.states.Placement``), whose HOST (before
        the first evict), NVME, IN_FLIGHT and RESIDENT an accumulator moves between. ``region_bytes``: every
        accumulator's region this large (None: its own size)."""
        self.tier = tier
        self._region_bytes = region_bytes
        self._kind = kind
        self.dtype = dtype
        self.layout = layout
        self._name = name
        self._place = [kind.HOST for _ in layout.sub_groups]
        self._left = [len(sg.pieces) for sg in layout.sub_groups]  # pieces still to land this micro-step
        self._window = HostWindow(tier, self._place, kind, size=max(2, window), name=name,
                                  label=lambda sg: f"sub-group {sg}'s gradients", noun="gradient blocks")

    @property
    def io_wait_seconds(self) -> float:
        return self._window.io_wait_seconds

    def _view(self, sg: int) -> torch.Tensor:
        if self._place[sg] != self._kind.RESIDENT:
            raise ConfigError(f"sub-group {sg}'s gradients are {self._place[sg].value}: bring them in first")
        return torch.frombuffer(self.tier.host_view(self._name(sg)), dtype=self.dtype,
                                count=self.layout.sub_groups[sg].numel)

    def allocate(self, sg: int) -> None:
        """A new accumulator, zeroed and sent to NVMe (so a read finds written, checksummed bytes)."""
        self._window.make_room()
        self.tier.allocate(self._name(sg), self._region_bytes or self.dtype.itemsize * self.layout.sub_groups[sg].numel)
        self._place[sg] = self._kind.RESIDENT
        self._view(sg).zero_()
        self._window.evict(sg)

    def adopt(self) -> None:
        """A resume: the accumulators the killed process left, wherever the daemon holds them, to NVMe."""
        names = [self._name(sg.index) for sg in self.layout.sub_groups]
        held = [n for n in names if self.tier.info(n).tier.value != "nvme"]
        if held:
            self.tier.wait_for_evict(self.tier.evict(held))
        self._place[:] = [self._kind.NVME for _ in self.layout.sub_groups]
        self._left = [len(sg.pieces) for sg in self.layout.sub_groups]

    def for_landing(self, sg: int, first: bool) -> torch.Tensor:
        """The accumulator a piece lands in: claimed without a read at a cycle's first micro-step."""
        self._window.bring_in(sg, read=not first)
        return self._view(sg)

    def begin(self) -> None:
        """Before a micro-step's landings: a sub-group a cut-off backward left part-landed is written back
        as it is and counted afresh, so no landing of this micro-step is taken for its last piece early
        (which would send it back, and the next piece would claim it as zeros)."""
        for sg in self.layout.sub_groups:
            if self._left[sg.index] != len(sg.pieces):
                self._left[sg.index] = len(sg.pieces)
                if self._place[sg.index] == self._kind.RESIDENT:
                    self.tier.mark_dirty(self._name(sg.index))
                    self._window.evict(sg.index)

    def landed(self, sg: int) -> None:
        """One piece of ``sg`` landed; after its last one this micro-step, write it back."""
        self._left[sg] -= 1
        if self._left[sg] == 0:
            self._left[sg] = len(self.layout.sub_groups[sg].pieces)
            self.tier.mark_dirty(self._name(sg))
            self._window.evict(sg)

    def prefetch(self, sgs: Iterable[int]) -> None:
        self._window.prefetch(sgs)

    def acquire(self, sg: int) -> torch.Tensor:
        """The accumulator for ``sg``'s Adam pass, waiting for (or starting) its prefetch."""
        self._window.bring_in(sg)
        return self._view(sg)

    def release(self, sg: int) -> None:
        """Done reading: its host copy goes (clean, nothing written)."""
        if self._place[sg] == self._kind.RESIDENT:
            self._window.evict(sg)

    def cancel(self) -> None:
        """Give back accumulators prefetched for a step that will not run (an fp16 overflow)."""
        for sg, where in enumerate(self._place):
            if where == self._kind.IN_FLIGHT and sg not in self._window.evicting:
                self.acquire(sg)
            self.release(sg)

    def drain(self) -> None:
        self._window.drain()

    def poll(self) -> None:
        self._window.poll()

    def settle(self) -> None:
        self._window.settle("gradients of sub-group")
