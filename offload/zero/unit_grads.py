"""Stage 3's gradients: one buffer per unit while backward passes it, never one for the whole model.

[Note: unit gradients] Stages 0-2 keep a flat gradient buffer as large as the model
(``offload.zero.grads``). Stage 3 cannot: the model may be larger than memory. Here a unit's
gradient buffer (the compute dtype, ``bucket.numel`` elements, zeros in the padding) is made
when the first of its parameters' gradients is accumulated; each gradient is copied into its
slot and the parameter's ``.grad`` dropped at once. When the last one has come, the buffer is
reduce-scattered (or, with one rank, landed as it is) into the optimizer's fp32 accumulators
and freed. So backward holds the buffers of the units it is in, plus at most
``max_in_flight`` being reduced. Units no gradient reached (unused parameters) land zeros at
the end, so every rank runs the same collectives and the accumulators hold no stale values.

Stage 3 reduces every micro-step (as stage 2): the accumulators sum micro-steps (``first``).

[Note: gradients landed from the params] With one rank and the model on the CPU there is nothing
to reduce: a unit's gradients are kept as autograd gave them (``.grad`` dropped at once all the
same) and, when the unit's last one has come, landed from those tensors straight into the
accumulators (zeros read for the padding and unreached params), with no unit buffer and no copy
into it; they are freed as the unit lands. ``peak_buffer_bytes`` stays 0.

[Note: unit buffers reused] A host unit's buffer, once landed (or reduced), is kept as the spare
for the next unit of the same size in this backward (a GPT's blocks are all one size) instead of
a fresh ``torch.zeros``: that memset and allocation cost as much as the gradients' own copies.
A reused buffer gets zeros only where the new unit's slots do not cover it (the padding, computed
once per unit) and, at launch, in the slots of parameters whose gradient never came; every other
element is overwritten by a gradient's copy. So it lands exactly what a zeroed buffer would. The
spares go at the end of backward (memory between steps as before); device buffers are never
reused (the D2H copy may still read one).

On a GPU with the optimizer state on the host (``fetcher`` given), a unit's reduced gradient goes
to a pinned host buffer on the Fetcher's D2H stream while backward goes on, and lands from there
once the copy is in, oldest first (the same order, so the same sums). At most ``max_in_flight``
copies are outstanding and their host buffers are reused, so the pinned memory is that many of
the largest unit, not the model.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from offload.zero.collectives import reduce_scatter_single
from offload.zero.layout import Bucket, FlatLayout

logger = logging.getLogger(__name__)

__all__ = ["UnitGradReducer"]

Land = Callable[[Bucket, torch.Tensor, bool, bool], None]


class UnitGradReducer:
    """Per-unit gradient buffers, reduced as each unit's backward completes (the engine's reducer for stage 3)."""

    def __init__(self, layout: FlatLayout, params: Sequence[torch.nn.Parameter], *, group: dist.ProcessGroup | None,
                 comm_world: int, land: Land, max_in_flight: int = 2, fetcher: Any = None,
                 device_units: frozenset[int] = frozenset()) -> None:
        """``device_units``: units whose shard lands in device-resident accumulators only, from the device, never
        copied to the host ([Note: GPU-resident share] in offload.zero.device_share)."""
        self.layout = layout
        self._device_units = device_units
        self.params = list(params)
        self.group = group
        self.comm_world = comm_world
        self.max_in_flight = max(1, max_in_flight)
        self._land = land
        self._unit_of = [0] * len(self.params)
        for b in layout.buckets:
            for i in b.slots:
                self._unit_of[i] = b.index
        self._bufs: dict[int, torch.Tensor] = {}
        self._pending: list[int] = []
        self._launched: list[bool] = []
        self._inflight: list[tuple[Bucket, torch.Tensor, torch.Tensor, object]] = []
        self._fetcher = fetcher
        self._offloading: list[tuple[Bucket, torch.Tensor, Any]] = []  # (unit, host buffer, pending copy)
        self._spare_hosts: list[torch.Tensor] = []  # pinned buffers whose copies have landed
        self._spares: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # [Note: unit buffers reused]
        self._reused: set[int] = set()  # units whose buffer was a spare: unreached slots need zeros
        self._gaps: dict[int, list[tuple[int, int]]] = {}  # unit -> ranges no slot covers
        self._got: list[set[int]] = []  # per unit, the slots whose gradient came this micro-step
        # [Note: gradients landed from the params] one rank, the model on the CPU: no unit buffer
        self._direct = comm_world == 1 and fetcher is None and all(p.device.type == "cpu" for p in self.params)
        self._held: dict[int, dict[int, torch.Tensor]] = {}  # unit -> slot -> the gradient autograd gave
        self._zeros: torch.Tensor | None = None  # read for the padding and unreached params
        self._active = False
        self._first = True
        self._final = True
        self.peak_buffer_bytes = 0
        """The most bytes the unit gradient buffers (and reduce outputs) held at once."""
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self.params)]

    def _unit_gaps(self, u: int) -> list[tuple[int, int]]:
        gaps = self._gaps.get(u)
        if gaps is None:
            b = self.layout.buckets[u]
            gaps, at = [], 0
            for i in sorted(b.slots, key=lambda i: self.layout.slots[i].offset):
                lo = self.layout.slots[i].offset - b.start
                if lo > at:
                    gaps.append((at, lo))
                at = max(at, lo + self.layout.slots[i].numel)
            if at < b.numel:
                gaps.append((at, b.numel))
            self._gaps[u] = gaps
        return gaps

    def _buffer(self, u: int) -> torch.Tensor:
        buf = self._bufs.get(u)
        if buf is None:
            p = self.params[self.layout.buckets[u].slots[0]]
            numel = self.layout.buckets[u].numel
            spare = self._spares.pop((numel, p.dtype), None) if p.device.type == "cpu" else None
            if spare is not None:
                for lo, hi in self._unit_gaps(u):
                    spare[lo:hi].zero_()
                self._reused.add(u)
                buf = self._bufs[u] = spare
            else:
                buf = self._bufs[u] = torch.zeros(numel, dtype=p.dtype, device=p.device)
            held = sum(t.numel() * t.element_size() for t in self._bufs.values())
            held += sum(full.numel() * full.element_size() + out.numel() * out.element_size()
                        for _, out, full, _ in self._inflight)
            self.peak_buffer_bytes = max(self.peak_buffer_bytes, held)
        return buf

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        slot = self.layout.slots[index]

        def on_grad(param: torch.Tensor) -> None:
            if not self._active or param.grad is None:
                return  # a backward outside engine.backward: the grad stays on the param
            u = self._unit_of[index]
            if self._direct:
                self._held.setdefault(u, {})[index] = param.grad.contiguous().view(-1)
            else:
                start = slot.offset - self.layout.buckets[u].start
                self._buffer(u)[start:start + slot.numel].view(slot.shape).copy_(param.grad)
            self._got[u].add(index)
            param.grad = None
            self._pending[u] -= 1
            if self._pending[u] == 0:
                self._launch(u)
        return on_grad

    def begin(self, *, reduce: bool, first: bool, final: bool) -> None:
        """Before a micro-step's backward (stage 3 always reduces)."""
        self._active = True
        self._first, self._final = first, final
        self._pending = [len(b.slots) for b in self.layout.buckets]
        self._launched = [False] * len(self.layout.buckets)
        self._got = [set() for _ in self.layout.buckets]

    def _launch(self, u: int) -> None:
        self._launched[u] = True
        b = self.layout.buckets[u]
        if self._direct:
            self._land(b, self._held_source(b, self._held.pop(u, {})), self._first, self._final)
            return
        buf = self._bufs.pop(u, None)
        if buf is None:
            buf = self._buffer(u)
            self._bufs.pop(u)
        if u in self._reused:  # a spare: the slots no gradient reached still hold the last unit's
            self._reused.discard(u)
            for i in b.slots:
                if i not in self._got[u]:
                    lo = self.layout.slots[i].offset - b.start
                    buf[lo:lo + self.layout.slots[i].numel].zero_()
        if self.comm_world == 1:
            self._reduced(b, buf)
            self._keep_spare(buf)
            return
        while len(self._inflight) >= self.max_in_flight:
            self._finish(self._inflight.pop(0))
        out = torch.empty(b.shard_numel, dtype=buf.dtype, device=buf.device)
        work = reduce_scatter_single(out, buf, group=self.group, async_op=True)
        self._inflight.append((b, out, buf, work))

    def _held_source(self, b: Bucket, held: dict[int, torch.Tensor]):
        """The unit's gradient as the tensors autograd gave (``Source`` of ``offload.zero.grads``):
        zeros in the padding and for parameters no gradient reached, as a zeroed buffer would hold."""
        pieces, at = [], 0  # (offset in the unit, 1-D tensor), covering [0, b.numel)
        for i in sorted(b.slots, key=lambda i: self.layout.slots[i].offset):
            lo, n = self.layout.slots[i].offset - b.start, self.layout.slots[i].numel
            if lo > at:
                pieces.append((at, self._zeros_of(lo - at)))
            g = held.get(i)
            pieces.append((lo, g if g is not None else self._zeros_of(n)))
            at = lo + n
        if at < b.numel:
            pieces.append((at, self._zeros_of(b.numel - at)))

        def source(start: int, numel: int) -> list[tuple[int, torch.Tensor]]:
            out, lo, hi = [], start - b.start, start - b.start + numel
            for off, t in pieces:
                a, z = max(lo, off), min(hi, off + t.numel())
                if a < z:
                    out.append((a - lo, t[a - off:z - off]))
            return out
        return source

    def _zeros_of(self, numel: int) -> torch.Tensor:
        dtype = self.params[0].dtype
        if self._zeros is None or self._zeros.numel() < numel or self._zeros.dtype != dtype:
            self._zeros = torch.zeros(numel, dtype=dtype)
        return self._zeros[:numel]

    def _finish(self, entry) -> None:
        b, out, buf, work = entry
        work.wait()
        self._keep_spare(buf)
        self._reduced(b, out)

    def _keep_spare(self, buf: torch.Tensor) -> None:
        """A host unit buffer that has been landed or reduced: the next unit of its size reuses it."""
        if buf.device.type == "cpu":
            self._spares[(buf.numel(), buf.dtype)] = buf

    def _reduced(self, b: Bucket, grad: torch.Tensor) -> None:
        """A unit's reduced gradient: landed now, or (a GPU one, with a fetcher) sent to the host first."""
        if self._fetcher is None or not grad.is_cuda or b.index in self._device_units:
            self._land(b, grad, self._first, self._final)
            return
        while len(self._offloading) >= self.max_in_flight:
            self._landed_from_host(*self._offloading.pop(0))
        host = self._host_buffer(grad)
        self._offloading.append((b, host, self._fetcher.start_offload([(host, grad)])))

    def _host_buffer(self, grad: torch.Tensor) -> torch.Tensor:
        for i, spare in enumerate(self._spare_hosts):
            if spare.dtype == grad.dtype and spare.numel() >= grad.numel():
                return self._spare_hosts.pop(i)[:grad.numel()]
        return torch.empty(grad.numel(), dtype=grad.dtype, pin_memory=True)

    def _landed_from_host(self, b: Bucket, host: torch.Tensor, pending: Any) -> None:
        self._fetcher.wait_offload(pending)
        self._land(b, host, self._first, self._final)
        self._spare_hosts.append(host._base if host._base is not None else host)

    def end(self) -> None:
        """After backward: reduce the units no gradient reached (zeros), land everything in flight."""
        if not self._active:
            return
        for b in self.layout.buckets:
            if not self._launched[b.index]:
                self._launch(b.index)
        while self._inflight:
            self._finish(self._inflight.pop(0))
        while self._offloading:
            self._landed_from_host(*self._offloading.pop(0))
        self._spares.clear()
        self._held.clear()
        self._active = False

    def zero(self) -> None:
        """Drop gradients left on the params (a backward outside the engine)."""
        for p in self.params:
            p.grad = None

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._bufs.clear()
        self._spares.clear()
        self._inflight.clear()
        self._offloading.clear()
        self._spare_hosts.clear()
