"""Gradients: from autograd into the flat buffer, reduced across ranks, landed in the partition.

Every trainable parameter's ``.grad`` is a view into the flat gradient buffer
([Note: flat layout]), so autograd accumulates micro-steps in place. A bucket is
reduced when the last of its parameters' gradients is accumulated (a post-accumulate
hook), while backward goes on with earlier layers:
- stage 0: all-reduce of the bucket (every rank steps everything);
- stages 1 and 2: reduce-scatter of the bucket into this rank's shard.
Stage 2 reduces every micro-step and adds into the fp32 accumulators; stages 0 and 1
reduce only at the accumulation boundary. Reductions are sums: the 1/world_size of the
average is folded into the Adam pass's gradient multiplier (``offload.precision``).

The landing (``land(bucket, source, first, final, zero_source)``) is the optimizer's: it copies
or adds the shard into the sub-groups' accumulators and takes the sum of squares in the same
pass; where the shard is the flat buffer's own bucket it may zero it on the way (it says so),
and only otherwise is the bucket zeroed here ([Note: landing] in ``offload.zero.optimizer``).

[Note: gradients straight from autograd]
On one rank (stages 0-2, CPU), when a micro-step reduces and the flat buffer is all zeros
(every micro-step but the non-reducing ones of stages 0-1 under accumulation), ``.grad`` is
set to None before backward, as torch's ``zero_grad(set_to_none=True)`` does: autograd then
hands each parameter its gradient as is, instead of adding it into a zeroed view (a read of
both and a write per element), and the bucket lands from those tensors. They stay the
parameters' ``.grad`` until the next backward; the flat buffer stays zero.

"""
from __future__ import annotations

import bisect
import logging
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from offload.zero.collectives import reduce_scatter_single
from offload.zero.layout import Bucket, FlatLayout
from offload.zero.node_buffers import NodeBuffers

logger = logging.getLogger(__name__)

__all__ = ["GradReducer"]

Source = Callable[[int, int], list[tuple[int, torch.Tensor]]]
"""(flat start, numel) -> the 1-D tensors holding that range of a bucket's reduced gradient, each
with its offset into the range, in order."""
Land = Callable[[Bucket, Source, bool, bool, bool], bool]


