"""The one wrapper over ``csrc._aio``: every ``lib.`` call and ``ffi`` cast of the swap layer.

Callers above this module pass plain integers (addresses, fds, offsets) that they have
already checked; this module turns C return codes into ``OSError`` and keeps C objects
alive with ``ffi.gc``. A request keeps its engine alive, so an engine is never freed
before the requests that point into it.
"""
from __future__ import annotations

import errno
import logging
from typing import Any

from csrc import raise_errno
from csrc.loader import load_extension

logger = logging.getLogger(__name__)

__all__ = [
    "ABI_VERSION",
    "KIND_LINUX_AIO",
    "KIND_THREADS",
    "KIND_IO_URING",
    "OP_READ",
    "OP_WRITE",
    "MAX_QUEUE_DEPTH",
    "MAX_THREADS",
    "CEngine",
    "CRequest",
    "buffer_address",
    "crc32c",
    "crc32c_hardware",
    "force_crc32c_table_for_tests",
    "io_uring_errno",
    "linux_aio_errno",
]

ABI_VERSION = 4
ffi, lib = load_extension("csrc._aio", "ofl_aio_abi_version", ABI_VERSION, "the compiled I/O engine")

KIND_LINUX_AIO = lib.OFL_AIO_KIND_LINUX_AIO
KIND_THREADS = lib.OFL_AIO_KIND_THREADS
KIND_IO_URING = lib.OFL_AIO_KIND_IO_URING
OP_READ = lib.OFL_AIO_OP_READ
OP_WRITE = lib.OFL_AIO_OP_WRITE
MAX_QUEUE_DEPTH = lib.OFL_AIO_MAX_QUEUE_DEPTH
MAX_THREADS = lib.OFL_AIO_MAX_THREADS


def linux_aio_errno() -> int:
    """0 if this process may create a Linux AIO context, else the errno io_setup gave."""
    return -lib.ofl_aio_linux_aio_available()


def io_uring_errno() -> int:
    """0 if this process may create an io_uring, else the errno io_uring_setup gave."""
    return -lib.ofl_aio_io_uring_available()


def buffer_address(buffer: Any) -> tuple[Any, int]:
    """(keepalive, address) of a buffer-protocol object; hold ``keepalive`` while using the address."""
    cdata = ffi.from_buffer(buffer, require_writable=False)
    return cdata, int(ffi.cast("uintptr_t", cdata))


def crc32c(address: int, nbytes: int, crc: int = 0) -> int:
    """CRC-32C of ``nbytes`` at ``address`` (continuing from ``crc``); releases the GIL."""
    out = ffi.new("uint32_t *")
    raise_errno(lib.ofl_io_crc32c(crc, address, nbytes, out), "ofl_io_crc32c")
    return int(out[0])


def crc32c_hardware() -> bool:
    """True if crc32c uses the SSE4.2 instruction on this CPU (False while the table is forced)."""
    return bool(lib.ofl_io_crc32c_hw())


def force_crc32c_table_for_tests(on: bool) -> bool:
    """TEST ONLY: make ``crc32c`` use the byte table (the path of CPUs without SSE4.2) in the
    whole process while ``on``; returns the previous setting so a test can restore it."""
    return bool(lib.ofl_io_crc32c_test_force_table(1 if on else 0))


