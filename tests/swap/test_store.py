"""TierStore: states, the dirty rule, bytes on disk against Python reads, stats, sharing."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading

import pytest

from csrc import ConfigError, TierFullError
from swap import (HostPool, HostPoolConfig, IoEngineConfig, SwapSpace, SwapSpaceConfig, Tier, TierStore,
                  TierStoreConfig, open_engine)

from tests.swap.conftest import make_engine

LENGTHS = [1, 4095, 4096, 4097, (1 << 20) + 3, 64 << 20]


@contextlib.contextmanager
def _make_store(engine, dirs, *, host_bytes=160 << 20, swap_bytes=192 << 20, **config):
    """A store over its own pool and space (closed on exit) and the given engine."""
    pool = HostPool(HostPoolConfig(capacity_bytes=host_bytes))
    space = SwapSpace(SwapSpaceConfig(paths=[str(d) for d in dirs], capacity_bytes=swap_bytes,
                                      stripe_bytes=256 << 10), engine=engine)
    store = TierStore(TierStoreConfig(chunk_bytes=1 << 20, **config), pool=pool, space=space, engine=engine)
    try:
        yield store
    finally:
        store.close()
        space.close()
        pool.close()


@pytest.fixture(params=[1, 3], ids=["one_path", "striped_3"])
def store(request, engine, tmp_path):
    dirs = [tmp_path / f"d{i}" for i in range(request.param)]
    for d in dirs:
        d.mkdir()
    with _make_store(engine, dirs) as s:
        yield s


def _fill(store, lengths, prefix="r"):
    data = {}
    for i, n in enumerate(lengths):
        name = f"{prefix}{i}"
        store.allocate(name, n)
        payload = os.urandom(n)
        store.host_view(name)[:] = payload
        data[name] = payload
    return data


def _read_from_disk(store, name, nbytes):
    """The region's bytes as plain Python file reads see them, placement by placement."""
    out = bytearray()
    for p in store.placements(name):
        with open(store.space.files[p.file_index].path, "rb") as f:
            f.seek(p.file_offset)
            out += f.read(p.nbytes)
    return bytes(out[:nbytes])


def test_evicted_bytes_read_back_with_python_and_prefetch(store):
    data = _fill(store, LENGTHS)  # back to back: extents abut, chunks cross stripe and block boundaries
    store.wait_for_evict(store.evict(list(data)))
    for name, payload in data.items():
        assert store.info(name).tier == Tier.NVME
        assert _read_from_disk(store, name, len(payload)) == payload, name
    store.wait_for_prefetch(store.prefetch(list(data)))
    for name, payload in data.items():
        assert store.info(name).tier == Tier.HOST_AND_NVME
        assert bytes(store.host_view(name)) == payload, name


def test_python_written_swap_bytes_are_what_prefetch_returns(engine, tmp_path):
    with _make_store(engine, [tmp_path], checksum="none") as store:
        data = _fill(store, LENGTHS)
        store.wait_for_evict(store.evict(list(data)))
        fresh = {}
        for name, payload in data.items():  # overwrite each region on disk with plain Python writes
            new = os.urandom(len(payload))
            fresh[name] = new
            pos = 0
            for p in store.placements(name):
                with open(store.space.files[p.file_index].path, "r+b") as f:
                    f.seek(p.file_offset)
                    f.write(new[pos:pos + p.nbytes])
                    f.flush()
                    os.fsync(f.fileno())
                pos += p.nbytes
        store.wait_for_prefetch(store.prefetch(list(data)))
        for name, new in fresh.items():
            assert bytes(store.host_view(name)) == new, name


def test_states_and_the_dirty_rule(store):
    store.allocate("a", 10_000)
    store.host_view("a")[:] = b"\x01" * 10_000
    assert store.info("a").tier == Tier.HOST
    h = store.evict(["a"])
    assert store.info("a").tier == Tier.IN_FLIGHT
    with pytest.raises(ConfigError, match="'a' has no host copy.*in_flight"):
        store.host_view("a")
    store.wait_for_evict(h)
    info = store.info("a")
    assert (info.tier, info.segment_index, info.offset) == (Tier.NVME, None, None)
    with pytest.raises(ConfigError, match="prefetch it"):
        store.host_view("a")
    store.wait_for_prefetch(store.prefetch(["a"]))
    written = store.engine.stats()["bytes_written"]
    store.wait_for_evict(store.evict(["a"]))  # clean: nothing to write
    assert store.engine.stats()["bytes_written"] == written
    assert store.info("a").tier == Tier.NVME
    store.wait_for_prefetch(store.prefetch(["a"]))
    store.host_view("a")[:3] = b"xyz"
    store.mark_dirty("a")
    assert store.info("a").tier == Tier.HOST
    store.wait_for_evict(store.evict(["a"]))
    assert store.engine.stats()["bytes_written"] == written + 12288
    store.wait_for_prefetch(store.prefetch(["a"]))
    assert bytes(store.host_view("a")[:4]) == b"xyz\x01"


