"""The daemon's control protocol over a Unix stream socket.

Transport
---------
A client connects to the daemon's Unix socket (mode 0660; the daemon checks the peer's
uid with SO_PEERCRED and closes the connection of a uid it does not allow). Both sides
send *frames*. Payloads (tensor bytes) never travel on the socket: they live in the
session's shared-memory segments (see ``daemon.shm``).

Frame layout (little-endian, 16-byte header, then the body)::

    offset  size  field
    0       4     body_nbytes   u32   length of the body that follows the header
    4       2     kind          u16   a ``Kind`` value; a reply repeats its request's kind
    6       2     flags         u16   bit 0 REPLY, bit 1 ERROR, bit 2 FDS (fds ride with this frame)
    8       8     request_id    u64   chosen by the client; echoed in exactly one reply
    16      n     body          UTF-8 JSON object (n == body_nbytes; ``{}`` may be sent as n=0)

Rules
-----
* The first request on a connection is HELLO (PING, STATUS, ENGINE and SPACE need no
  session). Its body carries ``version``; a version the daemon does not speak (outside
  ``MIN_PROTOCOL_VERSION`` .. ``PROTOCOL_VERSION``) gets an error reply and the connection
  is closed. Versions only add kinds and optional fields, so the daemon serves older
  clients as they are. One session per connection. A connection
  that has opened no session within the daemon's ``hello_timeout_seconds`` is closed.
* A connection the daemon will not keep (a connection cap reached) gets one error frame
  with kind 0 and request_id 0, naming the cap, and is closed.
* Every request gets exactly one reply with the same ``request_id``: a REPLY frame with
  the fields listed below, or a REPLY|ERROR frame with ``{"error", "message", "errno"?}``.
  ``error`` names a class of ``csrc.errors`` (``ProtocolError``, ``QuotaExceededError``,
  ``SessionError``, ``TierFullError``, ``SwapIOError``...) or one of ``KeyError``,
  ``ValueError``, ``TimeoutError``, ``OSError``, with ``errno`` for OSErrors;
  ``TierClient`` raises that class again, so callers see what a local
  ``TierStore`` would raise.
* A header whose ``body_nbytes`` exceeds the daemon's ``max_message_bytes`` gets an error
  reply and the connection is closed (framing can no longer be trusted). A body that is
  not a JSON object (or nested deeper than ``MAX_JSON_DEPTH``, or holding NaN or
  Infinity), an unknown kind, a missing, extra, ill-typed or out-of-range field gets an
  error reply and the connection goes on. A connection that ends mid-frame is dropped. None
  of this touches any other session.
* The HELLO reply carries the session's memfd segments as SCM_RIGHTS ancillary data on
  the frame's first byte (FDS flag set), in the order of its ``segments`` list. No other
  frame carries fds, and the daemon never accepts addresses or offsets from a client, nor fds but
  in the one exchange below (a hand-back, which it checks against its journal).
* A client may pipeline requests; replies to bookkeeping requests come in order, replies
  to waits, FLUSH, FREE and BYE come when they are done (match them by ``request_id``).

Messages (kind number: request fields -> reply fields)
-----------------------------------------------------
HELLO 1          version int, job_id str, rank int, quota_bytes int (0: the daemon's default),
                 token str (optional: a reattach presents the token of the session's last HELLO reply)
                 -> version, session_id, reattached bool, quota_bytes, segments [{index, nbytes}],
                    token str (for the next reattach; see [Note: session ownership] in daemon.sessions),
                    idle_timeout_seconds (0: none) (and the segments' fds, see above)
                 hand_back int (optional, 4: the client maps that many segments of the session it
                 reattaches to and can give them back). When the daemon's session waits for them (it
                 was taken over from a daemon that could not keep its memory), the first reply is
                 {hand_back: n} and the daemon reads no frame until the client has sent one byte with
                 the n segments' fds (SCM_RIGHTS), in the session's order; the HELLO reply above follows.
                 [Note: hand-back] in daemon.handback.
ALLOCATE 2       name str, nbytes int -> region {name, nbytes, segment_index, offset, tier}
FREE 3           name -> {}
MARK_DIRTY 4     name -> {}
REGION 5         name, view bool -> region (as ALLOCATE). view=true: the client is about to map
                 the region, so it must have a host copy (else the store's ConfigError). A region
                 named by a prefetch or evict the client has not waited for shows tier IN_FLIGHT
                 (see [Note: client-visible state] in daemon.handlers).
PREFETCH 6       names [str] -> handle int (the transfer is queued in the fair scheduler)
WAIT_PREFETCH 7  handle int, timeout_seconds float|null -> {} (or the transfer's error;
                 TimeoutError leaves the transfer running, and it can be waited for again;
                 timeout_seconds 0 asks whether it is done, and its TimeoutError "not yet" is
                 no error of the daemon's: see [Note: a poll is a question] in daemon.handlers)
EVICT 8          names [str] -> handle int
WAIT_EVICT 9     handle int, timeout_seconds float|null -> {} (or its error, as WAIT_PREFETCH)
FLUSH 10         {} -> {} once every dirty region is written back (host copies kept)
STATS 11         {} -> stats {TierStats fields}
REPORT_STEP 12   seconds float (one optimizer step) -> {}
PING 13          {} -> {}
STATUS 14        {} -> version, engine, metrics_address, uptime_seconds, pool {capacity_bytes,
                 used_bytes (quotas reserved), held_bytes (host bytes the sessions' regions hold),
                 segment_bytes, max_quota_bytes (the largest quota one session may hold)},
                 swap {used_bytes, capacity_bytes}, bytes_moved {read, write}, bytes_per_second
                 {read, write}, queued, inflight, inflight_bytes, sessions [{job_id, rank, uid, state, quota_bytes,
                 stats, regions_by_tier}] (only the asker's uid's sessions, unless it is root)
BYE 15           {} -> {}; the session is closed now (memory and extents freed)
PLACEMENTS 16    name -> placements [[file_index, file_offset, region_offset, nbytes]]
ENGINE 17        {} -> name, stats {the engine's counters} (one engine serves every session)
SPACE 18         {} -> files [path], used_bytes, capacity_bytes
JOB_STEP 19      step int (the engine's step count), step_seconds float, io_wait_seconds float,
                 read_bytes int, write_bytes int, skipped_steps int (each since the session's last
                 JOB_STEP: one optimizer step's figures), loss_scale float, closing bool (optional:
                 true for the engine's last report at close, which carries the bytes of its last
                 transfers and is no step) -> labelled bool (false: the job is beyond the daemon's
                 [metrics] max_jobs and only counted; see daemon.jobs). Since version 3.

All integers are JSON numbers (exact up to 2**53) and range-checked (``FIELD_RANGES``);
names are UTF-8 strings.
"""
from __future__ import annotations

