"""Faults: a full file system, a flipped byte, a truncated or deleted swap file, a full
swap space. Each must give its clear error and lose nothing that was in host memory."""
from __future__ import annotations

import errno
import os

import pytest

from csrc import ChecksumError, SwapIOError, TierFullError
from swap import HostPool, HostPoolConfig, SwapSpace, SwapSpaceConfig, Tier, TierStore, TierStoreConfig

from tests.swap.conftest import file_size_limit


@pytest.fixture
def parts(engine):
    made = []

    def build(path, *, swap_bytes=32 << 20, preallocate=True, **config):
        pool = HostPool(HostPoolConfig(capacity_bytes=32 << 20))
        space = SwapSpace(SwapSpaceConfig(paths=[str(path)], capacity_bytes=swap_bytes, preallocate=preallocate),
                          engine=engine)
        store = TierStore(TierStoreConfig(chunk_bytes=1 << 20, **config), pool=pool, space=space, engine=engine)
        made.append((store, space, pool))
        return store

    yield build
    for store, space, pool in made:
        store.close()
        space.close()
        pool.close()


def _put(store, name, nbytes):
    store.allocate(name, nbytes)
    payload = os.urandom(nbytes)
    store.host_view(name)[:] = payload
    return payload


def test_full_file_system_fails_the_evict_and_keeps_the_host_copy(parts, tiny_fs):
    """8 MiB tmpfs mount; the swap file is sparse so the disk fills during the evict."""
    store = parts(tiny_fs, swap_bytes=32 << 20, preallocate=False)
    a = _put(store, "a", 3 << 20)
    store.wait_for_evict(store.evict(["a"]))
    filler = tiny_fs / "filler"
    with open(filler, "wb") as f:  # take what is left of the file system
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    b = _put(store, "b", 3 << 20)
    with pytest.raises(TierFullError, match=rf"evict of region 'b': no space left .* {tiny_fs}.*host copy is kept"):
        store.wait_for_evict(store.evict(["b"]))
    assert store.info("b").tier == Tier.HOST
    assert bytes(store.host_view("b")) == b
    assert store.stats().dirty_bytes == 3 << 20
    filler.unlink()  # room again: the same evict now works, and both regions come back whole
    store.wait_for_evict(store.evict(["b"]))
    store.wait_for_prefetch(store.prefetch(["a", "b"]))
    assert bytes(store.host_view("a")) == a
    assert bytes(store.host_view("b")) == b
    assert store.stats().errors_total == 1


def test_evict_refused_halfway_keeps_the_host_copy_for_any_user(parts, tmp_path):
    """A write-back that the kernel cuts short and then refuses fails the evict; the region
    keeps its host copy, bytes and dirty flag, and the same evict works once there is room.

    [Note: a full disk without root] The tmpfs test above makes the disk really full, but
    mounting needs root, and a test that skips for other users lets a store that frees the
    host copy before a failed write pass. RLIMIT_FSIZE needs no privilege and fails a
    write the same way a disk filling up mid-evict does: a write that crosses the limit is
    cut short, the next one is refused (EFBIG). The limit is per process, so it is set in
    this one (where the engine's threads and io_uring's workers write), only while the
    evict runs, and at 1 GiB, far above anything else this process writes; the region is
    placed across it in a sparse swap file, which costs no disk. A child process would
    need the whole store rebuilt there and its checks reported back, for no gain."""
    limit = 1 << 30
    store = parts(tmp_path, swap_bytes=limit + (16 << 20), preallocate=False)
    a = _put(store, "a", 3 << 20)
    store.wait_for_evict(store.evict(["a"]))  # file offsets [0, 3 MiB)
    spacer = store.space.allocate(limit - (4 << 20) - 8192)  # the next extent starts 1 MiB + 8 KiB below the limit
    used = store.stats().swap_used_bytes
    b = _put(store, "b", 3 << 20)
    with pytest.raises(SwapIOError, match=r"evict of region 'b': write of .* failed: File too large") as info:
        with file_size_limit(limit):
            store.wait_for_evict(store.evict(["b"]))
    assert info.value.errno == errno.EFBIG
    assert store.info("b").tier == Tier.HOST
    assert bytes(store.host_view("b")) == b
    assert store.stats().dirty_bytes == 3 << 20
    assert store.stats().swap_used_bytes == used, "the extents taken for the failed evict are given back"
    assert store.info("a").tier == Tier.NVME
    store.space.release(spacer)  # the limit is gone too: the same evict now works
    store.wait_for_evict(store.evict(["b"]))
    store.wait_for_prefetch(store.prefetch(["a", "b"]))
    assert bytes(store.host_view("a")) == a
    assert bytes(store.host_view("b")) == b
    assert store.stats().errors_total == 1