def test_stats_follow_the_tiers(store):
    store.allocate("a", 1 << 20)
    store.allocate("b", 3 << 20)
    s = store.stats()
    assert (s.regions, s.host_bytes, s.nvme_bytes, s.dirty_bytes) == (2, 4 << 20, 0, 4 << 20)
    assert s.host_pool_used_bytes == 4 << 20
    h = store.evict(["b"])
    assert store.stats().in_flight_bytes == 3 << 20
    store.wait_for_evict(h)
    s = store.stats()
    assert (s.host_bytes, s.nvme_bytes, s.in_flight_bytes) == (1 << 20, 3 << 20, 0)
    assert s.swap_used_bytes == 3 << 20 and s.host_pool_used_bytes == 1 << 20
    assert s.bytes_written_total == 3 << 20 and s.write_bandwidth_bytes_per_second > 0
    assert s.engine == store.engine.name
    store.free("b")
    store.free("a")
    s = store.stats()
    assert (s.regions, s.swap_used_bytes, s.host_pool_used_bytes) == (0, 0, 0)


def test_flush_writes_dirty_regions_and_keeps_host_copies(store):
    data = _fill(store, [5000, 70_000])
    store.flush()
    for name, payload in data.items():
        assert store.info(name).tier == Tier.HOST_AND_NVME
        assert _read_from_disk(store, name, len(payload)) == payload


def test_free_while_in_flight_waits_then_releases(store):
    _fill(store, [8 << 20])
    store.evict(["r0"])
    store.free("r0")
    assert store.stats().swap_used_bytes == 0 and store.stats().host_pool_used_bytes == 0
    with pytest.raises(ConfigError, match="no region named 'r0'"):
        store.info("r0")


def test_verb_on_a_pending_region_settles_it_first(store):
    data = _fill(store, [2 << 20])
    h = store.evict(["r0"])
    h2 = store.prefetch(["r0"])  # waits for the evict, then reads it back
    store.wait_for_evict(h)
    store.wait_for_prefetch(h2)
    assert bytes(store.host_view("r0")) == data["r0"]