import enum
import json
import logging
import struct
from typing import Any, NamedTuple

from csrc.errors import ConfigError, ProtocolError

logger = logging.getLogger(__name__)

__all__ = [
    "PROTOCOL_VERSION",
    "MIN_PROTOCOL_VERSION",
    "HEADER",
    "Kind",
    "Flag",
    "Frame",
    "FrameDecoder",
    "encode_frame",
    "decode_body",
    "check_fields",
    "error_body",
    "MAX_JSON_DEPTH",
]

PROTOCOL_VERSION = 4
"""2: HELLO takes and returns a reattach token; connection-level error frames (request_id 0).
3: JOB_STEP, an engine's per-step figures for the per-job metrics.
4: HELLO's ``hand_back``: a client reattaching after a daemon restart offers the segments it maps, and a
daemon that lost them asks for them (see [Note: hand-back] in ``daemon.handback``)."""
MIN_PROTOCOL_VERSION = 2
"""The oldest version a HELLO may name (an older client never sends the newer kinds)."""
MAX_JSON_DEPTH = 8
"""No request body nests deeper than 3; a deeper one is refused before it is parsed."""
HEADER = struct.Struct("<IHHQ")
"""body_nbytes u32, kind u16, flags u16, request_id u64: 16 bytes."""


class Kind(enum.IntEnum):
    HELLO = 1
    ALLOCATE = 2
    FREE = 3
    MARK_DIRTY = 4
    REGION = 5
    PREFETCH = 6
    WAIT_PREFETCH = 7
    EVICT = 8
    WAIT_EVICT = 9
    FLUSH = 10
    STATS = 11
    REPORT_STEP = 12
    PING = 13
    STATUS = 14
    BYE = 15
    PLACEMENTS = 16
    ENGINE = 17
    SPACE = 18
    JOB_STEP = 19