def test_full_swap_space_fails_evict_before_any_io(parts, tmp_path):
    store = parts(tmp_path, swap_bytes=4 << 20)
    _put(store, "a", 3 << 20)
    b = _put(store, "b", 2 << 20)
    store.wait_for_evict(store.evict(["a"]))
    with pytest.raises(TierFullError, match="evict of region 'b'.*swap file"):
        store.evict(["b"])
    assert store.info("b").tier == Tier.HOST
    assert bytes(store.host_view("b")) == b


def test_flipped_byte_is_detected_on_prefetch(parts, tmp_path):
    store = parts(tmp_path)
    good = _put(store, "good", 2 << 20)
    bad = _put(store, "bad", (2 << 20) + 5)
    store.wait_for_evict(store.evict(["good", "bad"]))
    p = store.placements("bad")[0]
    path = store.space.files[p.file_index].path
    where = p.file_offset + (1 << 20) + 17
    with open(path, "r+b") as f:
        f.seek(where)
        byte = f.read(1)
        f.seek(where)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(ChecksumError, match=rf"region 'bad': checksum mismatch in swap file {path}"):
        store.wait_for_prefetch(store.prefetch(["good", "bad"]))
    assert store.info("bad").tier == Tier.NVME
    assert bytes(store.host_view("good")) == good
    with open(path, "r+b") as f:  # put the byte back: the data was never lost
        f.seek(where)
        f.write(byte)
    store.wait_for_prefetch(store.prefetch(["bad"]))
    assert bytes(store.host_view("bad")) == bad


def test_flipped_byte_in_padding_or_with_checksums_off_is_not_an_error(parts, tmp_path):
    store = parts(tmp_path, checksum="none")
    _put(store, "a", 5000)
    store.wait_for_evict(store.evict(["a"]))
    p = store.placements("a")[0]
    with open(store.space.files[0].path, "r+b") as f:
        f.seek(p.file_offset + 100)
        f.write(b"\xff")
    store.wait_for_prefetch(store.prefetch(["a"]))  # no checksum: it reads what is there
    assert store.host_view("a")[100] == 0xFF


def test_truncated_swap_file_is_a_clear_error(parts, tmp_path):
    store = parts(tmp_path)
    a = _put(store, "a", 4 << 20)
    store.wait_for_evict(store.evict(["a"]))
    path = store.space.files[0].path
    os.truncate(path, 1 << 20)
    with pytest.raises(SwapIOError, match=rf"region 'a': swap file {path} ends before") as info:
        store.wait_for_prefetch(store.prefetch(["a"]))
    assert info.value.errno == errno.ENODATA
    assert store.info("a").tier == Tier.NVME
    assert store.stats().host_pool_used_bytes == 0
    del a


def test_deleted_swap_file_fails_evict_and_keeps_every_copy(parts, tmp_path):
    store = parts(tmp_path)
    a = _put(store, "a", 1 << 20)
    b = _put(store, "b", 1 << 20)
    store.wait_for_evict(store.evict(["a"]))
    path = store.space.files[0].path
    os.unlink(path)
    with pytest.raises(SwapIOError, match=rf"swap file {path} was deleted"):
        store.evict(["b"])
    assert store.info("b").tier == Tier.HOST
    assert bytes(store.host_view("b")) == b
    # what was already on NVMe is still readable through the open descriptor
    store.wait_for_prefetch(store.prefetch(["a"]))
    assert bytes(store.host_view("a")) == a
    with pytest.raises(SwapIOError, match="deleted"):
        store.flush()


def test_read_only_path_fails_at_start(engine, readonly_dir):
    with pytest.raises(SwapIOError, match=f"swap path {readonly_dir} is not writable") as info:
        SwapSpace(SwapSpaceConfig(paths=[str(readonly_dir)], capacity_bytes=1 << 20), engine=engine)
    assert info.value.errno in (errno.EROFS, errno.EACCES)
