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


def test_take_marks_a_given_extent_held_and_only_a_free_one():
    """What an adopter does with a predecessor's extents (issue 42): the run around it stays free, in order."""
    a = ExtentAllocator(64 * 4096, 4096)
    a.take(8 * 4096, 3 * 4096)
    assert a.free_runs() == [(0, 8 * 4096), (11 * 4096, 53 * 4096)] and a.used_bytes == 3 * 4096
    a.take(0, 5000)  # rounded up to two pages, at the start of the first run
    assert a.free_runs() == [(2 * 4096, 6 * 4096), (11 * 4096, 53 * 4096)]
    for offset, nbytes in ((9 * 4096, 4096), (7 * 4096, 2 * 4096), (100, 4096), (63 * 4096, 2 * 4096)):
        with pytest.raises(ConfigError):
            a.take(offset, nbytes)  # held, overlapping a held one, unaligned, past the end
    a.free(8 * 4096)  # merges with the free runs on both sides
    assert a.free_runs() == [(2 * 4096, 62 * 4096)]
    assert a.allocate(3 * 4096) == 2 * 4096  # first fit as usual
    assert a.free_runs() == [(5 * 4096, 59 * 4096)] and a.used_bytes == 5 * 4096
