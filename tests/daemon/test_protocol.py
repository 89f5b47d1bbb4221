"""The framing and validation of daemon.protocol, without a daemon."""
from __future__ import annotations

import errno
import json

import pytest

from csrc.errors import ProtocolError
from daemon.protocol import HEADER, Flag, FrameDecoder, Kind, check_fields, decode_body, encode_frame, error_body


def test_header_is_16_bytes_little_endian():
    frame = encode_frame(Kind.PING, 0x0102030405060708, None, Flag.REPLY)
    assert len(frame) == HEADER.size == 16
    assert frame == bytes([0, 0, 0, 0, Kind.PING, 0, 1, 0, 8, 7, 6, 5, 4, 3, 2, 1])


def test_round_trip_through_decoder_in_any_split():
    frames = [encode_frame(Kind.ALLOCATE, i, {"name": f"r{i}", "nbytes": i * 7}) for i in range(1, 6)]
    stream = b"".join(frames)
    for step in (1, 3, 16, 17, len(stream)):
        dec = FrameDecoder(1024)
        out = []
        for i in range(0, len(stream), step):
            out += dec.feed(stream[i:i + step])
        assert [f.request_id for f in out] == [1, 2, 3, 4, 5]
        assert decode_body(out[2]) == {"name": "r3", "nbytes": 21}
        assert dec.pending_bytes == 0


def test_oversized_header_is_refused_with_its_request_id():
    dec = FrameDecoder(100)
    with pytest.raises(ProtocolError, match="exceeds 100"):
        dec.feed(HEADER.pack(101, Kind.PING, 0, 42))
    assert dec.oversized_request_id == 42


@pytest.mark.parametrize("body", [b"{", b"[1,2]", b"\xff\xfe", b"null", b"3"])
def test_bad_bodies(body):
    frame = FrameDecoder(100).feed(HEADER.pack(len(body), Kind.PING, 0, 9) + body)[0]
    with pytest.raises(ProtocolError, match="request 9"):
        decode_body(frame)


@pytest.mark.parametrize("kind, body, match", [
    (999, {}, "unknown message kind 999"),
    (Kind.ALLOCATE, {"name": "a"}, "missing field 'nbytes'"),
    (Kind.ALLOCATE, {"name": "a", "nbytes": 1, "offset": 0}, "unknown field 'offset'"),
    (Kind.ALLOCATE, {"name": "a", "nbytes": "1"}, "field 'nbytes' has type str"),
    (Kind.ALLOCATE, {"name": "a", "nbytes": True}, "field 'nbytes' has type bool"),
    (Kind.PREFETCH, {"names": ["a", 3]}, "list of strings"),
    (Kind.WAIT_PREFETCH, {"handle": 1}, "missing field 'timeout_seconds'"),
])
def test_field_checks(kind, body, match):
    with pytest.raises(ProtocolError, match=match):
        check_fields(kind, body)


def test_valid_fields_pass():
    assert check_fields(Kind.WAIT_EVICT, {"handle": 3, "timeout_seconds": None}) is Kind.WAIT_EVICT
    assert check_fields(Kind.HELLO, {"version": 1, "job_id": "j", "rank": 0, "quota_bytes": 0}) is Kind.HELLO


def test_error_bodies_keep_class_and_errno():
    assert error_body(KeyError("no region 'x'")) == {"error": "KeyError", "message": "no region 'x'"}
    body = error_body(OSError(errno.ENOSPC, "No space left on device"))
    assert body["error"] == "OSError" and body["errno"] == errno.ENOSPC
    json.dumps(body)
