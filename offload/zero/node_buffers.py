"""The flat buffers of ranks that share one node, in shared memory: one param buffer for all of
them, and every rank's gradient buffer readable by the others.

[Note: node-shared buffers]
Stages 1-2 on the CPU move the whole model twice per step through the process group: each
rank's gradient buffer is reduce-scattered (every rank gets the sum of its shard), and after
the step the updated shards are all-gathered into every rank's copy of the params. With gloo
both go through the loopback TCP stack (a kernel copy each way, a gloo thread competing with
the ranks for the cores, fresh pages for the shard copies); on the 2-core bench that was half
a second of a two-rank step more than DeepSpeed's (``tools/bench/results/contention_*``).

When every rank of the group can open one file in ``/dev/shm`` (the same node), the buffers
live there instead:
- gradients: each rank's flat gradient buffer is its slice of the file. After backward, a
  barrier; then each rank sums its own shard of every bucket over the ranks' buffers, in rank
  order (for two ranks ``a + b``, the bits gloo's sum gives), lands it, and zeroes that shard
  in every rank's buffer (it is the shard's only reader); a second barrier before anyone's
  next backward writes there again.
- params: the ranks' models are views of one buffer. Each rank's step writes its own shard's
  updated params into it; a barrier at the step's end stands in for the all-gather. No rank
  writes params before the first barrier of the step's backward has seen every rank finish
  reading them, and no rank reads them in the next forward before the second.
At start-up each rank writes its own shard of its initial params (what its master holds), so
the buffer holds what the all-gather after a first step would have.

The file is unlinked once every rank has mapped it (nothing is left behind if a rank dies);
space is reserved with ``posix_fallocate`` so a full ``/dev/shm`` is an error at start, not a
SIGBUS later. Where any rank cannot open it, or ``offload.node_shared_buffers`` is false, the
ranks use the process group as before.
"""
from __future__ import annotations

import logging
import mmap
import os
import secrets
from typing import Sequence

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

__all__ = ["NodeBuffers", "open_node_buffers"]

SHM_DIR = "/dev/shm"
_ALIGN = 4096


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


class NodeBuffers:
    """One mapping of the shared file: the param buffer and every rank's gradient buffer."""

    def __init__(self, mapped: mmap.mmap, numel: int, dtype: torch.dtype, rank: int, world: int,
                 group: dist.ProcessGroup | None) -> None:
        self._map = mapped
        self.rank, self.world, self.group = rank, world, group
        item = torch.empty(0, dtype=dtype).element_size()
        span = _aligned(numel * item)
        whole = torch.frombuffer(mapped, dtype=torch.uint8)
        self.params = whole[:numel * item].view(dtype)
        self.grads: list[torch.Tensor] = [whole[span * (1 + r):span * (1 + r) + numel * item].view(dtype)
                                          for r in range(world)]
        """Every rank's flat gradient buffer, in rank order; ``grads[rank]`` is this rank's."""

    def barrier(self) -> None:
        """Every rank of the group has reached this point."""
        dist.barrier(group=self.group)

    def reduce_shard(self, start: int, numel: int, out: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks' buffers of ``[start, start + numel)``, in rank order, into ``out``;
        then that range zeroed in every buffer (the caller is its only reader: between barriers)."""
        views = [g[start:start + numel] for g in self.grads]
        torch.add(views[0], views[1], out=out)
        for v in views[2:]:
            out.add_(v)
        for v in views:
            v.zero_()
        return out


def open_node_buffers(numel: int, dtype: torch.dtype, *, group: dist.ProcessGroup | None,
                      rank: int, world: int) -> NodeBuffers | None:
    """Map one shared file holding a param buffer and ``world`` gradient buffers of ``numel``
    elements each, if every rank of ``group`` can (the same node); else None on every rank.
    Collective: every rank of the group calls it."""
    item = torch.empty(0, dtype=dtype).element_size()
    nbytes = _aligned(numel * item) * (1 + world)
    name, fd, why = "", -1, ""
    if rank == 0:
        name = os.path.join(SHM_DIR, f"offload-ranks-{os.getpid()}-{secrets.token_hex(6)}")
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            why = f"cannot make {name} of {nbytes} bytes: {e}"
            if fd >= 0:
                os.close(fd)
                fd = -1
                _unlink(name)
            name = ""
    names = [name]
    dist.broadcast_object_list(names, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    name = names[0]
    if rank != 0 and name:
        try:
            fd = os.open(name, os.O_RDWR)
            if os.fstat(fd).st_size != nbytes:
                raise OSError(f"{name} is {os.fstat(fd).st_size} bytes, not {nbytes}: another node's file")
        except OSError as e:
            why = str(e)
            if fd >= 0:
                os.close(fd)
            fd = -1
    mapped = None
    if fd >= 0:
        try:
            mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        except OSError as e:
            why = f"cannot map {name}: {e}"
        finally:
            os.close(fd)
    ok = torch.tensor([1 if mapped is not None else 0], dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # also: every rank has mapped it, or given up
    if rank == 0 and name:
        _unlink(name)
    if not int(ok.item()):
        if mapped is not None:
            mapped.close()
        logger.info("rank %d: gradients and params go through the process group (%s)", rank,
                    why or "another rank could not map the node's shared buffers")
        return None
    logger.info("rank %d: the %d ranks share the param buffer and read each other's gradients in %d bytes of "
                "shared memory ([Note: node-shared buffers])", rank, world, nbytes)
    return NodeBuffers(mapped, numel, dtype, rank, world, group)


def write_own_shards(buffers: NodeBuffers, ranges: Sequence[tuple[int, int]], source: torch.Tensor) -> None:
    """This rank's shards ``(start, numel)`` of ``source`` (its own flat params) into the shared
    param buffer, then a barrier: every shard is there before anyone reads."""
    for start, numel in ranges:
        buffers.params[start:start + numel].copy_(source[start:start + numel])
    buffers.barrier()


def _unlink(name: str) -> None:
    try:
        os.unlink(name)
    except FileNotFoundError:
        pass
