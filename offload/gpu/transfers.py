"""Parameters to the GPU and gradients back, on copy streams of their own, fenced by events.

``Fetcher`` has two pairs of verbs, FSDP2-style:
- ``start_fetch(pairs)`` / ``wait_fetch(pending)``: host -> device (parameters). The copies
  are queued on the H2D stream behind what the compute stream has queued so far (the
  destinations may still be read by it); ``wait_fetch`` makes the *compute stream* wait on
  the fetch's event, so the host never blocks and the next kernels start when the bytes are in.
- ``start_offload(pairs)`` / ``wait_offload(pending)``: device -> host (gradients). Queued on
  the D2H stream behind the compute stream (the gradients must have been produced);
  ``wait_offload`` blocks the *host* on the event: the CPU is what reads the bytes next.

Each start splits its pairs by size ([Note: batch threshold] in ``offload.gpu.select``):
large tensors one ``copy_(non_blocking=True)`` each, the small ones batched into one launch
per dtype pair ([Note: batched small copies] in ``offload.gpu.gather``). A ``Pending`` keeps
the tensors alive with its event until it is waited for; tensors made on the compute stream
are also marked with ``record_stream`` so the caching allocator does not hand their memory
out again while a copy stream still reads or writes it.

Without a GPU every verb runs its copies at once and ``Pending.event`` is None: the same code
drives CPU-only runs and the tests.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple, Sequence

import torch

from offload.gpu.gather import batched_copy
from offload.gpu.select import Split, TransferPolicy, split_by_size

logger = logging.getLogger(__name__)

__all__ = ["CopyStreams", "Fetcher", "Pending", "TransferCounts"]

Pair = tuple[torch.Tensor, torch.Tensor]  # (destination, source)
BatchedCopy = Callable[..., bool]


class Pending(NamedTuple):
    """A transfer in flight: the tensors it holds alive and the event that fences it (None: done)."""

    tensors: tuple[torch.Tensor, ...]
    event: Any


class TransferCounts(NamedTuple):
    """What a start did: tensors copied one by one, and batched launches with how many tensors."""

    singles: int
    launches: int
    batched: int


class CopyStreams:
    """The two copy streams of one device, made once.

    Why two: host-to-device (parameters) and device-to-host (gradients) run on separate copy
    engines, so a gradient offload never queues behind a parameter fetch or the other way round;
    and neither is the compute stream, so copies overlap the kernels of other layers."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            self.h2d = torch.cuda.Stream(device)
            self.d2h = torch.cuda.Stream(device)
        else:
            self.h2d = self.d2h = None


class Fetcher:
    """Paired async verbs for host <-> device copies (see the module docstring)."""

    def __init__(self, device: torch.device, *, policy: TransferPolicy | None = None,
                 streams: CopyStreams | None = None, batched: BatchedCopy = batched_copy) -> None:
        self.device = device
        self.policy = policy or TransferPolicy()
        self.streams = streams or CopyStreams(device)
        self._batched = batched
        self.last_counts = TransferCounts(0, 0, 0)

    @property
    def on_gpu(self) -> bool:
        return self.streams.h2d is not None

    def _run(self, pairs: Sequence[Pair], stream: Any) -> Pending:
        pairs = list(pairs)
        split: Split = split_by_size(pairs, self.policy)
        tensors = tuple(t for pair in pairs for t in pair)
        if stream is None:
            self._copy(pairs, split)
            return Pending(tensors, None)
        compute = torch.cuda.current_stream(self.device)
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            self._copy(pairs, split)
            for t in tensors:
                if t.is_cuda:
                    t.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
        return Pending(tensors, event)

    def _copy(self, pairs: list[Pair], split: Split) -> None:
        for i in split.singles:
            dst, src = pairs[i]
            dst.copy_(src, non_blocking=True)
        for members in split.batches:
            self._batched([pairs[i][0] for i in members], [pairs[i][1] for i in members], device=self.device)
        self.last_counts = TransferCounts(len(split.singles), len(split.batches), sum(map(len, split.batches)))

    # -- host -> device --------------------------------------------------------------------

    def start_fetch(self, pairs: Sequence[Pair]) -> Pending:
        """Start copying each ``(device dst, host src)`` pair on the H2D stream."""
        with torch.profiler.record_function("offload::h2d"):
            return self._run(pairs, self.streams.h2d)

    def wait_fetch(self, pending: Pending) -> None:
        """Make the compute stream wait for the fetch (the host does not block)."""
        if pending.event is not None:
            torch.cuda.current_stream(self.device).wait_event(pending.event)

    def wait_sources(self, pending: Pending | None) -> None:
        """Block the host until a fetch has read its host sources (before they are written again)."""
        if pending is not None and pending.event is not None:
            pending.event.synchronize()

    # -- device -> host --------------------------------------------------------------------

    def start_offload(self, pairs: Sequence[Pair]) -> Pending:
        """Start copying each ``(host dst, device src)`` pair on the D2H stream."""
        with torch.profiler.record_function("offload::d2h"):
            return self._run(pairs, self.streams.d2h)

    def wait_offload(self, pending: Pending) -> None:
        """Block the host until the offload's bytes are in host memory."""
        if pending.event is not None:
            pending.event.synchronize()
