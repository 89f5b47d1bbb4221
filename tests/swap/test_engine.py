"""The C engines against plain Python file I/O as the oracle, both directions."""
from __future__ import annotations

import errno
import mmap
import os
import time

import pytest

from csrc import BuildError, ConfigError
from csrc.loader import load_extension
from swap import IoEngineConfig, align_up, open_engine
from swap import aio as swap_aio
from swap import engine as swap_engine

from tests.swap.conftest import ENGINE_KINDS, file_size_limit, make_engine

LENGTHS = [1, 4095, 4096, 4097, (1 << 20) + 3, 64 << 20]


def _aligned(nbytes: int) -> mmap.mmap:
    """A page-aligned anonymous buffer of at least ``nbytes`` (O_DIRECT's rule)."""
    return mmap.mmap(-1, max(align_up(nbytes, 4096), 4096))


def _layout(lengths):
    """Back-to-back offsets of padded lengths, starting off a 1 MiB boundary so that
    transfers cross the engine's 256 KiB block boundaries at odd places."""
    offsets, pos = [], 3 * 4096
    for n in lengths:
        offsets.append(pos)
        pos += align_up(n, 4096)
    return offsets, pos


def test_engine_reports_its_kind(engine):
    assert engine.name in ENGINE_KINDS
    assert engine.reason


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_engine_writes_read_back_with_python(engine, tmp_path, direct):
    path = tmp_path / "f.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o600)
    offsets, _ = _layout(LENGTHS)
    payloads = {n: os.urandom(n) for n in LENGTHS}
    try:
        requests = []
        for n, off in zip(LENGTHS, offsets):
            # O_DIRECT moves whole 4 KiB pages: the padding is zeros; buffered moves exactly n
            size = align_up(n, 4096) if direct else n
            buf = _aligned(size)
            buf[:n] = payloads[n]
            requests.append((engine.write(fd, memoryview(buf)[:size], off), size))
        for req, size in requests:  # wait for each request by its own handle
            assert req.check() == size
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        for n, off in zip(LENGTHS, offsets):
            f.seek(off)
            assert f.read(n) == payloads[n], f"length {n} at offset {off}"


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_python_writes_read_back_with_engine(engine, tmp_path, direct):
    path = tmp_path / "f.bin"
    offsets, end = _layout(LENGTHS)
    payloads = {n: os.urandom(n) for n in LENGTHS}
    with open(path, "wb") as f:
        f.truncate(end)
        for n, off in zip(LENGTHS, offsets):
            f.seek(off)
            f.write(payloads[n])
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        for n, off in zip(LENGTHS, offsets):
            size = align_up(n, 4096) if direct else n
            buf = _aligned(size)
            assert engine.read(fd, memoryview(buf)[:size], off).check() == size
            assert buf[:n] == payloads[n], f"length {n} at offset {off}"
    finally:
        os.close(fd)


