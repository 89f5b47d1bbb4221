"""The extent allocator against a byte-map oracle."""
from __future__ import annotations

import random

import pytest

from csrc import ConfigError
from swap import ExtentAllocator, align_up

ALIGN = 4096


def test_random_allocate_free_matches_a_byte_map_oracle():
    rng = random.Random(1234)
    units = 256
    alloc = ExtentAllocator(units * ALIGN, ALIGN)
    owner = [None] * units  # the oracle: who holds each 4 KiB unit
    live: dict[int, int] = {}
    for step in range(3000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            alloc.free(off)
            for u in range(off // ALIGN, (off + live.pop(off)) // ALIGN):
                owner[u] = None
        else:
            n = rng.randint(1, 24 * ALIGN)
            size = align_up(n, ALIGN)
            off = alloc.allocate(n)
            # first fit: the oracle's first free run that is long enough
            need = size // ALIGN
            expect = None
            run = 0
            for u in range(units):
                run = run + 1 if owner[u] is None else 0
                if run == need:
                    expect = (u - need + 1) * ALIGN
                    break
            assert off == expect, f"step {step}"
            if off is not None:
                assert off % ALIGN == 0
                for u in range(off // ALIGN, off // ALIGN + need):
                    assert owner[u] is None
                    owner[u] = off
                live[off] = size
        assert alloc.used_bytes == sum(live.values())
        runs = alloc.free_runs()
        for (a, la), (b, _) in zip(runs, runs[1:]):
            assert a + la < b, "free runs must be coalesced (never touching)"


def test_freeing_everything_coalesces_to_one_run():
    alloc = ExtentAllocator(64 * ALIGN, ALIGN)
    offs = [alloc.allocate(ALIGN * (i % 3 + 1)) for i in range(10)]
    for off in offs[::2] + offs[1::2]:
        alloc.free(off)
    assert alloc.free_runs() == [(0, 64 * ALIGN)]
    assert alloc.used_bytes == 0


def test_full_returns_none_and_bad_free_is_an_error():
    alloc = ExtentAllocator(4 * ALIGN, ALIGN)
    assert alloc.allocate(4 * ALIGN) == 0
    assert alloc.allocate(1) is None
    with pytest.raises(ConfigError, match="offset 4096"):
        alloc.free(ALIGN)
    with pytest.raises(ConfigError, match="capacity_bytes"):
        ExtentAllocator(ALIGN + 1, ALIGN)
