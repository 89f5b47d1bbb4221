"""Short transfers whose remainder succeeds, on every kind of engine, and ``IoRequest.check``.

A healthy local disk almost never cuts a read or write short, and the fault tests only
make short transfers whose remainder fails (end of file, a file size limit), so the
continuation paths of the engines would go unchecked: an engine that stopped after the
first short transfer and reported success would pass. ``cap_transfer_bytes_for_tests``
(test only) makes each pread/pwrite (threads), iocb (Linux AIO) or SQE (io_uring) ask for
at most ``cap`` bytes, so every block moves as a run of short transfers that all succeed.
Plain Python file I/O is the oracle for every byte, and bytes next to a transfer must be
left alone.
"""
from __future__ import annotations

import errno
import mmap
import os

import pytest

from swap import IoRequest, align_up
from swap import aio as swap_aio

BLOCK_BYTES = 256 << 10  # the engine fixture's block size (tests/swap/conftest.py)
GUARD = 0x5A  # fills the bytes around each transfer, which must stay as they are

CASES = {  # direct: transfer lengths (multiples of 4096 for O_DIRECT) and the cap. Few
    # O_DIRECT pieces in a row: each is a round trip to the disk (milliseconds on a VM)
    True: ([4096, 5 * 4096, BLOCK_BYTES + 5 * 4096], 3 * 4096),
    False: ([1, 999, 1000, 1001, 4097, 2 * BLOCK_BYTES + 12345], 1000),
}


def _expected_shorts(lengths: list[int], cap: int) -> int:
    """Short transfers the engine must continue: per block, one fewer than its pieces."""
    total = 0
    for n in lengths:
        for start in range(0, n, BLOCK_BYTES):
            total += -(-min(BLOCK_BYTES, n - start) // cap) - 1
    return total


def _layout(lengths: list[int]) -> tuple[list[int], int]:
    """Offsets with a 4 KiB gap after each transfer (untouched bytes to check), and the end."""
    offsets, pos = [], 4096
    for n in lengths:
        offsets.append(pos)
        pos += align_up(n, 4096) + 4096
    return offsets, pos


def _open(path, direct: bool, create: bool) -> int:
    flags = os.O_RDWR | (os.O_CREAT if create else 0) | (os.O_DIRECT if direct else 0)
    return os.open(path, flags, 0o600)


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_short_writes_whose_remainder_succeeds_are_continued_to_the_last_byte(engine, tmp_path, direct):
    """Every write is cut into ``cap``-byte pieces; the file must hold every byte, and no
    byte around the writes may change."""
    lengths, cap = CASES[direct]
    offsets, end = _layout(lengths)
    path = tmp_path / "w.bin"
    path.write_bytes(bytes([GUARD]) * end)
    payloads = [os.urandom(n) for n in lengths]
    engine.cap_transfer_bytes_for_tests(cap)
    before = engine.stats()["short_transfers"]
    fd = _open(path, direct, create=False)
    try:
        buffers = []
        for n, payload in zip(lengths, payloads):
            buf = mmap.mmap(-1, align_up(n, 4096))  # page aligned for O_DIRECT
            buf[:n] = payload
            buffers.append(buf)
        requests = [engine.write(fd, memoryview(buf)[:n], off) for buf, n, off in zip(buffers, lengths, offsets)]
        assert [r.check() for r in requests] == lengths
    finally:
        os.close(fd)
    assert engine.stats()["short_transfers"] - before >= _expected_shorts(lengths, cap)
    expected = bytearray([GUARD]) * end
    for n, off, payload in zip(lengths, offsets, payloads):
        expected[off:off + n] = payload
    assert path.read_bytes() == bytes(expected)


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_short_reads_whose_remainder_succeeds_are_continued_to_the_last_byte(engine, tmp_path, direct):
    """Every read is cut into ``cap``-byte pieces; each buffer must end up equal to what
    Python wrote, and the bytes after it in the buffer must stay as they were."""
    lengths, cap = CASES[direct]
    offsets, end = _layout(lengths)
    content = os.urandom(end)
    path = tmp_path / "r.bin"
    path.write_bytes(content)
    engine.cap_transfer_bytes_for_tests(cap)
    before = engine.stats()["short_transfers"]
    fd = _open(path, direct, create=False)
    try:
        buffers = [mmap.mmap(-1, align_up(n, 4096) + 4096) for n in lengths]
        for buf in buffers:
            buf[:] = bytes([GUARD]) * len(buf)
        requests = [engine.read(fd, memoryview(buf)[:n], off) for buf, n, off in zip(buffers, lengths, offsets)]
        assert [r.check() for r in requests] == lengths
    finally:
        os.close(fd)
    assert engine.stats()["short_transfers"] - before >= _expected_shorts(lengths, cap)
    for buf, n, off in zip(buffers, lengths, offsets):
        assert buf[:n] == content[off:off + n], f"{n} bytes at offset {off}"
        assert buf[n:] == bytes([GUARD]) * (len(buf) - n), f"bytes after the read of {n} were touched"


def test_removing_the_cap_restores_whole_transfers(tmp_path):
    """The cap is per engine and 0 removes it: no short transfer is counted afterwards."""
    from tests.swap.conftest import make_engine

    with make_engine("threads") as e:
        buf = mmap.mmap(-1, 1 << 20)
        buf[:] = os.urandom(1 << 20)
        fd = _open(tmp_path / "c.bin", direct=False, create=True)
        try:
            e.cap_transfer_bytes_for_tests(4096)
            assert e.write(fd, buf, 0).check() == 1 << 20
            capped = e.stats()["short_transfers"]
            assert capped == _expected_shorts([1 << 20], 4096)
            e.cap_transfer_bytes_for_tests(0)
            assert e.write(fd, buf, 0).check() == 1 << 20
            assert e.stats()["short_transfers"] == capped
        finally:
            os.close(fd)
        with pytest.raises(OSError) as info:
            e.cap_transfer_bytes_for_tests(-1)
        assert info.value.errno == errno.EINVAL


class _ShortSuccess:
    """Stands in for the C request of an engine that stopped a transfer early yet reported no
    error: a correct engine never does, so only a stand-in can make ``check`` meet it."""

    def __init__(self, moved: int) -> None:
        self.moved = moved

    def wait(self, timeout_seconds: float | None = None) -> bool:
        return True

    def result(self) -> tuple[bool, int, int, int, int]:
        return True, 0, self.moved, 1, 2


def test_check_raises_when_fewer_bytes_moved_than_asked_for():
    """``IoRequest.check`` compares the bytes moved with the bytes asked for, and ``error``
    reports such a request as EIO (so a region transfer fails instead of keeping a hole)."""
    short = IoRequest(_ShortSuccess(4096), None, swap_aio.OP_READ, 7, 8192, 12288)
    with pytest.raises(OSError, match=r"read of 8192 bytes at offset 12288 \(fd 7\) completed after only 4096") as info:
        short.check()
    assert info.value.errno == errno.EIO
    assert short.error() == errno.EIO
    whole = IoRequest(_ShortSuccess(8192), None, swap_aio.OP_WRITE, 7, 8192, 0)
    assert whole.check() == 8192
    assert whole.error() == 0
