"""Where every parameter element lives: one flat buffer, buckets, rank shards, sub-groups.

[Note: flat layout] The model's trainable parameters become views into one flat buffer
per engine (the compute dtype, on the model's device), and their gradients views into a
second. The buffer is cut into buckets of at most ``bucket_numel`` elements; a bucket
holds the parameters of one param group, taken in reverse registration order (the order
in which backward produces their gradients), and is padded so that it splits evenly
into ``world_size`` shards of a multiple of ``ALIGN_ELEMENTS``. Rank r owns shard r of
every bucket: a bucket's gradients are reduce-scattered straight into the owners, and
after the step each bucket is all-gathered back from its shards.

A rank's partition is the concatenation of its shards, bucket after bucket. The
optimizer state (fp32 master, exp_avg, exp_avg_sq) covers the partition and is cut
into sub-groups of at most ``sub_group_numel`` elements: the unit that is stepped,
prefetched and evicted. A ``Piece`` is a run of a sub-group that lies in one bucket
(so in one param group and one contiguous range of the flat buffer).

Stage 3 passes its own ``bucket_plan``: one bucket per unit of parameters gathered
together (``offload.zero.units``), in the order given; the flat buffer is then only an
address space (no process holds it whole), and everything else above holds unchanged.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

from csrc import ConfigError

__all__ = ["ALIGN_ELEMENTS", "Bucket", "FlatLayout", "ParamSlot", "Piece", "SubGroup"]

ALIGN_ELEMENTS = 64  # 256 bytes of fp32: every shard, piece and sub-group starts on a cache-line multiple


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """One trainable parameter: its name, shape and place in the flat buffer."""

    index: int  # position among the model's trainable parameters
    name: str
    shape: tuple[int, ...]
    numel: int
    group: int  # param group index
    offset: int  # first element in the flat buffer


@dataclasses.dataclass(frozen=True)
class Bucket:
    """A contiguous range of the flat buffer that is reduced and gathered as one."""

    index: int
    group: int
    start: int
    numel: int  # padded: a multiple of world_size * ALIGN_ELEMENTS
    slots: tuple[int, ...]  # ParamSlot indexes, in buffer order
    shard_numel: int  # numel // world_size

    def shard_start(self, rank: int) -> int:
        return self.start + rank * self.shard_numel


@dataclasses.dataclass(frozen=True)
class Piece:
    """A run of this rank's partition inside one bucket shard."""

    bucket: int
    group: int
    flat_start: int  # in the flat buffer
    part_start: int  # in this rank's partition
    sub_start: int  # in its sub-group
    numel: int


@dataclasses.dataclass(frozen=True)
class SubGroup:
    """The unit of the optimizer step and of its I/O: a range of this rank's partition."""

    index: int
    part_start: int
    numel: int
    pieces: tuple[Piece, ...]


