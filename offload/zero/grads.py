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

The landing (``land(bucket, shard, first, final)``) is the optimizer's: it copies or adds
the shard into the sub-groups' accumulators and takes the sum of squares while the
bytes are still in cache.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from offload.zero.layout import Bucket, FlatLayout

logger = logging.getLogger(__name__)

__all__ = ["GradReducer"]

Land = Callable[[Bucket, torch.Tensor, bool, bool], None]


class GradReducer:
    """Hooks on the parameters; buckets reduced as they complete; landed in order."""

    def __init__(self, layout: FlatLayout, flat_grads: torch.Tensor, params: Sequence[torch.nn.Parameter], *,
                 stage: int, group: dist.ProcessGroup | None, comm_world: int, land: Land, fetcher: Any = None) -> None:
        """``fetcher`` (``offload.gpu.Fetcher``; a GPU model whose optimizer state is on the host): reduced
        buckets go to pinned host buffers on its D2H stream while backward goes on, and land after it."""
        self.layout = layout
        self.flat_grads = flat_grads
        self.params = list(params)
        self.stage = stage
        self.group = group
        self.comm_world = comm_world
        self._land = land
        self._fetcher = fetcher
        self._host: dict[int, torch.Tensor] = {}  # bucket -> pinned host copy of its reduced gradient
        self._offloading: list[tuple[Bucket, torch.Tensor, Any]] = []  # D2H in flight: (bucket, host, pending)
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
            if self._fetcher is not None and buf.is_cuda:
                self._start_offload(b, buf)
                return
            self._land(b, buf, self._first, self._final)
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
            if self._fetcher is not None and shard.is_cuda:
                self._start_offload(b, shard)
                continue
            self._land(b, shard, self._first, self._final)
            self.flat_grads[b.start:b.start + b.numel].zero_()
        offloading, self._offloading = self._offloading, []
        for b, host, pending in offloading:
            self._fetcher.wait_offload(pending)
            self._land(b, host, self._first, self._final)
            self.flat_grads[b.start:b.start + b.numel].zero_()  # after the copy read it (waited above)
        self._active = False

    def _start_offload(self, b: Bucket, src: torch.Tensor) -> None:
        """A reduced bucket (or shard) to its pinned host buffer, on the D2H stream; landed in ``end``."""
        host = self._host.get(b.index)
        if host is None or host.numel() != src.numel():
            host = self._host[b.index] = torch.empty(src.numel(), dtype=src.dtype, pin_memory=True)
        self._offloading.append((b, host, self._fetcher.start_offload([(host, src)])))

    def zero(self) -> None:
        self.flat_grads.zero_()
        self.attach_grads()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