class Flag(enum.IntFlag):
    NONE = 0
    REPLY = 1
    ERROR = 2
    FDS = 4


class Frame(NamedTuple):
    kind: int
    flags: int
    request_id: int
    body: bytes


_OPT_NUM = (int, float, type(None))
# Request fields per kind: name -> accepted types. Every field is required.
REQUEST_FIELDS: dict[Kind, dict[str, tuple[type, ...]]] = {
    Kind.HELLO: {"version": (int,), "job_id": (str,), "rank": (int,), "quota_bytes": (int,)},
    Kind.ALLOCATE: {"name": (str,), "nbytes": (int,)},
    Kind.FREE: {"name": (str,)},
    Kind.MARK_DIRTY: {"name": (str,)},
    Kind.REGION: {"name": (str,), "view": (bool,)},
    Kind.PREFETCH: {"names": (list,)},
    Kind.WAIT_PREFETCH: {"handle": (int,), "timeout_seconds": _OPT_NUM},
    Kind.EVICT: {"names": (list,)},
    Kind.WAIT_EVICT: {"handle": (int,), "timeout_seconds": _OPT_NUM},
    Kind.FLUSH: {},
    Kind.STATS: {},
    Kind.REPORT_STEP: {"seconds": (int, float)},
    Kind.PING: {},
    Kind.STATUS: {},
    Kind.BYE: {},
    Kind.PLACEMENTS: {"name": (str,)},
    Kind.ENGINE: {},
    Kind.SPACE: {},
    Kind.JOB_STEP: {"step": (int,), "step_seconds": (int, float), "io_wait_seconds": (int, float),
                    "read_bytes": (int,), "write_bytes": (int,), "skipped_steps": (int,), "loss_scale": (int, float)},
}


# Optional request fields per kind (checked like the required ones when present).
OPTIONAL_FIELDS: dict[Kind, dict[str, tuple[type, ...]]] = {
    Kind.HELLO: {"token": (str,), "hand_back": (int,)},
    Kind.JOB_STEP: {"closing": (bool,)},
}

_I63 = (1 << 63) - 1
FIELD_RANGES: dict[str, tuple[float, float]] = {
    "version": (0, 1 << 16),
    "rank": (0, (1 << 31) - 1),
    "quota_bytes": (0, 1 << 53),
    "nbytes": (-(1 << 53), 1 << 53),  # the sign is the store's to judge, as on a local store
    "handle": (0, _I63),
    "timeout_seconds": (0, 1e9),
    "seconds": (0, 1e9),
    "step": (0, 1 << 53),
    "step_seconds": (0, 86400),
    "io_wait_seconds": (0, 86400),
    "read_bytes": (0, 1 << 53),
    "write_bytes": (0, 1 << 53),
    "skipped_steps": (0, 1 << 32),
    "loss_scale": (0, 1e39),
    "hand_back": (0, 253),
}
"""Inclusive bounds of numeric request fields, wherever they appear (null stays allowed where typed so)."""


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number this protocol takes")


_ENCODER = json.JSONEncoder(separators=(",", ":"))
_DECODER = json.JSONDecoder(parse_constant=_no_constant)
_pack = HEADER.pack


