"""Many small tensors moved in one kernel launch, with the cast to the destination dtype fused.

[Note: batched small copies] A ``copy_(non_blocking=True)`` per tensor costs a launch and a
copy-engine setup (several microseconds) whatever its size: at 64 KiB that is most of the
time a 50 GB/s link would need for the bytes. ``batched_copy`` moves a list of tensors with
one launch of a segmented-copy kernel instead: the host side is memory registered with
CUDA as mapped (``offload.gpu.registration``), so the kernel loads from or stores to it
directly over the link, and it converts to the destination's dtype in the same pass.

How the kernel finds the tensors: every source is addressed as the first source's pointer
plus an element offset, every destination likewise (one flat address space: device memory
and mapped host memory share CUDA's unified addressing, and under Triton's interpreter
CPU tensors are plain memory). The work is cut into *chunks* of at most ``chunk_numel``
elements that never cross a tensor's end; program ``i`` copies chunk ``i``. The chunk
table (three int64 columns: source offset, destination offset, length) is built on the
host by ``chunk_table`` and sent with the launch.

Triton is optional: without it (or without a GPU and outside the interpreter)
``batched_copy`` falls back to a loop of ``copy_``, which is what the per-tensor path
does anyway.
"""
from __future__ import annotations

import functools
import logging
import math
import os
from typing import NamedTuple, Sequence

import torch

from csrc import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["ChunkTable", "batched_copy", "chunk_table", "kernel_available", "triton_import_error"]

CHUNK_NUMEL = 16384
"""Elements per program: 64 KiB of fp32, enough bytes in flight per SM without starving the grid."""
BLOCK_NUMEL = 1024
"""Elements per vector step inside a program."""


class ChunkTable(NamedTuple):
    """Per chunk: element offset of its source and destination from the bases, and its length."""

    src_offset: list[int]
    dst_offset: list[int]
    numel: list[int]


def chunk_table(src_offsets: Sequence[int], dst_offsets: Sequence[int], numels: Sequence[int],
                chunk_numel: int = CHUNK_NUMEL) -> ChunkTable:
    """Cut tensors (given by element offsets from the bases and lengths) into chunks of at most
    ``chunk_numel`` elements; empty tensors make no chunk."""
    if chunk_numel <= 0:
        raise ConfigError(f"chunk_numel must be > 0, got {chunk_numel}")
    if not len(src_offsets) == len(dst_offsets) == len(numels):
        raise ConfigError(f"chunk_table: {len(src_offsets)} sources, {len(dst_offsets)} destinations, "
                          f"{len(numels)} lengths")
    table = ChunkTable([], [], [])
    for s, d, n in zip(src_offsets, dst_offsets, numels):
        for start in range(0, n, chunk_numel):
            table.src_offset.append(s + start)
            table.dst_offset.append(d + start)
            table.numel.append(min(chunk_numel, n - start))
    return table


