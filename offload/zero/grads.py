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

The landing (``land(bucket, shard, first, final, zero_source)``) is the optimizer's: it copies
or adds the shard into the sub-groups' accumulators and takes the sum of squares in the same
pass; where the shard is the flat buffer's own bucket it may zero it on the way (it says so),
and only otherwise is the bucket zeroed here ([Note: landing] in ``offload.zero.optimizer``).
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from offload.zero.layout import Bucket, FlatLayout

logger = logging.getLogger(__name__)

__all__ = ["GradReducer"]

Land = Callable[[Bucket, torch.Tensor, bool, bool, bool], bool]


class GradReducer:
    """Hooks on the parameters; buckets reduced as they complete; landed in order."""

    def __init__(self, layout: FlatLayout, flat_grads: torch.Tensor, params: Sequence[torch.nn.Parameter], *,
                 stage: int, group: dist.ProcessGroup | None, comm_world: int, land: Land) -> None:
        self.layout = layout
        self.flat_grads = flat_grads
        self.params = list(params)
        self.stage = stage
        self.group = group
        self.comm_world = comm_world
        self._land = land
        self._bucket_of = {}
        for b in layout.buckets:
            for i in b.slots:
                self._bucket_of[i] = b.index
        self._views = [flat_grads[s.offset:s.offset + s.numel].view(s.shape) for s in layout.slots]
        self._pending_count: list[int] = []
        self._launched: list[bool] = []
        self._inflight: list[tuple[Bucket, torch.Tensor, object]] = []
        self._scratch: dict[int, torch.Tensor] = {}
        self._active = False
        self._first = True
        self._final = True
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self.params)]
        self.attach_grads()

    def attach_grads(self) -> None:
        """Point every parameter's ``.grad`` at its view of the flat buffer."""
        for p, view in zip(self.params, self._views):
            p.grad = view

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def on_grad(param: torch.Tensor) -> None:
            view = self._views[index]
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
        return on_grad

    def begin(self, *, reduce: bool, first: bool, final: bool) -> None:
        """Before a micro-step's backward: whether it reduces, and whether it starts or ends a cycle."""
        self._active = reduce
        self._first, self._final = first, final
        self._pending_count = [len(b.slots) for b in self.layout.buckets]
        self._launched = [False] * len(self.layout.buckets)

    def _launch(self, b: Bucket) -> None:
        self._launched[b.index] = True
        buf = self.flat_grads[b.start:b.start + b.numel]
        if self.comm_world == 1:
            if not self._land(b, buf, self._first, self._final, True):
                buf.zero_()
            return
        if self.stage == 0:
            work = dist.all_reduce(buf, group=self.group, async_op=True)
            self._inflight.append((b, buf, work))
        else:
            out = self._scratch.get(b.index)
            if out is None:
                out = self._scratch[b.index] = torch.empty(b.shard_numel, dtype=buf.dtype, device=buf.device)
            work = dist.reduce_scatter_tensor(out, buf, group=self.group, async_op=True)
            self._inflight.append((b, out, work))

    def end(self) -> None:
        """After backward: reduce buckets no hook completed (unused params), land everything, zero what landed."""
        if not self._active:
            return
        for b in self.layout.buckets:
            if not self._launched[b.index]:
                self._launch(b)
        inflight, self._inflight = self._inflight, []
        for b, shard, work in inflight:
            work.wait()
            in_place = self.stage == 0  # the all-reduced bucket is the flat buffer's own
            if not self._land(b, shard, self._first, self._final, in_place):
                self.flat_grads[b.start:b.start + b.numel].zero_()
        self._active = False

    def zero(self) -> None:
        self.flat_grads.zero_()
        self.attach_grads()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