def test_two_threads_waiting_on_one_handle(store):
    data = _fill(store, [24 << 20])
    h = store.evict(["r0"])
    errors = []

    def waiter():
        try:
            store.wait_for_evict(h)
        except BaseException as exc:  # noqa: BLE001 - collected for the assert
            errors.append(exc)

    threads = [threading.Thread(target=waiter) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and h.done()
    store.wait_for_prefetch(store.prefetch(["r0"]))  # checksums taken once per chunk, so this verifies
    assert bytes(store.host_view("r0")) == data["r0"]


def test_prefetch_without_host_room_changes_nothing(engine, tmp_path):
    with _make_store(engine, [tmp_path], host_bytes=1 << 20) as store:
        data = _fill(store, [1 << 20])
        store.wait_for_evict(store.evict(["r0"]))
        store.allocate("hog", 4096)
        with pytest.raises(TierFullError, match="prefetch of region 'r0'"):
            store.prefetch(["r0"])
        assert store.info("r0").tier == Tier.NVME
        store.free("hog")
        store.wait_for_prefetch(store.prefetch(["r0"]))
        assert bytes(store.host_view("r0")) == data["r0"]


def test_timeout_leaves_the_transfer_running(tmp_path):
    with make_engine("threads", block_size_bytes=4096, queue_depth=1, num_threads=1) as engine:
        with _make_store(engine, [tmp_path]) as store:
            data = _fill(store, [32 << 20])
            h = store.evict(["r0"])
            with pytest.raises(TimeoutError, match="r0"):
                store.wait_for_evict(h, timeout_seconds=0)
            store.wait_for_evict(h)
            store.wait_for_prefetch(store.prefetch(["r0"]))
            assert bytes(store.host_view("r0")) == data["r0"]


def test_wrong_handle_and_names_are_config_errors(store):
    store.allocate("a", 4096)
    h = store.evict(["a"])
    with pytest.raises(ConfigError, match="prefetch"):
        store.wait_for_prefetch(h)
    store.wait_for_evict(h)
    with pytest.raises(ConfigError, match="already exists"):
        store.allocate("a", 1)
    with pytest.raises(ConfigError, match="no region named 'zz'"):
        store.prefetch(["zz"])
    with pytest.raises(ConfigError, match="nbytes"):
        store.allocate("b", 0)


def test_two_stores_share_one_space_and_engine(engine, tmp_path):
    space = SwapSpace(SwapSpaceConfig(paths=[str(tmp_path)], capacity_bytes=8 << 20), engine=engine)
    pools = [HostPool(HostPoolConfig(capacity_bytes=4 << 20)) for _ in range(2)]
    stores = [TierStore(TierStoreConfig(), pool=p, space=space, engine=engine) for p in pools]
    try:
        payloads = []
        for s in stores:
            s.allocate("x", 3 << 20)
            payloads.append(os.urandom(3 << 20))
            s.host_view("x")[:] = payloads[-1]
        for s in stores:
            s.wait_for_evict(s.evict(["x"]))
        assert space.used_bytes == 6 << 20
        for s, payload in zip(stores, payloads):
            s.wait_for_prefetch(s.prefetch(["x"]))
            assert bytes(s.host_view("x")) == payload
    finally:
        for s in stores:
            s.close()
        space.close()
        for p in pools:
            p.close()


def test_create_owns_its_parts(tmp_path):
    store = TierStore.create(host_capacity_bytes=4 << 20, swap_paths=[str(tmp_path)], swap_capacity_bytes=4 << 20)
    path = store.space.files[0].path
    store.allocate("a", 100)
    store.close()
    assert not os.path.exists(path)
    with pytest.raises(ConfigError, match="closed"):
        store.info("a")


def test_store_on_tmpfs_with_the_engine_auto_picks():
    """/dev/shm is tmpfs: older kernels refuse O_DIRECT there (auto then picks threads),
    newer ones take it; either way the bytes must come back."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    directory = tempfile.mkdtemp(prefix="ofl-test-", dir="/dev/shm")
    engine = open_engine(IoEngineConfig(probe_paths=[directory], block_size_bytes=64 << 10))
    try:
        assert engine.name in ("io_uring", "linux_aio", "threads") and engine.reason
        with _make_store(engine, [directory], host_bytes=8 << 20, swap_bytes=8 << 20) as store:
            data = _fill(store, [1, 4097, (1 << 20) + 3])
            store.wait_for_evict(store.evict(list(data)))
            store.wait_for_prefetch(store.prefetch(list(data)))
            for name, payload in data.items():
                assert bytes(store.host_view(name)) == payload
    finally:
        engine.close()
        shutil.rmtree(directory, ignore_errors=True)


def test_store_registers_its_pool_with_io_uring_and_lets_go_at_close(tmp_path):
    with make_engine("io_uring") as engine:
        with _make_store(engine, [tmp_path], host_bytes=4 << 20, swap_bytes=4 << 20) as store:
            if store._buffer_slots == [None] and os.geteuid() != 0:
                pytest.skip("the memlock limit refuses pinning the pool here")
            assert store._buffer_slots == [0]
            data = _fill(store, [(1 << 20) + 3])
            store.wait_for_evict(store.evict(["r0"]))
            store.wait_for_prefetch(store.prefetch(["r0"]))
            assert bytes(store.host_view("r0")) == data["r0"]
            assert engine.stats()["blocks_registered"] >= 2 * 5  # 1 MiB + 3 is 5 blocks of 256 KiB each way
        # closed: the slot is free for the next store
        with _make_store(engine, [tmp_path], host_bytes=4 << 20, swap_bytes=4 << 20) as again:
            assert again._buffer_slots == [0]


def test_host_only_store_keeps_regions_in_memory_and_refuses_evict():
    """With no swap paths the store is host only (offload_optimizer: cpu): the verbs that need no
    disk work, and an evict is a ConfigError naming the region rather than a crash or a silent drop."""
    with TierStore.create(host_capacity_bytes=1 << 20, swap_paths=[], swap_capacity_bytes=0) as store:
        assert store.space is None and store.engine is None
        store.allocate("m", 8192)
        payload = os.urandom(8192)
        store.host_view("m")[:] = payload
        store.wait_for_prefetch(store.prefetch(["m"]))  # nothing on disk to read
        store.flush()  # nothing to write
        with pytest.raises(ConfigError, match="'m'.*host only"):
            store.evict(["m"])
        assert bytes(store.host_view("m")) == payload
        stats = store.stats()
        assert (stats.host_bytes, stats.nvme_bytes, stats.swap_capacity_bytes, stats.engine) == (8192, 0, 0, "none")
        store.free("m")
        assert store.stats().host_pool_used_bytes == 0
