"""Which copies go one by one and which go through the batched kernel, and where a cast happens.

[Note: batch threshold] A tensor of at least ``batch_below_bytes`` is copied by itself
(``copy_(non_blocking=True)``: a DMA on the copy engine at the link's full speed, and it
leaves the SMs to the model); smaller ones are gathered into one launch of the segmented
copy (``offload.gpu.gather``), whose per-launch cost is paid once for all of them. The
crossover depends on the link, the driver's launch cost and how fast SMs pull from mapped
host memory, so on a GPU it is measured at start-up (``measure_batch_threshold``: a few
milliseconds); without one, or when measuring is turned off, the default stands.

``DEFAULT_BATCH_BELOW_BYTES`` (256 KiB) is an estimate, not a measurement: a per-tensor copy
costs about 5-8 us of launch and setup, which at ~50 GB/s is the time of 250-400 KiB of
bytes, so below that the launch dominates. It is to be replaced by the figure
``tools/bench/bench_fetch.py`` measures on an H100/H200.

[Note: where the cast happens] The batched kernel reads or writes host memory over the
link in the *host's* dtype and converts on the GPU. That saves link bytes when the host
dtype is no wider than the device's (fp32 on the device, bf16 on the host: half the
bytes); when the host's is wider (bf16 gradients landing in fp32 accumulators), shipping
the device's dtype and converting on the host in the pass that consumes the bytes (the
gradient landing already reads every element) moves fewer bytes, so the cast is not
fused. ``fuse_cast`` decides.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, NamedTuple, Sequence

import torch

from csrc import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_BATCH_BELOW_BYTES", "Split", "TransferPolicy", "crossover_bytes", "fuse_cast",
           "measure_batch_threshold", "split_by_size", "startup_policy"]

DEFAULT_BATCH_BELOW_BYTES = 256 << 10
"""The threshold where none was measured (see [Note: batch threshold])."""
PROBE_SIZES_BYTES = tuple(4096 << k for k in range(0, 11))
"""Sizes timed at start-up: 4 KiB .. 4 MiB."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransferPolicy:
    """How copies between host and GPU are grouped."""

    batch_below_bytes: int = DEFAULT_BATCH_BELOW_BYTES
    """Tensors smaller than this (bytes on the link) are batched into one kernel launch."""
    min_batch: int = 2
    """Fewer small tensors than this are copied one by one (one launch either way)."""

    def __post_init__(self) -> None:
        if not isinstance(self.batch_below_bytes, int) or isinstance(self.batch_below_bytes, bool) \
                or self.batch_below_bytes < 0:
            raise ConfigError(f"TransferPolicy.batch_below_bytes must be an integer >= 0, got {self.batch_below_bytes!r}")
        if not isinstance(self.min_batch, int) or isinstance(self.min_batch, bool) or self.min_batch < 1:
            raise ConfigError(f"TransferPolicy.min_batch must be an integer >= 1, got {self.min_batch!r}")


class Split(NamedTuple):
    """Indices of the pairs copied one by one, and groups of indices each batched into one launch."""

    singles: list[int]
    batches: list[list[int]]


def fuse_cast(device_dtype: torch.dtype, host_dtype: torch.dtype) -> bool:
    """Whether the batched kernel converts (see [Note: where the cast happens])."""
    return host_dtype.itemsize <= device_dtype.itemsize


def split_by_size(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], policy: TransferPolicy) -> Split:
    """Split ``(dst, src)`` pairs: each at or above the threshold alone, the rest batched per
    (source dtype, destination dtype), since one launch handles one of each. A pair's size is the
    larger of its two sides (what a per-tensor copy would move)."""
    singles: list[int] = []
    groups: dict[tuple[torch.dtype, torch.dtype], list[int]] = {}
    for i, (dst, src) in enumerate(pairs):
        nbytes = max(dst.numel() * dst.element_size(), src.numel() * src.element_size())
        if nbytes >= policy.batch_below_bytes or not (dst.is_contiguous() and src.is_contiguous()):
            singles.append(i)
        else:
            groups.setdefault((src.dtype, dst.dtype), []).append(i)
    batches = []
    for members in groups.values():
        if len(members) < policy.min_batch:
            singles.extend(members)
        else:
            batches.append(members)
    singles.sort()
    return Split(singles, batches)