class FlatLayout:
    """The layout of [Note: flat layout] for one rank."""

    def __init__(self, params: Sequence[tuple[str, tuple[int, ...], int]], *, world_size: int, rank: int,
                 bucket_numel: int, sub_group_numel: int,
                 bucket_plan: Sequence[Sequence[int]] | None = None) -> None:
        """``params``: (name, shape, group) per trainable parameter, in registration order.
        ``bucket_plan``: the param indexes of each bucket, in bucket order (stage 3); each bucket
        in one param group, every param in exactly one bucket. None: cut by ``bucket_numel``."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is not in a world of {world_size}")
        if bucket_numel < 1 or sub_group_numel < 1:
            raise ConfigError(f"bucket and sub-group sizes must be >= 1, got {bucket_numel} and {sub_group_numel}")
        if not params:
            raise ConfigError("the model has no trainable parameters")
        self.world_size = world_size
        self.rank = rank
        self.bucket_numel = bucket_numel
        self.params = [(name, tuple(shape), group) for name, shape, group in params]
        self.sub_group_numel = max(ALIGN_ELEMENTS, sub_group_numel // ALIGN_ELEMENTS * ALIGN_ELEMENTS)
        self.bucket_plan = None if bucket_plan is None else tuple(tuple(b) for b in bucket_plan)
        plan = self._plan_by_size(bucket_numel) if self.bucket_plan is None else self._checked(self.bucket_plan)
        unit = world_size * ALIGN_ELEMENTS
        slots: list[ParamSlot | None] = [None] * len(params)
        buckets: list[Bucket] = []
        start = 0
        for run in plan:
            group = self.params[run[0]][2]
            run_numel = 0
            for i in run:
                name, shape, _ = self.params[i]
                slots[i] = ParamSlot(i, name, shape, _numel(shape), group, start + run_numel)
                run_numel += _numel(shape)
            padded = max(unit, _round_up(run_numel, unit))
            buckets.append(Bucket(len(buckets), group, start, padded, tuple(run), padded // world_size))
            start += padded
        self.slots: list[ParamSlot] = [s for s in slots if s is not None]
        self.buckets = buckets
        self.total_numel = start
        self.partition_numel = sum(b.shard_numel for b in buckets)
        self.sub_groups = self._cut_sub_groups()

    def _plan_by_size(self, bucket_numel: int) -> list[list[int]]:
        """Per param group, params in reverse registration order, cut at ``bucket_numel``."""
        plan: list[list[int]] = []
        for group in sorted({g for _, _, g in self.params}):
            run: list[int] = []
            run_numel = 0
            for i in reversed(range(len(self.params))):
                if self.params[i][2] != group:
                    continue
                numel = _numel(self.params[i][1])
                if run and run_numel + numel > bucket_numel:
                    plan.append(run)
                    run, run_numel = [], 0
                run.append(i)
                run_numel += numel
            if run:
                plan.append(run)
        return plan

    def _checked(self, plan: Sequence[Sequence[int]]) -> list[list[int]]:
        seen = sorted(i for run in plan for i in run)
        if seen != list(range(len(self.params))) or any(not run for run in plan):
            raise ConfigError("a bucket plan must place every parameter in exactly one non-empty bucket")
        for run in plan:
            if len({self.params[i][2] for i in run}) != 1:
                raise ConfigError(f"bucket {list(run)} mixes param groups")
        return [list(run) for run in plan]

    def _cut_sub_groups(self) -> list[SubGroup]:
        shards = []  # (part_start, bucket) in partition order
        part = 0
        for b in self.buckets:
            shards.append((part, b))
            part += b.shard_numel
        out: list[SubGroup] = []
        first = 0  # the first shard that may reach into this sub-group: shards and sub-groups both ascend
        for sg_start in range(0, self.partition_numel, self.sub_group_numel):
            sg_end = min(sg_start + self.sub_group_numel, self.partition_numel)
            while first < len(shards) and shards[first][0] + shards[first][1].shard_numel <= sg_start:
                first += 1
            pieces = []
            for i in range(first, len(shards)):
                part_start, b = shards[i]
                if part_start >= sg_end:
                    break
                lo, hi = max(sg_start, part_start), min(sg_end, part_start + b.shard_numel)
                if lo < hi:
                    flat = b.shard_start(self.rank) + (lo - part_start)
                    pieces.append(Piece(b.index, b.group, flat, lo, lo - sg_start, hi - lo))
            out.append(SubGroup(len(out), sg_start, sg_end - sg_start, tuple(pieces)))
        return out

    def param_runs(self, piece: Piece) -> Iterator[tuple[ParamSlot, int, int, int]]:
        """The parameter data in a piece (padding skipped): (slot, offset in the flattened
        param, offset in the piece, length)."""
        bucket = self.buckets[piece.bucket]
        lo, hi = piece.flat_start, piece.flat_start + piece.numel
        for i in bucket.slots:
            slot = self.slots[i]
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if a < b:
                yield slot, a - slot.offset, a - lo, b - a

    def for_rank(self, rank: int) -> "FlatLayout":
        """The same layout as another rank sees it (its partition and sub-groups)."""
        return FlatLayout(self.params, world_size=self.world_size, rank=rank, bucket_numel=self.bucket_numel,
                          sub_group_numel=self.sub_group_numel, bucket_plan=self.bucket_plan)

    def describe(self) -> str:
        return (f"{len(self.slots)} params, {self.total_numel} elements in {len(self.buckets)} bucket(s); "
                f"rank {self.rank}/{self.world_size} owns {self.partition_numel} in "
                f"{len(self.sub_groups)} sub-group(s) of <= {self.sub_group_numel}")


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
