"""CRC-32C: both C paths (SSE4.2 and the byte table) against the standard check value,
a bitwise reference written from the definition, and each other.

On x86 machines with SSE4.2 (every machine that runs these tests) the table is never
used unless forced, so ``force_crc32c_table_for_tests`` (test only) forces it.
"""
from __future__ import annotations

import os
import random

import pytest

from swap import aio, crc32c, crc32c_hardware

CHECK_INPUT = b"123456789"
CHECK_VALUE = 0xE3069283  # CRC-32C of "123456789" (RFC 3720 B.4, iSCSI)
POLY_REFLECTED = 0x82F63B78


def _reference(data: bytes, crc: int = 0) -> int:
    """CRC-32C bit by bit from the definition: reflected, init and final xor 0xFFFFFFFF."""
    c = crc ^ 0xFFFFFFFF
    for byte in data:
        c ^= byte
        for _ in range(8):
            c = (c >> 1) ^ POLY_REFLECTED if c & 1 else c >> 1
    return c ^ 0xFFFFFFFF


def _crc(data: bytes, start: int = 0, length: int | None = None, crc: int = 0) -> int:
    keep, address = aio.buffer_address(data)
    length = len(data) - start if length is None else length
    return crc32c(address + start, length, crc)


@pytest.fixture
def table_path():
    """The byte-table path forced for the test, the previous setting restored after."""
    before = aio.force_crc32c_table_for_tests(True)
    yield
    aio.force_crc32c_table_for_tests(before)


@pytest.fixture(params=["default", "table"])
def either_path(request):
    """Each C path in turn: the default (SSE4.2 where the CPU has it) and the forced table."""
    if request.param == "default":
        yield
        return
    before = aio.force_crc32c_table_for_tests(True)
    assert not crc32c_hardware(), "forcing the table must switch the dispatch"
    yield
    aio.force_crc32c_table_for_tests(before)


def test_reference_gives_the_standard_check_value():
    assert _reference(CHECK_INPUT) == CHECK_VALUE


def test_each_path_gives_the_standard_check_value(either_path):
    """The check value in one pass and continued over two parts (the table is the path of
    CPUs without SSE4.2); an empty buffer leaves the CRC as it was."""
    assert _crc(CHECK_INPUT) == CHECK_VALUE
    first = _crc(CHECK_INPUT, 0, 4)
    assert _crc(CHECK_INPUT, 4, 5, first) == CHECK_VALUE
    assert _crc(b"") == 0
    assert _crc(b"", crc=CHECK_VALUE) == CHECK_VALUE


def test_table_path_matches_the_bitwise_reference_on_random_buffers(table_path):
    rng = random.Random(1234)
    for length in [1, 2, 3, 7, 8, 9, 63, 255, 256, 1000, 4099]:
        data = rng.randbytes(length)
        assert _crc(data) == _reference(data), f"length {length}"


def test_hardware_and_table_paths_agree_on_random_buffers():
    """Odd starts and lengths cover the hardware path's unaligned head, 8-byte body and tail."""
    if not crc32c_hardware():
        pytest.skip("no SSE4.2 here: crc32c already uses the table (checked by the tests above)")
    data = os.urandom((1 << 20) + 64)
    rng = random.Random(5678)
    cases = [(0, 0), (0, 1), (1, 7), (3, 8), (5, 9), (7, 4095), (0, 1 << 20), (13, (1 << 20) + 17)]
    cases += [(rng.randrange(64), rng.randrange(1 << 16)) for _ in range(20)]
    hardware = [_crc(data, start, n) for start, n in cases]
    before = aio.force_crc32c_table_for_tests(True)
    try:
        table = [_crc(data, start, n) for start, n in cases]
    finally:
        aio.force_crc32c_table_for_tests(before)
    assert crc32c_hardware()
    assert table == hardware
    small = [(start, n) for start, n in cases if n <= 4096]
    assert [_crc(data, s, n) for s, n in small] == [_reference(data[s:s + n]) for s, n in small]
