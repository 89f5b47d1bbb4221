"""The flat layout (offload.zero.layout) checked element by element on random models.

For random shapes, param groups, bucket and sub-group sizes and world sizes 1-4, built
once per rank: every element of every parameter is owned by exactly one rank (through its
pieces' ``param_runs``), buckets split evenly into aligned shards, a rank's pieces tile its
sub-groups exactly, and ``param_runs`` never hands out padding.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from csrc import ConfigError
from offload.zero.layout import ALIGN_ELEMENTS, FlatLayout


def _random_params(rng: random.Random) -> list[tuple[str, tuple[int, ...], int]]:
    groups = rng.randint(1, 3)
    out = []
    for i in range(rng.randint(1, 12)):
        shape = tuple(rng.choice([1, 2, 3, 7, 13, 64, 65, 100, 257]) for _ in range(rng.randint(0, 3)))
        out.append((f"p{i}", shape, rng.randrange(groups)))
    return out


CASES = [(seed, world) for seed in range(12) for world in (1, 2, 3, 4)]


@pytest.mark.parametrize("seed,world", CASES)
def test_every_element_has_exactly_one_owner(seed, world):
    rng = random.Random(seed)
    params = _random_params(rng)
    bucket_numel = rng.choice([1, 50, 300, 1000, 10 ** 6])
    sub_group_numel = rng.choice([1, 64, 100, 700, 10 ** 6])
    layouts = [FlatLayout(params, world_size=world, rank=r, bucket_numel=bucket_numel, sub_group_numel=sub_group_numel)
               for r in range(world)]
    owners = [torch.zeros(math.prod(shape), dtype=torch.int32) for _, shape, _ in params]
    for layout in layouts:
        _check_buckets(layout, params, bucket_numel)
        _check_sub_groups(layout)
        for sg in layout.sub_groups:
            for piece in sg.pieces:
                covered = 0
                for slot, param_off, piece_off, n in layout.param_runs(piece):
                    assert slot.offset + param_off == piece.flat_start + piece_off
                    assert 0 <= piece_off and piece_off + n <= piece.numel and slot.group == piece.group
                    owners[slot.index][param_off:param_off + n] += 1
                    covered += n
                assert covered == _param_elements_in(layout, piece.flat_start, piece.flat_start + piece.numel)
    for (name, _, _), count in zip(params, owners):
        assert torch.all(count == 1), f"{name}: elements owned {count.min().item()}..{count.max().item()} times"
    assert len({(lay.total_numel, lay.partition_numel, len(lay.sub_groups)) for lay in layouts}) == 1


def _param_elements_in(layout: FlatLayout, lo: int, hi: int) -> int:
    return sum(max(0, min(hi, s.offset + s.numel) - max(lo, s.offset)) for s in layout.slots)


def _check_buckets(layout: FlatLayout, params, bucket_numel: int) -> None:
    world = layout.world_size
    assert [s.index for s in layout.slots] == list(range(len(params)))
    for slot, (name, shape, group) in zip(layout.slots, params):
        assert (slot.name, slot.shape, slot.numel, slot.group) == (name, shape, math.prod(shape), group)
    start = 0
    for b in layout.buckets:
        assert b.start == start, "buckets are contiguous"
        start += b.numel
        assert b.numel % (world * ALIGN_ELEMENTS) == 0 and b.shard_numel * world == b.numel
        assert b.shard_start(layout.rank) == b.start + layout.rank * b.shard_numel
        members = [layout.slots[i] for i in b.slots]
        assert all(s.group == b.group for s in members)
        used = sum(s.numel for s in members)
        assert b.numel - used < world * ALIGN_ELEMENTS, "padded no further than the next shard unit"
        assert used <= bucket_numel or len(members) == 1, "only a param larger than a bucket overfills one"
        at = b.start
        for s in members:  # packed in order, reverse registration order (backward's order)
            assert s.offset == at
            at += s.numel
        assert [s.index for s in members] == sorted((s.index for s in members), reverse=True)
    assert start == layout.total_numel
    assert sorted(i for b in layout.buckets for i in b.slots) == list(range(len(params)))
    assert layout.partition_numel == sum(b.shard_numel for b in layout.buckets)


def _check_sub_groups(layout: FlatLayout) -> None:
    part = 0
    shard_of = {}
    for b in layout.buckets:  # this rank's partition: its shard of every bucket, in bucket order
        shard_of[b.index] = (part, b.shard_start(layout.rank), b.shard_numel)
        part += b.shard_numel
    at = 0
    for i, sg in enumerate(layout.sub_groups):
        assert sg.index == i and sg.part_start == at and 0 < sg.numel <= layout.sub_group_numel
        assert sg.part_start % ALIGN_ELEMENTS == 0
        at += sg.numel
        sub = 0
        for piece in sg.pieces:  # the pieces tile the sub-group, each inside one shard of this rank
            assert piece.sub_start == sub and piece.part_start == sg.part_start + sub and piece.numel > 0
            sub += piece.numel
            part_start, flat_start, shard_numel = shard_of[piece.bucket]
            assert part_start <= piece.part_start and piece.part_start + piece.numel <= part_start + shard_numel
            assert piece.flat_start == flat_start + (piece.part_start - part_start)
            assert piece.group == layout.buckets[piece.bucket].group
            assert piece.flat_start % ALIGN_ELEMENTS == 0
        assert sub == sg.numel
    assert at == layout.partition_numel


@pytest.mark.parametrize("kwargs,words", [
    ({"world_size": 0, "rank": 0}, "world of 0"),
    ({"world_size": 2, "rank": 2}, "rank 2"),
    ({"bucket_numel": 0}, "bucket"),
    ({"sub_group_numel": 0}, "sub-group"),
])
def test_bad_layout_arguments(kwargs, words):
    args = dict(world_size=1, rank=0, bucket_numel=100, sub_group_numel=100) | kwargs
    with pytest.raises(ConfigError, match=words):
        FlatLayout([("w", (3, 3), 0)], **args)


def test_no_params_is_an_error():
    with pytest.raises(ConfigError, match="no trainable parameters"):
        FlatLayout([], world_size=1, rank=0, bucket_numel=100, sub_group_numel=100)
