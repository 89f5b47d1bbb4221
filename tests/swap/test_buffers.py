"""The shared-memory host pool: alignment, sharing through the memfd, accounting, limits."""
from __future__ import annotations

import mmap
import os

import pytest

from csrc import ConfigError, TierFullError
from swap import HostPool, HostPoolConfig


@pytest.fixture
def pool():
    p = HostPool(HostPoolConfig(capacity_bytes=4 << 20, segment_bytes=1 << 20))
    yield p
    p.close()


def test_segments_are_memfds_of_the_configured_size(pool):
    assert [s.index for s in pool.segments] == [0, 1, 2, 3]
    for s in pool.segments:
        assert s.nbytes == 1 << 20
        assert os.fstat(s.fd).st_size == 1 << 20
        assert os.readlink(f"/proc/self/fd/{s.fd}").startswith("/memfd:ofl-pool")
        assert s.address % mmap.PAGESIZE == 0


def test_blocks_are_aligned_padded_and_accounted(pool):
    a = pool.allocate(1)
    b = pool.allocate(4097)
    assert a.nbytes == 4096 and b.nbytes == 8192
    assert pool.address(a) % 4096 == 0 and pool.address(b) % 4096 == 0
    assert pool.used_bytes == 4096 + 8192
    pool.free(a)
    pool.free(b)
    assert pool.used_bytes == 0


def test_a_block_is_visible_through_the_memfd_as_another_process_would_see_it(pool):
    block = pool.allocate(10_000)
    pool.view(block)[:5] = b"hello"
    seg = pool.segments[block.segment_index]
    other = mmap.mmap(seg.fd, seg.nbytes)  # what a client mapping the passed fd sees
    try:
        assert other[block.offset:block.offset + 5] == b"hello"
    finally:
        other.close()


def test_full_and_oversized_requests_are_clear_errors(pool):
    with pytest.raises(TierFullError, match="more than one segment holds"):
        pool.allocate((1 << 20) + 1, "region 'big'")
    blocks = [pool.allocate(1 << 20) for _ in range(4)]
    with pytest.raises(TierFullError, match="region 'x'.*0 of 4194304 bytes free"):
        pool.allocate(1, "region 'x'")
    for b in blocks:
        pool.free(b)


def test_slots_pad_every_block_so_freed_ones_fit_any_other():
    """slot_bytes: every block takes a whole slot, so blocks of two sizes never leave holes too short.
    With plain 4 KiB padding this order ends with 24 KiB free (8 + 16) and no run of 24 KiB for s3."""
    kib = 1024
    pool = HostPool(HostPoolConfig(capacity_bytes=4 * 24 * kib, slot_bytes=24 * kib))
    try:
        held = {name: pool.allocate(size * kib) for name, size in (("s1", 24), ("s2", 24), ("g1", 16), ("g2", 16))}
        assert {b.nbytes for b in held.values()} == {24 * kib}
        pool.free(held.pop("s1"))
        held["g3"] = pool.allocate(16 * kib)
        pool.free(held.pop("g1"))
        held["s3"] = pool.allocate(24 * kib)
        assert pool.used_bytes == 4 * 24 * kib
    finally:
        pool.close()


@pytest.mark.parametrize("kwargs,field", [
    (dict(capacity_bytes=0), "capacity_bytes"),
    (dict(capacity_bytes=8192, segment_bytes=1000), "segment_bytes"),
    (dict(capacity_bytes=3 * 4096, segment_bytes=8192), "capacity_bytes"),
    (dict(capacity_bytes=8192, slot_bytes=1000), "slot_bytes"),
])
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        HostPoolConfig(**kwargs)


def _resident_bytes(name: str) -> dict[str, int]:
    """Rss of each memfd mapping whose name contains ``name``, from /proc/self/smaps."""
    out, current = {}, None
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                current = next((x for x in fields if x.startswith("/memfd:") and name in x), None)
            elif current and fields[0] == "Rss:":
                out[current] = int(fields[1]) * 1024
    return out


@pytest.mark.parametrize("pretouch", [True, False])
def test_pretouch_makes_every_page_resident(pretouch):
    name = f"ofl-touch-{int(pretouch)}"
    with HostPool(HostPoolConfig(capacity_bytes=8 << 20, segment_bytes=4 << 20, pretouch=pretouch, name=name)):
        rss = _resident_bytes(name)
        assert len(rss) == 2
        assert all(v == (4 << 20 if pretouch else 0) for v in rss.values()), rss
