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


# ---- private pools ([Note: private pools]) ----

def _child_reads(address: int, nbytes: int) -> tuple[int | None, bytes]:
    """Fork; the child reads ``nbytes`` at ``address`` and sends them back. (exit signal or None, bytes)."""
    import ctypes
    import signal

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery, only the read (and no fault report of it)
        import faulthandler

        faulthandler.disable()
        os.close(r)
        try:
            os.write(w, ctypes.string_at(address, nbytes))
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        got = f.read()
    _, status = os.waitpid(pid, 0)
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    assert sig in (None, signal.SIGSEGV, signal.SIGBUS)
    return sig, got


@pytest.mark.parametrize("shared", [True, False])
def test_a_private_pool_is_not_inherited_by_a_fork_and_a_shared_one_is(shared):
    """A forked child (a DataLoader worker) sees the shared pool's bytes; the private pool is not mapped
    in it at all (MADV_DONTFORK: no copy-on-write share of the parent's buffers)."""
    with HostPool(HostPoolConfig(capacity_bytes=8 << 20, segment_bytes=4 << 20, shared=shared)) as pool:
        block = pool.allocate(4096)
        payload = os.urandom(4096)
        pool.view(block)[:] = payload
        assert (pool.segments[0].fd is not None) == shared
        sig, got = _child_reads(pool.address(block), 4096)
        if shared:
            assert sig is None and got == payload
        else:
            assert sig is not None and got == b""
        assert bytes(pool.view(block)) == payload  # the parent's bytes whatever the child did


def test_a_private_pool_is_resident_when_pretouched_and_its_released_pages_read_zero():
    with HostPool(HostPoolConfig(capacity_bytes=8 << 20, segment_bytes=4 << 20, shared=False)) as pool:
        seg = pool.segments[0]
        assert _rss_of(seg.address) >= 4 << 20  # MADV_POPULATE_WRITE (or a write per page)
        block = pool.allocate(1 << 20)
        pool.view(block)[:] = b"\x5a" * (1 << 20)
        seg.release_pages()
        assert bytes(pool.view(block)) == bytes(1 << 20)


def _rss_of(address: int, field: str = "Rss:") -> int:
    """``field`` in bytes of the mapping that holds ``address`` (/proc/self/smaps)."""
    current = False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            current = lo <= address < hi
        elif current and fields[0] == field:
            return int(fields[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def _anon_thp() -> str:
    try:
        return open("/sys/kernel/mm/transparent_hugepage/enabled").read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "absent"


@pytest.mark.skipif(_anon_thp() not in ("always", "madvise"), reason="anonymous THP is off on this kernel")
def test_a_private_pool_takes_anonymous_huge_pages_where_shared_memory_has_none():
    with HostPool(HostPoolConfig(capacity_bytes=16 << 20, segment_bytes=16 << 20, shared=False,
                                 huge_pages="thp")) as pool:
        seg = pool.segments[0]
        assert seg.huge == "thp"
        assert _rss_of(seg.address, "AnonHugePages:") > 0


def test_huge_page_modes_of_a_private_pool_read_the_anonymous_memory_setting(tmp_path, monkeypatch):
    from swap import buffers

    anon, shmem = tmp_path / "enabled", tmp_path / "shmem_enabled"
    monkeypatch.setattr(buffers, "_ANON_THP", str(anon))
    monkeypatch.setattr(buffers, "_SHMEM_THP", str(shmem))
    monkeypatch.setattr(buffers, "_meminfo", lambda: {})  # no hugetlb pages reserved
    anon.write_text("always [madvise] never\n")
    shmem.write_text("always within_size advise [never] deny force\n")
    assert buffers.resolve_huge_pages("auto", 1 << 30, 1 << 21, shared=False)[0] == "thp"
    huge, why = buffers.resolve_huge_pages("auto", 1 << 30, 1 << 21, shared=True)
    assert huge == "off" and f"shared-memory THP is 'never' in {shmem}; 'advise' there would give" in why
    anon.write_text("always madvise [never]\n")
    assert buffers.resolve_huge_pages("auto", 1 << 30, 1 << 21, shared=False)[0] == "off"
    with pytest.raises(ConfigError, match="anonymous-memory THP is 'never'"):
        buffers.resolve_huge_pages("thp", 1 << 30, 1 << 21, shared=False)


def test_the_embedded_store_is_private_where_that_gets_huge_pages_else_shared(tmp_path, monkeypatch):
    from swap import TierStore, buffers

    anon = tmp_path / "enabled"
    monkeypatch.setattr(buffers, "_ANON_THP", str(anon))
    monkeypatch.setattr(buffers, "_meminfo", lambda: {})
    anon.write_text("always madvise [never]\n")
    assert buffers.embedded_pool_config(8 << 20, 4 << 20, None).shared is True  # 4 KiB private pages step slower
    assert buffers.embedded_pool_config(8 << 20, 4 << 20, None, huge_pages="off").shared is True
    anon.write_text("always [madvise] never\n")
    cfg = buffers.embedded_pool_config(8 << 20, 4 << 20, 8192)
    assert (cfg.shared, cfg.huge_pages, cfg.slot_bytes) == (False, "auto", 8192)

    store = TierStore.create(host_capacity_bytes=8 << 20, swap_paths=[str(tmp_path)], swap_capacity_bytes=16 << 20,
                             segment_bytes=4 << 20)
    try:
        assert store.pool.config.shared is False and all(s.fd is None for s in store.pool.segments)
        store.allocate("x", 1 << 20)
        payload = os.urandom(1 << 20)
        store.host_view("x")[:] = payload
        store.mark_dirty("x")
        store.wait_for_evict(store.evict(["x"]))
        store.wait_for_prefetch(store.prefetch(["x"]))
        assert bytes(store.host_view("x")) == payload  # through NVMe into private memory and back
    finally:
        store.close()


def _free_hugetlb_bytes() -> int:
    info = {line.split(":")[0]: line.split()[1] for line in open("/proc/meminfo")}
    return int(info.get("HugePages_Free", 0)) * int(info.get("Hugepagesize", 2048)) * 1024


@pytest.mark.skipif(_free_hugetlb_bytes() < 16 << 20,
                    reason="fewer than 16 MiB of huge pages reserved (vm.nr_hugepages)")
def test_a_private_pool_on_reserved_huge_pages():
    before = _free_hugetlb_bytes()
    with HostPool(HostPoolConfig(capacity_bytes=8 << 20, segment_bytes=4 << 20, shared=False,
                                 huge_pages="hugetlb")) as pool:
        assert all(seg.huge == "hugetlb" and seg.fd is None for seg in pool.segments)
        assert _rss_of(pool.segments[0].address, "KernelPageSize:") > 4096
        assert _free_hugetlb_bytes() <= before - (8 << 20)  # the pool's pages came from the reserve
        block = pool.allocate(3 << 20)
        payload = os.urandom(3 << 20)
        pool.view(block)[:] = payload
        assert bytes(pool.view(block)) == payload