def test_read_past_end_of_file_is_an_error_not_a_short_success(engine, tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(os.urandom(3 * 4096))
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = _aligned(1 << 20)
        req = engine.read(fd, memoryview(buf)[:1 << 20], 0)
        with pytest.raises(OSError) as info:
            req.check()
        assert info.value.errno == errno.ENODATA
        stats = engine.stats()
        assert stats["requests_failed"] >= 1
        assert stats["short_transfers"] >= 1, "the short first read must have been continued, then failed"
    finally:
        os.close(fd)


def test_bad_fd_fails_that_request_only(engine, tmp_path):
    buf = _aligned(8192)
    bad = engine.read(987654, memoryview(buf)[:8192], 0)
    with pytest.raises(OSError) as info:
        bad.check()
    assert info.value.errno == errno.EBADF
    path = tmp_path / "ok.bin"
    path.write_bytes(b"z" * 8192)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert engine.read(fd, memoryview(buf)[:8192], 0).check() == 8192
    finally:
        os.close(fd)


def test_wait_is_per_request_and_honours_timeout(tmp_path):
    """A small request completes while a large one queued before it is still running."""
    with make_engine("threads", block_size_bytes=4096, queue_depth=1, num_threads=1) as e:
        path = tmp_path / "f.bin"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            big = _aligned(64 << 20)
            small = _aligned(4096)
            r_big = e.write(fd, big, 0)
            r_small = e.write(fd, small, 128 << 20)
            assert r_small.wait(timeout_seconds=60)
            assert r_small.check() == 4096
            r_big.check()
            assert r_big.wait(timeout_seconds=0)
            submitted, completed = r_big.times_ns()
            assert 0 < submitted <= completed
        finally:
            os.close(fd)


def test_zero_byte_request_completes(engine, tmp_path):
    fd = os.open(tmp_path / "z.bin", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert engine.write(fd, b"", 0).check() == 0
    finally:
        os.close(fd)


def test_engine_stats_count_bytes(engine, tmp_path):
    fd = os.open(tmp_path / "s.bin", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        buf = _aligned(1 << 20)
        engine.write(fd, buf, 0).check()
        engine.read(fd, buf, 0).check()
    finally:
        os.close(fd)
    s = engine.stats()
    assert s["bytes_written"] == 1 << 20 and s["bytes_read"] == 1 << 20
    assert s["requests_pending"] == 0 and s["blocks_in_flight"] == 0


def test_closed_engine_refuses_work(tmp_path):
    e = make_engine("threads")
    e.close()
    e.close()
    with pytest.raises(ConfigError, match="closed"):
        e.write(0, b"x", 0)


@pytest.mark.parametrize("field,value", [("kind", "io_uringx"), ("block_size_bytes", 1000),
                                         ("queue_depth", 0), ("num_threads", 0), ("num_threads", 65)])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        IoEngineConfig(**{field: value})


def test_auto_falls_back_in_order_when_kinds_are_refused(monkeypatch):
    if swap_aio.linux_aio_errno():
        pytest.skip("this kernel refuses Linux AIO")
    monkeypatch.setattr(swap_aio, "io_uring_errno", lambda: errno.EPERM)
    with open_engine(IoEngineConfig()) as e:
        assert e.name == "linux_aio"
        assert "io_uring_setup refused" in e.reason
    monkeypatch.setattr(swap_aio, "linux_aio_errno", lambda: errno.EPERM)
    with open_engine(IoEngineConfig()) as e:
        assert e.name == "threads"
        assert "io_setup refused" in e.reason
    with pytest.raises(ConfigError, match="'linux_aio' cannot be used here"):
        open_engine(IoEngineConfig(kind="linux_aio"))
    with pytest.raises(ConfigError, match="'io_uring' cannot be used here"):
        open_engine(IoEngineConfig(kind="io_uring"))


def test_auto_falls_back_when_a_probe_path_refuses_o_direct(monkeypatch, tmp_path):
    monkeypatch.setattr(swap_engine, "direct_io_supported", lambda p: (False, f"O_DIRECT open refused in {p}"))
    with open_engine(IoEngineConfig(probe_paths=[str(tmp_path)])) as e:
        assert e.name == "threads"
        assert str(tmp_path) in e.reason


def test_auto_picks_io_uring_where_it_works(tmp_path):
    if swap_aio.io_uring_errno():
        pytest.skip("this kernel refuses io_uring")
    with open_engine(IoEngineConfig(probe_paths=[str(tmp_path)])) as e:
        assert e.name == "io_uring"


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_registered_buffer_is_used_and_bytes_match(tmp_path, direct):
    with make_engine("io_uring") as e:
        n = 1 << 20  # two of these fit in the default 8 MiB memlock limit of a non-root user
        src, dst = _aligned(n), _aligned(n)
        src[:] = os.urandom(n)
        keep_s, a_src = swap_aio.buffer_address(src)
        keep_d, a_dst = swap_aio.buffer_address(dst)
        slots = [e.register_buffer(a_src, n), e.register_buffer(a_dst, n)]
        if None in slots and os.geteuid() != 0:
            pytest.skip("the memlock limit refuses pinning 2 MiB here")
        assert None not in slots
        fd = os.open(tmp_path / "r.bin", os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o600)
        try:
            e.submit(swap_aio.OP_WRITE, fd, a_src + 4096, n - 4096, 0).check()
            e.submit(swap_aio.OP_READ, fd, a_dst, n - 4096, 0).check()
            assert dst[:n - 4096] == src[4096:]
            used = e.stats()["blocks_registered"]
            assert used == 2 * -(-(n - 4096) // (256 << 10))  # every block of both transfers
            for slot in slots:
                e.unregister_buffer(slot)
            e.submit(swap_aio.OP_READ, fd, a_dst, n - 4096, 0).check()
            assert e.stats()["blocks_registered"] == used, "an unregistered buffer must not be used as fixed"
        finally:
            os.close(fd)
        del keep_s, keep_d


def test_other_engines_ignore_registration():
    with make_engine("threads") as e:
        assert e.register_buffer(4096, 4096) is None


def test_many_threads_and_deep_queue_keep_order_of_bytes(tmp_path):
    with make_engine("io_uring" if not swap_aio.io_uring_errno() else "threads",
                     block_size_bytes=128 << 10, queue_depth=32, num_threads=4) as e:
        fd = os.open(tmp_path / "q.bin", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        try:
            n = 16 << 20
            src = _aligned(n)
            src[:] = os.urandom(n)
            e.write(fd, src, 0).check()
            dst = _aligned(n)
            t0 = time.monotonic()
            e.read(fd, dst, 0).check()
            assert time.monotonic() - t0 < 60
            assert dst[:] == src[:]
        finally:
            os.close(fd)


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_short_write_is_continued_then_reported(engine, tmp_path, direct):
    """RLIMIT_FSIZE makes the kernel cut a write short at the limit, then refuse the rest
    with EFBIG (Python ignores SIGXFSZ): the engine must continue after the short write
    and report the error, never count the request as done."""
    limit = 1 << 30
    fd = os.open(tmp_path / "big.bin", os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o600)
    buf = _aligned(1 << 20)
    before = engine.stats()["short_transfers"]
    try:
        with file_size_limit(limit):
            req = engine.write(fd, buf, limit - 8192)
            req.wait()
    finally:
        os.close(fd)
    assert req.error() == errno.EFBIG
    with pytest.raises(OSError, match="failed after 8192 bytes"):
        req.check()
    assert engine.stats()["short_transfers"] > before


def test_a_stale_or_missing_build_fails_loudly_at_import():
    with pytest.raises(BuildError, match=r"stale build \(ABI \d+, this code needs 999\).*pip install"):
        load_extension("csrc._aio", "ofl_aio_abi_version", 999, "the compiled I/O engine")
    with pytest.raises(BuildError, match="csrc._nothing.*is missing"):
        load_extension("csrc._nothing", "x", 1, "nothing")


def test_misaligned_direct_transfer_is_refused_up_front(engine, tmp_path):
    fd = os.open(tmp_path / "m.bin", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        buf = _aligned(8192)
        with pytest.raises(ConfigError, match="misaligned O_DIRECT transfer.*nbytes 4095"):
            engine.write(fd, memoryview(buf)[:4095], 0)
        with pytest.raises(ConfigError, match="misaligned O_DIRECT transfer.*file_offset 100"):
            engine.write(fd, memoryview(buf)[:4096], 100)
        with pytest.raises(ConfigError, match="misaligned O_DIRECT transfer.*address"):
            engine.write(fd, memoryview(buf)[1:4097], 0)
    finally:
        os.close(fd)
