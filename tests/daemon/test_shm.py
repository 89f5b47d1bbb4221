"""daemon.shm: memfd segments pass through SCM_RIGHTS and map shared."""
from __future__ import annotations

import mmap
import os
import socket

import pytest

from csrc.errors import ProtocolError
from daemon.shm import PAGE_BYTES, SegmentMap, create_segment, recv_with_fds, send_with_fds


def test_segment_is_resident_after_creation():
    seg = create_segment(64 * PAGE_BYTES, 3)
    try:
        assert seg.index == 3 and seg.nbytes == 64 * PAGE_BYTES
        assert os.fstat(seg.fd).st_blocks * 512 >= seg.nbytes  # every page allocated up front
    finally:
        os.close(seg.fd)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="multiple"):
        create_segment(PAGE_BYTES + 1, 0)


def test_fds_cross_a_socket_and_map_the_same_memory():
    segs = [create_segment(4 * PAGE_BYTES, i) for i in range(3)]
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        assert send_with_fds(a, b"hello", [s.fd for s in segs]) == 5
        data, fds = recv_with_fds(b, 100)
        assert data == b"hello" and len(fds) == 3
        mapped = SegmentMap(fds, [s.nbytes for s in segs])
        owner = mmap.mmap(segs[1].fd, segs[1].nbytes)
        view = mapped.view(1, PAGE_BYTES, 10)
        view[:] = b"0123456789"
        assert owner[PAGE_BYTES:PAGE_BYTES + 10] == b"0123456789"
        del view
        owner.close()
        with pytest.raises(ProtocolError, match="outside segment 0"):
            mapped.view(0, 3 * PAGE_BYTES, PAGE_BYTES + 1)
        with pytest.raises(ProtocolError, match="segment 7"):
            mapped.view(7, 0, 1)
        mapped.close()
    finally:
        a.close()
        b.close()
        for s in segs:
            os.close(s.fd)


def test_fd_count_mismatch_closes_what_came():
    seg = create_segment(PAGE_BYTES, 0)
    dup = os.dup(seg.fd)
    with pytest.raises(ProtocolError, match="2 segments but carried 1"):
        SegmentMap([dup], [PAGE_BYTES, PAGE_BYTES])
    with pytest.raises(OSError):
        os.fstat(dup)
    os.close(seg.fd)