def _too_deep(text: str) -> bool:
    """True when ``text`` nests brackets deeper than MAX_JSON_DEPTH (strings skipped)."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return False
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return True
        elif ch in "]}":
            depth -= 1
    return False


def encode_frame(kind: int, request_id: int, body: dict[str, Any] | None = None, flags: int = 0) -> bytes:
    """One frame: header and JSON body."""
    payload = _ENCODER.encode(body).encode() if body else b""
    return _pack(len(payload), kind, flags, request_id) + payload


def decode_body(frame: Frame) -> dict[str, Any]:
    """The body of ``frame`` as a dict; ``ProtocolError`` when it is not a JSON object."""
    if not frame.body:
        return {}
    try:
        text = frame.body.decode()
        if _too_deep(text):
            raise ProtocolError(f"request {frame.request_id}: body nests deeper than {MAX_JSON_DEPTH}")
        body = _DECODER.decode(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"request {frame.request_id}: body is not JSON ({str(exc)[:200]})") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"request {frame.request_id}: body must be a JSON object, got {type(body).__name__}")
    return body


_KINDS = {int(k): k for k in Kind}


def _compile(k: Kind) -> tuple[frozenset[str], tuple[tuple[str, tuple[type, ...], bool, bool, Any], ...]]:
    """Per kind, once: the names allowed, and per field (name, types, required, bool allowed, bounds)."""
    required, optional = REQUEST_FIELDS[k], OPTIONAL_FIELDS.get(k, {})
    fields = tuple((name, types, name in required, bool in types, FIELD_RANGES.get(name))
                   for name, types in (*required.items(), *optional.items()))
    return frozenset(required) | frozenset(optional), fields


_SPECS = {k: _compile(k) for k in Kind}


def check_fields(kind: int, body: dict[str, Any]) -> Kind:
    """Validate a request body against its kind; returns the ``Kind``."""
    k = _KINDS.get(kind)
    if k is None:
        raise ProtocolError(f"unknown message kind {kind}")
    allowed, fields = _SPECS[k]
    if not body and not fields:
        return k
    for name in body:
        if name not in allowed:
            raise ProtocolError(f"{k.name}: unknown field {name!r}")
    for name, types, required, bool_ok, bounds in fields:
        if name not in body:
            if required:
                raise ProtocolError(f"{k.name}: missing field {name!r}")
            continue
        value = body[name]
        if not isinstance(value, types) or (value.__class__ is bool and not bool_ok):
            raise ProtocolError(f"{k.name}: field {name!r} has type {type(value).__name__}")
        # NaN fails both comparisons, and +-inf the bounds: no isfinite needed
        if bounds is not None and value is not None and not bounds[0] <= value <= bounds[1]:
            raise ConfigError(f"{k.name}: field {name!r} must be in [{bounds[0]}, {bounds[1]}], got {value!r}")
    if k is Kind.PREFETCH or k is Kind.EVICT:
        if not all(isinstance(n, str) for n in body["names"]):
            raise ProtocolError(f"{k.name}: field 'names' must be a list of strings")
    return k


def error_body(exc: BaseException) -> dict[str, Any]:
    """The body of an error reply for ``exc``."""
    body: dict[str, Any] = {"error": type(exc).__name__, "message": str(exc.args[0]) if
                            isinstance(exc, KeyError) and exc.args else str(exc)}
    if isinstance(exc, OSError) and exc.errno is not None:
        body["errno"] = exc.errno
        body["message"] = exc.strerror or str(exc)
    return body


class FrameDecoder:
    """Splits a byte stream into frames; raises ``ProtocolError`` on an oversized header.

    After an oversized header the stream cannot be re-synchronised: the caller replies
    with an error (``oversized_request_id``) and closes the connection.
    """

    def __init__(self, max_body_bytes: int) -> None:
        self._max = max_body_bytes
        self._buf = bytearray()
        self.oversized_request_id: int | None = None

    def feed(self, data: bytes) -> list[Frame]:
        if self._buf:
            self._buf += data
            buf: bytes | bytearray = self._buf
        else:
            buf = data  # the usual case: whole frames in one read, parsed without a copy
        frames: list[Frame] = []
        off, end_of_data = 0, len(buf)
        unpack = HEADER.unpack_from
        hsize = HEADER.size
        while end_of_data - off >= hsize:
            nbytes, kind, flags, request_id = unpack(buf, off)
            if nbytes > self._max:
                self.oversized_request_id = request_id
                self._buf = bytearray()
                raise ProtocolError(f"request {request_id}: body of {nbytes} bytes exceeds {self._max}")
            end = off + hsize + nbytes
            if end > end_of_data:
                break
            frames.append(Frame(kind, flags, request_id, bytes(buf[off + hsize:end])))
            off = end
        self._buf = bytearray(buf[off:]) if off < end_of_data else bytearray()
        return frames

    @property
    def pending_bytes(self) -> int:
        return len(self._buf)
