"""What the engines do beyond moving bytes: the CRC-32C their threads take as blocks complete
(against a plain CRC of the bytes, read back with Python file reads), and io_uring buffers
registered in pieces (the kernel takes at most 1 GiB per buffer)."""
from __future__ import annotations

import mmap
import os

import pytest

from csrc import ConfigError
from swap import aio as swap_aio
from swap import align_up, crc32c

from tests.swap.conftest import ENGINE_KINDS, make_engine

BLOCK = 256 << 10  # make_engine's block size


def _aligned(nbytes: int) -> mmap.mmap:
    return mmap.mmap(-1, max(align_up(nbytes, 4096), 4096))


def _crc_of(data: bytes) -> int:
    keep, address = swap_aio.buffer_address(data)
    return crc32c(address, len(data))


@pytest.mark.parametrize("kind", ENGINE_KINDS)
@pytest.mark.parametrize("nbytes,crc_bytes", [
    (4096, 4096), (4096, 1), (4096, 0), (BLOCK, BLOCK), (3 * BLOCK + 8192, 3 * BLOCK + 8192),
    (3 * BLOCK + 8192, 2 * BLOCK + 17), (3 * BLOCK + 8192, BLOCK), (5 * BLOCK, 5 * BLOCK - 4095)])
def test_engine_crc_of_writes_and_reads_matches_the_bytes(kind, tmp_path, nbytes, crc_bytes):
    """Blocks of every length the join meets: whole, cut by crc_bytes inside or at a block edge,
    and the request's short last block; with the transfers cut short by the test cap too."""
    with make_engine(kind) as e:
        e.cap_transfer_bytes_for_tests(64 << 10)
        src, dst = _aligned(nbytes), _aligned(nbytes)
        src[:nbytes] = os.urandom(nbytes)
        want = _crc_of(bytes(src[:crc_bytes]))
        _, a_src = swap_aio.buffer_address(src)
        _, a_dst = swap_aio.buffer_address(dst)
        path = tmp_path / "crc.bin"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            w = e.submit(swap_aio.OP_WRITE, fd, a_src, nbytes, 4096, crc_bytes=crc_bytes)
            w.check()
            assert w.crc() == want
            with open(path, "rb") as f:  # the oracle's read of what the engine wrote
                f.seek(4096)
                assert _crc_of(f.read(crc_bytes)) == want
            r = e.submit(swap_aio.OP_READ, fd, a_dst, nbytes, 4096, crc_bytes=crc_bytes)
            r.check()
            assert r.crc() == want and dst[:nbytes] == src[:nbytes]
            plain = e.submit(swap_aio.OP_READ, fd, a_dst, nbytes, 4096)
            plain.check()
            assert plain.crc() is None  # none asked for
        finally:
            os.close(fd)


@pytest.mark.parametrize("kind", ENGINE_KINDS)
def test_failed_transfer_has_no_crc(kind, tmp_path):
    with make_engine(kind) as e:
        buf = _aligned(8192)
        _, address = swap_aio.buffer_address(buf)
        path = tmp_path / "short.bin"
        path.write_bytes(b"x" * 4096)
        fd = os.open(path, os.O_RDONLY)
        try:
            req = e.submit(swap_aio.OP_READ, fd, address, 8192, 0, crc_bytes=8192)
            req.wait()
            assert req.error() != 0 and req.crc() is None
        finally:
            os.close(fd)


def test_crc_bytes_out_of_range_is_refused():
    with make_engine("threads") as e:
        buf = _aligned(4096)
        _, address = swap_aio.buffer_address(buf)
        for bad in (-2, 4097):
            with pytest.raises(ConfigError, match="crc_bytes"):
                e.submit(swap_aio.OP_WRITE, 1, address, 4096, 0, crc_bytes=bad)


def test_buffer_over_the_piece_size_is_registered_in_pieces(tmp_path):
    """A buffer of 2.5 pieces takes three table slots: blocks inside a piece go out as fixed
    transfers, the one across a piece edge unregistered; unregistering frees every slot."""
    with make_engine("io_uring") as e:
        piece = 1 << 20
        e.set_buffer_piece_bytes_for_tests(piece)
        n = piece * 5 // 2
        src, dst = _aligned(n), _aligned(n)
        src[:] = os.urandom(n)
        _, a_src = swap_aio.buffer_address(src)
        _, a_dst = swap_aio.buffer_address(dst)
        slot = e.register_buffer(a_src, n)
        if slot is None and os.geteuid() != 0:
            pytest.skip("the memlock limit refuses pinning 2.5 MiB here")
        assert slot is not None
        fd = os.open(tmp_path / "p.bin", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        try:
            # from 128 KiB in: 256 KiB blocks start at 128 KiB + k * 256 KiB, so the blocks at
            # 896 KiB and 1920 KiB cross the piece edges at 1 MiB and 2 MiB
            offset = 128 << 10
            length = n - offset
            e.submit(swap_aio.OP_WRITE, fd, a_src + offset, length, 0).check()
            blocks = -(-length // BLOCK)
            assert e.stats()["blocks_registered"] == blocks - 2
            e.submit(swap_aio.OP_READ, fd, a_dst, length, 0).check()
            assert dst[:length] == src[offset:]
            assert e.stats()["blocks_registered"] == blocks - 2  # dst is not registered
            e.unregister_buffer(slot)
            others = [e.register_buffer(a_dst, 4096) for _ in range(swap_aio.lib.OFL_AIO_MAX_BUFFERS)]
            assert None not in others  # all three slots came back: the whole table is free again
            for s in others:
                e.unregister_buffer(s)
        finally:
            os.close(fd)
