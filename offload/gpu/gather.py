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
    if not len(src_offsets) == len(dst_offsets) == len(numels):
        raise ConfigError(f"chunk_table: {len(src_offsets)} sources, {len(dst_offsets)} destinations, "
                          f"{len(numels)} lengths")
    cols = _chunk_columns(torch.tensor(src_offsets, dtype=torch.int64), torch.tensor(dst_offsets, dtype=torch.int64),
                          torch.tensor(numels, dtype=torch.int64), chunk_numel)
    return ChunkTable(*(c.tolist() for c in cols))


def _chunk_columns(src: torch.Tensor, dst: torch.Tensor, numel: torch.Tensor, chunk_numel: int) -> torch.Tensor:
    """``chunk_table`` in tensor operations (a thousand tensors cost tens of microseconds, not a
    millisecond of Python): a (3, chunks) int64 tensor of source offset, destination offset, length."""
    if chunk_numel <= 0:
        raise ConfigError(f"chunk_numel must be > 0, got {chunk_numel}")
    per = (numel + chunk_numel - 1) // chunk_numel  # chunks per tensor (0 for an empty one)
    owner = torch.repeat_interleave(torch.arange(len(per)), per)
    first = torch.cumsum(per, 0) - per  # each tensor's first chunk
    start = (torch.arange(len(owner)) - first[owner]) * chunk_numel  # the chunk's start within its tensor
    return torch.stack([src[owner] + start, dst[owner] + start,
                        torch.clamp(numel[owner] - start, max=chunk_numel)])


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
    def segmented_copy(src, dst, src_offset, dst_offset, numel, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                       ALIGN: tl.constexpr, NARROWING: tl.constexpr):
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
        for start in range(0, CHUNK, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            if start + BLOCK <= n:  # a whole block
                value = tl.load(src + s + idx)
                if NARROWING:  # round to nearest even, as torch's casts do
                    value = value.to(dst.dtype.element_ty, fp_downcast_rounding="rtne")
                else:
                    value = value.to(dst.dtype.element_ty)
                tl.store(dst + d + idx, value)
            elif start < n:  # the tail
                mask = idx < n
                value = tl.load(src + s + idx, mask=mask)
                if NARROWING:
                    value = value.to(dst.dtype.element_ty, fp_downcast_rounding="rtne")
                else:
                    value = value.to(dst.dtype.element_ty)
                tl.store(dst + d + idx, value, mask=mask)

    return segmented_copy


def _offsets(tensors: Sequence[torch.Tensor], what: str) -> torch.Tensor:
    """Each tensor's element offset from the first one's address."""
    size = tensors[0].element_size()
    delta = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
    delta -= delta[0].item()
    bad = torch.nonzero(delta % size)
    if len(bad):
        raise ConfigError(f"batched_copy: {what} {int(bad[0])} is not aligned to its element size from {what} 0")
    return delta // size


def _align(values: torch.Tensor, most: int) -> int:
    """The largest power of two up to ``most`` dividing every value (a vectorization hint)."""
    a = 1
    while a < most and not bool(torch.any(values % (a * 2))):
        a *= 2
    return a


def _check(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> list[int]:
    """Each pair's element count, after checking the pairs fit one launch (comprehensions, not a loop
    of checks: with a thousand small tensors this is most of the host's time)."""
    if len(dsts) != len(srcs):
        raise ConfigError(f"batched_copy: {len(dsts)} destinations for {len(srcs)} sources")
    numels = [d.numel() for d in dsts]
    if numels != [s.numel() for s in srcs]:
        i = next(i for i, (d, s) in enumerate(zip(dsts, srcs)) if d.numel() != s.numel())
        raise ConfigError(f"batched_copy: pair {i} has {dsts[i].numel()} destination and {srcs[i].numel()} "
                          "source elements")
    if not (all([d.is_contiguous() for d in dsts]) and all([s.is_contiguous() for s in srcs])):
        i = next(i for i, (d, s) in enumerate(zip(dsts, srcs)) if not (d.is_contiguous() and s.is_contiguous()))
        raise ConfigError(f"batched_copy: pair {i} is not contiguous")
    if dsts and (len({d.dtype for d in dsts}) > 1 or len({s.dtype for s in srcs}) > 1):
        raise ConfigError("batched_copy: one launch takes one source dtype and one destination dtype")
    return numels


def batched_copy(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], *, device: torch.device | None = None,
                 chunk_numel: int = CHUNK_NUMEL) -> bool:
    """Copy every ``srcs[i]`` into ``dsts[i]`` (cast to the destination dtype) with one kernel launch on
    ``device``'s current stream. Returns True if the kernel ran, False if it fell back to ``copy_``
    per tensor (no Triton, or no kernel for this device). Contiguous tensors, one dtype per side."""
    numels = _check(dsts, srcs)
    pairs = [(d, s, n) for d, s, n in zip(dsts, srcs, numels) if n]
    if not pairs:
        return False
    if device is None:
        on_gpu = [t.device for d, s, _ in pairs for t in (d, s) if t.device.type == "cuda"]
        device = on_gpu[0] if on_gpu else torch.device("cpu")
    if not kernel_available(device):
        for d, s, _ in pairs:
            d.copy_(s, non_blocking=True)
        return False
    d_list, s_list = [d for d, _, _ in pairs], [s for _, s, _ in pairs]
    cols = _chunk_columns(_offsets(s_list, "source"), _offsets(d_list, "destination"),
                          torch.tensor([n for _, _, n in pairs], dtype=torch.int64), chunk_numel)
    width = 16 // max(d_list[0].element_size(), s_list[0].element_size())
    align = _align(cols[:2], max(1, width))
    grid = (cols.shape[1],)
    if device.type == "cuda":
        cols = cols.pin_memory().to(device, non_blocking=True)
    block = min(BLOCK_NUMEL, chunk_numel)
    narrowing = (s_list[0].dtype.is_floating_point and d_list[0].dtype.is_floating_point
                 and d_list[0].element_size() < s_list[0].element_size())
    _kernel(_interpreting())[grid](s_list[0], d_list[0], cols[0], cols[1], cols[2], CHUNK=chunk_numel, BLOCK=block,
                                   ALIGN=align, NARROWING=narrowing)
    return True