def crossover_bytes(sizes_bytes: Sequence[int], per_tensor_seconds: Sequence[float],
                    batched_seconds: Sequence[float]) -> int:
    """The threshold from timings of the same bytes moved both ways at each size (ascending): the
    smallest size from which per-tensor copies are at least as fast at it and every larger size
    probed. 0 when per-tensor copies win everywhere; one past the largest probe when the batch
    wins everywhere."""
    if not len(sizes_bytes) == len(per_tensor_seconds) == len(batched_seconds) or not sizes_bytes:
        raise ConfigError("crossover_bytes: one timing per size, both ways, at least one size")
    if list(sizes_bytes) != sorted(sizes_bytes):
        raise ConfigError("crossover_bytes: sizes must ascend")
    threshold = sizes_bytes[-1] + 1
    for size, single, batched in reversed(list(zip(sizes_bytes, per_tensor_seconds, batched_seconds))):
        if single > batched:
            break
        threshold = size
    return 0 if threshold == sizes_bytes[0] else threshold


def _time(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm: the first launch compiles the kernel
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def measure_batch_threshold(device: torch.device, *, total_bytes: int = 8 << 20, repeats: int = 5,
                            sizes_bytes: Sequence[int] = PROBE_SIZES_BYTES) -> int:
    """Time host-to-device copies of ``total_bytes`` cut into tensors of each size, one by one
    and batched, from pinned host memory; returns ``crossover_bytes`` of the timings. Needs a GPU."""
    from offload.gpu.gather import batched_copy, kernel_available

    if device.type != "cuda":
        raise ConfigError(f"measure_batch_threshold needs a CUDA device, got {device}")
    if not kernel_available(device):
        logger.info("no batched kernel here (Triton: missing); every copy goes one by one")
        return 0
    host = torch.empty(total_bytes // 4, dtype=torch.float32, pin_memory=True)
    dev = torch.empty_like(host, device=device)
    singles, batched = [], []
    for size in sizes_bytes:
        n = size // 4
        count = max(1, host.numel() // n)
        srcs = [host[i * n:(i + 1) * n] for i in range(count)]
        dsts = [dev[i * n:(i + 1) * n] for i in range(count)]

        def one_by_one() -> None:
            for d, s in zip(dsts, srcs):
                d.copy_(s, non_blocking=True)

        singles.append(_time(one_by_one, repeats))
        batched.append(_time(lambda: batched_copy(dsts, srcs, device=device), repeats))
    threshold = crossover_bytes(sizes_bytes, singles, batched)
    logger.info("batch threshold measured on %s: %d bytes (per-size us one by one %s, batched %s)", device,
                threshold, [round(t * 1e6) for t in singles], [round(t * 1e6) for t in batched])
    return threshold


def startup_policy(device: torch.device, measure: Callable[[torch.device], int] = measure_batch_threshold
                   ) -> TransferPolicy:
    """The policy an engine starts with: the threshold measured on a GPU, the default elsewhere. A
    measurement that fails (a driver or Triton that refuses the mapped pointers) is logged and
    batching turned off: every copy then goes one by one, which is always correct."""
    if device.type != "cuda":
        return TransferPolicy()
    t0 = time.perf_counter()
    try:
        threshold = measure(device)
    except Exception as exc:  # anything the kernel's launch raises: fall back, never stop training
        logger.warning("measuring the batch threshold on %s failed (%s: %s); copying every tensor by itself",
                       device, type(exc).__name__, exc)
        return TransferPolicy(batch_below_bytes=0)
    logger.info("batch threshold %d bytes (measured in %.2f s)", threshold, time.perf_counter() - t0)
    return TransferPolicy(batch_below_bytes=threshold)