class CRequest:
    """One submitted transfer. ``wait`` blocks for this request only."""

    __slots__ = ("_engine", "_handle", "_final", "_crc", "nbytes")

    def __init__(self, engine: "CEngine", handle: Any, nbytes: int) -> None:
        self._engine = engine  # keeps the engine alive while this request lives
        self._handle = handle
        self._final: tuple[bool, int, int, int, int] | None = None
        self._crc: int | None = None
        self.nbytes = nbytes

    def _engine_handle(self) -> Any:
        if self._engine._handle is None:
            raise OSError(errno.ESHUTDOWN, "the I/O engine was closed before this request was waited for")
        return self._engine._handle

    def wait(self, timeout_seconds: float | None = None) -> bool:
        """True once complete; False if ``timeout_seconds`` passed first."""
        if self._final is not None:
            return True
        timeout_ns = -1 if timeout_seconds is None else max(0, int(timeout_seconds * 1e9))
        rc = lib.ofl_aio_wait(self._engine_handle(), self._handle, timeout_ns)
        if rc == -errno.ETIMEDOUT:
            return False
        raise_errno(rc, "ofl_aio_wait")
        self.result()
        return True

    def result(self) -> tuple[bool, int, int, int, int]:
        """(done, errno or 0, bytes transferred, submit ns, complete ns); clocks are CLOCK_MONOTONIC."""
        if self._final is not None:
            return self._final
        out = ffi.new("ofl_aio_result *")
        raise_errno(lib.ofl_aio_request_result(self._engine_handle(), self._handle, out), "ofl_aio_request_result")
        res = (bool(out.done), int(out.error), int(out.bytes_done), int(out.submit_ns), int(out.complete_ns))
        if res[0]:
            self._final = res
            self._crc = int(out.crc) if out.has_crc else None
        return res

    def crc(self) -> int | None:
        """Once done: the CRC-32C the engine's threads took (``submit(..., crc_bytes=)``), or None
        (none was asked for, or the transfer failed)."""
        return self._crc if self.result()[0] else None


class CEngine:
    """An open C engine; freed (after its in-flight blocks finish) by ``close`` or the GC."""

    def __init__(self, kind: int, queue_depth: int, num_threads: int, block_size_bytes: int) -> None:
        cfg = ffi.new("ofl_aio_config *")
        cfg.kind = kind
        cfg.queue_depth = queue_depth
        cfg.num_threads = num_threads
        cfg.block_size_bytes = block_size_bytes
        out = ffi.new("ofl_aio_engine **")
        raise_errno(lib.ofl_aio_engine_open(cfg, out), "ofl_aio_engine_open")
        self._handle = ffi.gc(out[0], lib.ofl_aio_engine_close)

    def submit(self, op: int, fd: int, address: int, nbytes: int, file_offset: int,
               crc_bytes: int = -1) -> CRequest:
        """Queue a transfer; with ``crc_bytes`` >= 0 the engine also takes the CRC-32C of that many
        leading bytes of the buffer as the transfer's blocks complete (``CRequest.crc``)."""
        out = ffi.new("ofl_aio_request **")
        rc = lib.ofl_aio_submit_crc(self._handle, op, fd, address, nbytes, file_offset, crc_bytes, out)
        raise_errno(rc, "ofl_aio_submit_crc")
        return CRequest(self, ffi.gc(out[0], lib.ofl_aio_request_release), nbytes)

    def register_buffer(self, address: int, nbytes: int) -> int:
        """Slot of a newly registered buffer; raises OSError (EOPNOTSUPP where the engine has none)."""
        out = ffi.new("int32_t *")
        raise_errno(lib.ofl_aio_register_buffer(self._handle, address, nbytes, out), "ofl_aio_register_buffer")
        return int(out[0])

    def unregister_buffer(self, slot: int) -> None:
        raise_errno(lib.ofl_aio_unregister_buffer(self._handle, slot), "ofl_aio_unregister_buffer")

    def cap_transfer_bytes_for_tests(self, nbytes: int) -> None:
        """TEST ONLY: ask for at most ``nbytes`` per read/write syscall or submission (0: no cap)."""
        raise_errno(lib.ofl_aio_test_cap_transfer_bytes(self._handle, nbytes), "ofl_aio_test_cap_transfer_bytes")

    def set_buffer_piece_bytes_for_tests(self, nbytes: int) -> None:
        """TEST ONLY: register buffers in pieces of at most ``nbytes`` (0: the 1 GiB default)."""
        raise_errno(lib.ofl_aio_test_buffer_piece_bytes(self._handle, nbytes), "ofl_aio_test_buffer_piece_bytes")

    def stats(self) -> dict[str, int]:
        out = ffi.new("ofl_aio_stats *")
        raise_errno(lib.ofl_aio_engine_stats(self._handle, out), "ofl_aio_engine_stats")
        return {name: int(getattr(out, name)) for name in (
            "bytes_read", "bytes_written", "requests_completed", "requests_failed",
            "requests_pending", "blocks_in_flight", "short_transfers", "blocks_registered")}

    def close(self) -> None:
        """Cancel queued requests, wait for blocks in flight, free the engine."""
        if self._handle is not None:
            handle, self._handle = self._handle, None
            ffi.release(handle)