@functools.lru_cache(maxsize=1)
def triton_import_error() -> str | None:
    """None if Triton imports here, else why not."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising anything
        return f"{type(exc).__name__}: {exc}"
    return None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernel_available(device: torch.device) -> bool:
    """Whether ``batched_copy`` launches the kernel for tensors on ``device`` (else it loops ``copy_``)."""
    if triton_import_error() is not None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and _interpreting())


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    """The kernel, decorated while ``TRITON_INTERPRET`` says ``interpret`` (triton.jit reads it then)."""
    import triton
    import triton.language as tl

    @triton.jit
    def segmented_copy(src, dst, src_offset, dst_offset, numel, BLOCK: tl.constexpr, ALIGN: tl.constexpr,
                       NARROWING: tl.constexpr):
        # [Note: unmasked body] The chunk's whole blocks are copied without a mask, its tail with one.
        # A mask compares against a length loaded at run time, which the compiler cannot prove a
        # multiple of anything: a masked access is split into one scalar load or store per element,
        # and over the link to mapped host memory that is a 4-byte request each (the first H100 run
        # measured D2H at 2.2 GB/s that way). Unmasked, with ALIGN-element aligned offsets, each
        # thread moves 16 bytes per request.
        chunk = tl.program_id(0)
        s = tl.multiple_of(tl.load(src_offset + chunk), ALIGN)
        d = tl.multiple_of(tl.load(dst_offset + chunk), ALIGN)
        n = tl.load(numel + chunk)
        whole = n // BLOCK * BLOCK
        for start in range(0, whole, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            value = tl.load(src + s + idx)
            if NARROWING:  # round to nearest even, as torch's casts do
                value = value.to(dst.dtype.element_ty, fp_downcast_rounding="rtne")
            else:
                value = value.to(dst.dtype.element_ty)
            tl.store(dst + d + idx, value)
        idx = whole + tl.arange(0, BLOCK)
        mask = idx < n
        value = tl.load(src + s + idx, mask=mask)
        if NARROWING:
            value = value.to(dst.dtype.element_ty, fp_downcast_rounding="rtne")
        else:
            value = value.to(dst.dtype.element_ty)
        tl.store(dst + d + idx, value, mask=mask)

    return segmented_copy


def _offsets(tensors: Sequence[torch.Tensor], what: str) -> list[int]:
    base = tensors[0].data_ptr()
    size = tensors[0].element_size()
    out = []
    for i, t in enumerate(tensors):
        delta = t.data_ptr() - base
        if delta % size:
            raise ConfigError(f"batched_copy: {what} {i} is not aligned to its element size from {what} 0")
        out.append(delta // size)
    return out


def _align(values: Sequence[int], most: int) -> int:
    """The largest power of two up to ``most`` dividing every value (a vectorization hint)."""
    g = 0
    for v in values:
        g = math.gcd(g, v)
    a = 1
    while a < most and g % (a * 2) == 0:
        a *= 2
    return a


def _check(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    if len(dsts) != len(srcs):
        raise ConfigError(f"batched_copy: {len(dsts)} destinations for {len(srcs)} sources")
    for i, (d, s) in enumerate(zip(dsts, srcs)):
        if d.numel() != s.numel():
            raise ConfigError(f"batched_copy: pair {i} has {d.numel()} destination and {s.numel()} source elements")
        if not (d.is_contiguous() and s.is_contiguous()):
            raise ConfigError(f"batched_copy: pair {i} is not contiguous")
        if d.dtype != dsts[0].dtype or s.dtype != srcs[0].dtype:
            raise ConfigError("batched_copy: one launch takes one source dtype and one destination dtype")


def batched_copy(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], *, device: torch.device | None = None,
                 chunk_numel: int = CHUNK_NUMEL) -> bool:
    """Copy every ``srcs[i]`` into ``dsts[i]`` (cast to the destination dtype) with one kernel launch on
    ``device``'s current stream. Returns True if the kernel ran, False if it fell back to ``copy_``
    per tensor (no Triton, or no kernel for this device). Contiguous tensors, one dtype per side."""
    _check(dsts, srcs)
    pairs = [(d, s) for d, s in zip(dsts, srcs) if d.numel()]
    if not pairs:
        return False
    if device is None:
        on_gpu = [t.device for d, s in pairs for t in (d, s) if t.device.type == "cuda"]
        device = on_gpu[0] if on_gpu else torch.device("cpu")
    if not kernel_available(device):
        for d, s in pairs:
            d.copy_(s, non_blocking=True)
        return False
    d_list, s_list = [d for d, _ in pairs], [s for _, s in pairs]
    src_off, dst_off = _offsets(s_list, "source"), _offsets(d_list, "destination")
    table = chunk_table(src_off, dst_off, [d.numel() for d in d_list], chunk_numel)
    cols = torch.tensor([table.src_offset, table.dst_offset, table.numel], dtype=torch.int64)
    if device.type == "cuda":
        cols = cols.pin_memory().to(device, non_blocking=True)
    width = 16 // max(d_list[0].element_size(), s_list[0].element_size())
    align = _align(table.src_offset + table.dst_offset, max(1, width))
    block = min(BLOCK_NUMEL, chunk_numel)
    grid = (len(table.numel),)
    narrowing = (s_list[0].dtype.is_floating_point and d_list[0].dtype.is_floating_point
                 and d_list[0].element_size() < s_list[0].element_size())
    _kernel(_interpreting())[grid](s_list[0], d_list[0], cols[0], cols[1], cols[2], BLOCK=block, ALIGN=align,
                                   NARROWING=narrowing)
    return True