class GradReducer:
    """Hooks on the parameters; buckets reduced as they complete; landed in order."""

    def __init__(self, layout: FlatLayout, flat_grads: torch.Tensor, params: Sequence[torch.nn.Parameter], *,
                 stage: int, group: dist.ProcessGroup | None, comm_world: int, land: Land, fetcher: Any = None,
                 node: NodeBuffers | None = None, device_buckets: frozenset[int] = frozenset()) -> None:
        """``fetcher`` (``offload.gpu.Fetcher``; a GPU model whose optimizer state is on the host): reduced
        buckets go to pinned host buffers on its D2H stream while backward goes on, and land after it.
        ``node`` (stages 1-2, ranks of one node): ``flat_grads`` is this rank's buffer in it, and the
        shards are summed from the ranks' buffers after backward ([Note: node-shared buffers]).
        ``device_buckets``: buckets whose shard lands in device-resident accumulators only; they land from the
        device, never copied to the host ([Note: GPU-resident share] in offload.zero.device_share)."""
        self.layout = layout
        self.flat_grads = flat_grads
        self.params = list(params)
        self.stage = stage
        self.group = group
        self.comm_world = comm_world
        self._land = land
        self._fetcher = fetcher
        self._device_buckets = device_buckets
        self._node = node if comm_world > 1 and stage >= 1 else None
        self._host: dict[int, torch.Tensor] = {}  # bucket -> pinned host copy of its reduced gradient
        self._offloading: list[tuple[Bucket, torch.Tensor, Any]] = []  # D2H in flight: (bucket, host, pending)
        self._bucket_of = {}
        for b in layout.buckets:
            for i in b.slots:
                self._bucket_of[i] = b.index
        self._views = [flat_grads[s.offset:s.offset + s.numel].view(s.shape) for s in layout.slots]
        self._order = sorted(range(len(layout.slots)), key=lambda i: layout.slots[i].offset)  # buffer order
        self._starts = [layout.slots[i].offset for i in self._order]
        self._may_steal = comm_world == 1 and stage < 3 and flat_grads.is_cpu  # [Note: gradients straight ...]
        self._stealing = False
        self._stolen: list[torch.Tensor | None] = []
        self._attached = True
        self._zeros = True  # the flat buffer is all zeros
        self._pending_count: list[int] = []
        self._launched: list[bool] = []
        self._inflight: list[tuple[Bucket, torch.Tensor, object]] = []
        self._scratch: dict[int, torch.Tensor] = {}
        self._active = False
        self._first = True
        self._final = True
        self.land_early = False
        """Land finished reductions while backward runs, not only after it (``offload.zero.overlap``)."""
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self.params)]
        self.attach_grads()

    def attach_grads(self) -> None:
        """Point every parameter's ``.grad`` at its view of the flat buffer."""
        for p, view in zip(self.params, self._views):
            p.grad = view
        self._attached = True

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def on_grad(param: torch.Tensor) -> None:
            view = self._views[index]
            if self._stealing:
                grad = param.grad
                self._stolen[index] = grad.contiguous() if grad is not None else None
            else:
                grad = param.grad
                if grad is None or grad.data_ptr() != view.data_ptr():  # .grad was reset: bring it home
                    if grad is not None:
                        view.add_(grad)
                    param.grad = view
            if self._active:
                b = self._bucket_of[index]
                self._pending_count[b] -= 1
                if self._pending_count[b] == 0:
                    self._launch(self.layout.buckets[b])
                if self.land_early:
                    self._land_ready()
        return on_grad

    def begin(self, *, reduce: bool, first: bool, final: bool) -> None:
        """Before a micro-step's backward: whether it reduces, and whether it starts or ends a cycle."""
        self._active = reduce
        self._first, self._final = first, final
        self._pending_count = [len(b.slots) for b in self.layout.buckets]
        self._launched = [False] * len(self.layout.buckets)
        self._stealing = reduce and self._may_steal and self._zeros
        if self._stealing:
            for p in self.params:
                p.grad = None
            self._stolen = [None] * len(self.params)
            self._attached = False
        elif not self._attached:
            self.attach_grads()
        if not reduce:
            self._zeros = False

    def _stolen_source(self, start: int, numel: int) -> list[tuple[int, torch.Tensor]]:
        """The range's gradient from the tensors autograd handed over; the flat buffer's zeros where
        a parameter got none (unused) and in padding."""
        out, pos, end = [], start, start + numel
        k = max(0, bisect.bisect_right(self._starts, start) - 1)
        while pos < end:
            slot = self.layout.slots[self._order[k]] if k < len(self._order) else None
            if slot is None or pos < slot.offset:  # padding before the next slot (or at the end)
                stop = end if slot is None else min(end, slot.offset)
                out.append((pos - start, self.flat_grads[pos:stop]))
                pos = stop
                continue
            stop = min(end, slot.offset + slot.numel)
            if stop > pos:
                g = self._stolen[slot.index]
                flat = g.view(-1) if g is not None else self._views[slot.index].view(-1)
                out.append((pos - start, flat[pos - slot.offset:stop - slot.offset]))
                pos = stop
            k += 1
        return out

    def _launch(self, b: Bucket) -> None:
        self._launched[b.index] = True
        buf = self.flat_grads[b.start:b.start + b.numel]
        if self.comm_world == 1:
            if self._to_host(b, buf):
                self._start_offload(b, buf)
                return
            if self._stealing:
                self._land(b, self._stolen_source, self._first, self._final, False)
            elif not self._land(b, shard_source(buf, b.start), self._first, self._final, True):
                buf.zero_()
            return
        if self._node is not None:  # summed in end(), once every rank's backward is done
            return
        if self.stage == 0:
            work = dist.all_reduce(buf, group=self.group, async_op=True)
            self._inflight.append((b, buf, work))
        else:
            out = self._scratch.get(b.index)
            if out is None:
                out = self._scratch[b.index] = torch.empty(b.shard_numel, dtype=buf.dtype, device=buf.device)
            work = reduce_scatter_single(out, buf, group=self.group, async_op=True)
            self._inflight.append((b, out, work))

    def end(self) -> None:
        """After backward: reduce buckets no hook completed (unused params), land everything, zero what landed."""
        if not self._active:
            return
        for b in self.layout.buckets:
            if not self._launched[b.index]:
                self._launch(b)
        if self._node is not None:
            self._reduce_on_node()
        inflight, self._inflight = self._inflight, []
        for b, shard, work in inflight:
            work.wait()
            self._reduced(b, shard)
        offloading, self._offloading = self._offloading, []
        for b, host, pending in offloading:
            self._offloaded(b, host, pending)
        self._active = False
        self._stealing = False
        self._zeros = True

    def _reduce_on_node(self) -> None:
        """Every bucket's shard of this rank summed over the ranks' buffers, landed, and zeroed in each
        buffer, between two barriers ([Note: node-shared buffers] in ``offload.zero.node_buffers``)."""
        self._node.barrier()  # every rank's backward has written its gradients (and read the params)
        rank = self.layout.rank
        for b in self.layout.buckets:
            out = self._scratch.get(b.index)
            if out is None:
                out = self._scratch[b.index] = torch.empty(b.shard_numel, dtype=self.flat_grads.dtype)
            self._node.reduce_shard(b.shard_start(rank), b.shard_numel, out)
            self._land(b, shard_source(out, b.shard_start(rank)), self._first, self._final, False)
        self._node.barrier()  # every shard read and zeroed before any rank's next backward writes there

    def _reduced(self, b: Bucket, shard: torch.Tensor) -> None:
        """A bucket whose reduction has finished: to the host (a GPU model) or landed."""
        if self._to_host(b, shard):
            self._start_offload(b, shard)
            return
        in_place = self.stage == 0  # the all-reduced bucket is the flat buffer's own
        base = b.start if in_place else b.shard_start(self.layout.rank)
        if not self._land(b, shard_source(shard, base), self._first, self._final, in_place):
            self.flat_grads[b.start:b.start + b.numel].zero_()

    def _to_host(self, b: Bucket, grad: torch.Tensor) -> bool:
        """Whether a bucket's reduced gradient goes to the host before it lands: a GPU's, but for the buckets
        kept on the device ([Note: GPU-resident share] in offload.zero.device_share)."""
        return self._fetcher is not None and grad.is_cuda and b.index not in self._device_buckets

    def _offloaded(self, b: Bucket, host: torch.Tensor, pending: Any) -> None:
        self._fetcher.wait_offload(pending)
        self._land(b, host, self._first, self._final)
        self.flat_grads[b.start:b.start + b.numel].zero_()  # after the copy read it (waited above)

    def _land_ready(self) -> None:
        """Land, during backward, the reductions and offloads that have finished, oldest first and
        stopping at the first that has not: the same order ``end`` lands in, so the same sums
        ([Note: landing early] in ``offload.zero.overlap``)."""
        while self._inflight and self._inflight[0][2].is_completed():
            b, shard, work = self._inflight.pop(0)
            work.wait()
            self._reduced(b, shard)
        while self._offloading and (self._offloading[0][2].event is None or self._offloading[0][2].event.query()):
            self._offloaded(*self._offloading.pop(0))

    def _start_offload(self, b: Bucket, src: torch.Tensor) -> None:
        """A reduced bucket (or shard) to its pinned host buffer, on the D2H stream; landed in ``end``."""
        host = self._host.get(b.index)
        if host is None or host.numel() != src.numel():
            host = self._host[b.index] = torch.empty(src.numel(), dtype=src.dtype, pin_memory=True)
        self._offloading.append((b, host, self._fetcher.start_offload([(host, src)])))

    def zero(self) -> None:
        if not self._zeros:
            self.flat_grads.zero_()
            self._zeros = True
        self.attach_grads()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def shard_source(shard: torch.Tensor, base: int) -> Source:
    """The source of a reduced shard that starts at flat element ``base``."""
    def source(start: int, numel: int) -> list[tuple[int, torch.Tensor]]:
        return [(0, shard[start - base:start - base + numel])]
    return source
