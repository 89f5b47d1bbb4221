"""Adam state tensors on transparent huge pages where the kernel allows it.

[Note: huge pages for the moments]
A step streams four arrays (param, grad, exp_avg, exp_avg_sq). On 4 KiB pages an array
of 1e8 floats spans 100,000 pages, far more than the TLB holds, and each page's table
entry is one more miss to memory in a pass that is already bound by memory. The moments
are ours to allocate, so for arrays of at least ``HUGE_MIN_BYTES`` they are placed in an
anonymous mapping advised ``MADV_HUGEPAGE`` before its first touch: on kernels whose
transparent huge pages are in ``madvise`` mode (the common default) the mapping is then
backed by 2 MiB pages. Where the advice is refused or unknown, the mapping is still
ordinary zeroed memory. The tensor owns the mapping (``torch.frombuffer`` keeps it
alive) and is contiguous, float32, zero: what ``torch.zeros_like`` would have given.
"""
from __future__ import annotations

import logging
import mmap

import torch

logger = logging.getLogger(__name__)

__all__ = ["HUGE_MIN_BYTES", "zeros_state_like"]

HUGE_PAGE_BYTES = 2 << 20
HUGE_MIN_BYTES = 4 * HUGE_PAGE_BYTES  # smaller arrays span few pages: not worth a mapping
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only


def zeros_state_like(param: torch.Tensor) -> torch.Tensor:
    """A zero float32 tensor of ``param``'s shape, contiguous, on huge pages if it is large."""
    nbytes = param.numel() * 4
    if _ADVICE is None or nbytes < HUGE_MIN_BYTES:
        return torch.zeros(param.shape, dtype=torch.float32)
    length = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    region = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(_ADVICE)
    except OSError as exc:  # THP off or not built: 4 KiB pages, same contents
        logger.debug("huge pages not advised for Adam state: %s", exc)
    # An anonymous mapping is zero-filled; frombuffer keeps `region` alive with the tensor.
    return torch.frombuffer(region, dtype=torch.float32, count=param.numel()).view(param.shape)
