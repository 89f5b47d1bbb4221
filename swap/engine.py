"""Choosing and driving an I/O engine: Linux AIO, or the pread/pwrite thread pool.

``open_engine`` picks the engine: Linux AIO when the kernel lets this process create
an AIO context and every probe path accepts O_DIRECT, else the thread pool. The
choice and its reason are on ``engine.name`` / ``engine.reason`` and in the log.

[Note: alignment] With O_DIRECT the buffer address, the length and the file offset
must be multiples of the device's logical block size (512 or 4096). Everything this
package allocates (pool regions, swap extents) is aligned to ``ALIGNMENT_BYTES`` =
4096 and lengths are padded to it, so no caller meets that rule by hand.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import mmap
import os
from typing import Any

from csrc import ConfigError
from swap import aio

logger = logging.getLogger(__name__)

__all__ = ["ALIGNMENT_BYTES", "IoEngine", "IoEngineConfig", "IoRequest", "direct_io_supported", "open_engine"]

ALIGNMENT_BYTES = 4096
_SECTOR_BYTES = 512  # the smallest logical block size: misalignment below it is refused up front


def _is_direct(fd: int) -> bool:
    try:
        return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
    except OSError:
        return False  # a bad fd: the transfer itself reports EBADF
_KINDS = ("auto", "io_uring", "linux_aio", "threads")
_C_KINDS = {"io_uring": aio.KIND_IO_URING, "linux_aio": aio.KIND_LINUX_AIO, "threads": aio.KIND_THREADS}


@dataclasses.dataclass(frozen=True, kw_only=True)
class IoEngineConfig:
    """How an I/O engine moves bytes."""

    kind: str = "auto"
    """"auto" (io_uring, else Linux AIO, else threads: the first that works here with O_DIRECT on
    every probe path), or "io_uring" / "linux_aio" (an error where it does not work), or "threads"."""
    block_size_bytes: int = 1 << 20
    """Largest single transfer; a request is split into blocks of this size. A multiple of 4096."""
    queue_depth: int = 32
    """Blocks in flight per submitting thread (threads engine: I/O threads per submitting thread)."""
    num_threads: int = 1
    """Submitting threads (each with its own AIO context)."""
    probe_paths: tuple[str, ...] = ()
    """With kind "auto": directories that must accept O_DIRECT for Linux AIO to be chosen."""

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ConfigError(f"kind must be one of {', '.join(_KINDS)}, got {self.kind!r}")
        if self.block_size_bytes <= 0 or self.block_size_bytes % ALIGNMENT_BYTES:
            raise ConfigError(f"block_size_bytes must be a positive multiple of {ALIGNMENT_BYTES}, "
                              f"got {self.block_size_bytes}")
        if not 1 <= self.queue_depth <= aio.MAX_QUEUE_DEPTH:
            raise ConfigError(f"queue_depth must be in [1, {aio.MAX_QUEUE_DEPTH}], got {self.queue_depth}")
        if not 1 <= self.num_threads <= aio.MAX_THREADS:
            raise ConfigError(f"num_threads must be in [1, {aio.MAX_THREADS}], got {self.num_threads}")
        object.__setattr__(self, "probe_paths", tuple(str(p) for p in self.probe_paths))


def direct_io_supported(directory: str) -> tuple[bool, str]:
    """(True, "") if a file in ``directory`` accepts an aligned O_DIRECT write, else (False, why)."""
    path = os.path.join(directory, f".ofl-direct-probe-{os.getpid()}-{id(directory)}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError as exc:
        return False, f"O_DIRECT open refused in {directory}: {exc.strerror}"
    try:
        with mmap.mmap(-1, ALIGNMENT_BYTES) as page:  # page aligned
            os.pwrite(fd, page, 0)
        return True, ""
    except OSError as exc:
        return False, f"O_DIRECT write refused in {directory}: {exc.strerror}"
    finally:
        os.close(fd)
        os.unlink(path)


class IoRequest:
    """A transfer in progress: ``wait()`` for this request only, then ``check()`` for its outcome."""

    __slots__ = ("_c", "_keepalive", "op", "fd", "nbytes", "file_offset")

    def __init__(self, c: aio.CRequest, keepalive: Any, op: int, fd: int, nbytes: int, file_offset: int) -> None:
        self._c = c
        self._keepalive = keepalive  # the buffer must outlive the transfer
        self.op, self.fd, self.nbytes, self.file_offset = op, fd, nbytes, file_offset

    def wait(self, timeout_seconds: float | None = None) -> bool:
        """True once complete (successfully or not); False if ``timeout_seconds`` passed first."""
        done = self._c.wait(timeout_seconds)
        if done:
            self._keepalive = None
        return done

    def done(self) -> bool:
        return self._c.result()[0]

    def error(self) -> int:
        """0, or the errno the transfer failed with (ENODATA: end of file before nbytes; EIO: it
        completed without an error but moved fewer than ``nbytes``, which the engine must never do)."""
        done, err, moved, _, _ = self._c.result()
        return errno.EIO if done and not err and moved != self.nbytes else err

    def crc(self) -> int | None:
        """Once done without error: the CRC-32C asked for at submit; else None."""
        return self._c.crc()

    def times_ns(self) -> tuple[int, int]:
        """(submitted, completed) on CLOCK_MONOTONIC; completed is 0 until done."""
        res = self._c.result()
        return res[3], res[4]

    def check(self) -> int:
        """Wait, then return the bytes moved (always ``nbytes``), or raise ``OSError`` with the
        errno; a transfer that reports success after fewer bytes raises too (EIO)."""
        self.wait()
        _, err, moved, _, _ = self._c.result()
        verb = "read" if self.op == aio.OP_READ else "write"
        where = f"{verb} of {self.nbytes} bytes at offset {self.file_offset} (fd {self.fd})"
        if err:
            raise OSError(err, f"{where} failed after {moved} bytes: {os.strerror(err)}")
        if moved != self.nbytes:
            raise OSError(errno.EIO, f"{where} completed after only {moved} bytes with no error: "
                                     f"a short transfer was not continued")
        return moved


class IoEngine:
    """An open engine. ``name`` is "io_uring", "linux_aio" or "threads"; ``reason`` says why.

    [Note: registered buffers] With io_uring, ``register_buffer`` pins a buffer (a host pool
    segment) once; transfers inside it then skip pinning their pages on every request,
    which is what makes io_uring read faster than Linux AIO here (see the swap bench).
    The kernel refuses buffers over 1 GiB, so the C registers a larger one as pieces of at
    most 1 GiB (one table slot each) and picks the piece per block. Other engines accept
    the call and do nothing (it returns None)."""

    def __init__(self, config: IoEngineConfig, name: str, reason: str) -> None:
        self.config = config
        self.name = name
        self.reason = reason
        self._c: aio.CEngine | None = aio.CEngine(_C_KINDS[name], config.queue_depth, config.num_threads,
                                                   config.block_size_bytes)

    def _engine(self) -> aio.CEngine:
        if self._c is None:
            raise ConfigError(f"the {self.name} I/O engine is closed")
        return self._c

    def submit(self, op: int, fd: int, address: int, nbytes: int, file_offset: int,
               keepalive: Any = None, crc_bytes: int = -1) -> IoRequest:
        """Queue a transfer at a raw address the caller keeps valid (``keepalive`` is held until done);
        with ``crc_bytes`` >= 0 the engine's threads take the CRC-32C of that many leading bytes as
        the blocks complete (``IoRequest.crc``), so the thread that waits does not."""
        if nbytes < 0 or file_offset < 0:
            raise ConfigError(f"nbytes and file_offset must be >= 0, got {nbytes} and {file_offset}")
        if (address | nbytes | file_offset) % _SECTOR_BYTES and _is_direct(fd):
            raise ConfigError(f"misaligned O_DIRECT transfer on fd {fd}: address {address:#x}, nbytes {nbytes} "
                              f"and file_offset {file_offset} must all be multiples of {_SECTOR_BYTES} "
                              f"(see [Note: alignment])")
        if not -1 <= crc_bytes <= nbytes:
            raise ConfigError(f"crc_bytes must be -1 (none) or in [0, nbytes {nbytes}], got {crc_bytes}")
        c = self._engine().submit(op, fd, address, nbytes, file_offset, crc_bytes)
        return IoRequest(c, keepalive, op, fd, nbytes, file_offset)

    def read(self, fd: int, buffer: Any, file_offset: int) -> IoRequest:
        """Read ``len(buffer)`` bytes at ``file_offset`` into a writable buffer."""
        view = memoryview(buffer).cast("B")
        if view.readonly:
            raise ConfigError("the buffer to read into is read-only")
        keep, address = aio.buffer_address(view)
        return self.submit(aio.OP_READ, fd, address, view.nbytes, file_offset, (keep, view))

    def write(self, fd: int, buffer: Any, file_offset: int) -> IoRequest:
        """Write all of ``buffer`` at ``file_offset``."""
        view = memoryview(buffer).cast("B")
        keep, address = aio.buffer_address(view)
        return self.submit(aio.OP_WRITE, fd, address, view.nbytes, file_offset, (keep, view))

    def register_buffer(self, address: int, nbytes: int) -> int | None:
        """Pin a buffer for faster transfers (see the note); its slot, or None where not used."""
        if self.name != "io_uring":
            return None
        try:
            return self._engine().register_buffer(address, nbytes)
        except OSError as exc:  # memlock limit, table full, old kernel: transfers still work, unpinned
            logger.warning("io_uring: cannot register a buffer of %d bytes (%s); using it unregistered",
                           nbytes, exc.strerror)
            return None

    def cap_transfer_bytes_for_tests(self, nbytes: int) -> None:
        """TEST ONLY: from now on ask for at most ``nbytes`` per read/write (pread/pwrite, iocb or
        SQE), so that every larger block moves as short transfers that the engine must continue
        (with O_DIRECT, a multiple of the logical block size); 0 removes the cap."""
        self._engine().cap_transfer_bytes_for_tests(nbytes)

    def set_buffer_piece_bytes_for_tests(self, nbytes: int) -> None:
        """TEST ONLY: register buffers in pieces of at most ``nbytes`` from now on (0: 1 GiB)."""
        self._engine().set_buffer_piece_bytes_for_tests(nbytes)

    def unregister_buffer(self, slot: int | None) -> None:
        """Forget a buffer that ``register_buffer`` returned ``slot`` for (None: nothing to do)."""
        if slot is not None and self._c is not None:
            self._c.unregister_buffer(slot)

    def stats(self) -> dict[str, int]:
        """Totals since open: bytes read/written, requests completed/failed/pending, blocks in flight."""
        return self._engine().stats()

    def close(self) -> None:
        """Cancel queued requests, wait for blocks in flight, stop the threads. Idempotent."""
        if self._c is not None:
            self._c.close()
            self._c = None
            logger.debug("closed the %s I/O engine", self.name)

    def __enter__(self) -> "IoEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        return (f"IoEngine({self.name}, block_size_bytes={c.block_size_bytes}, queue_depth={c.queue_depth}, "
                f"num_threads={c.num_threads})")


def open_engine(config: IoEngineConfig | None = None) -> IoEngine:
    """Open the engine ``config.kind`` asks for; "auto": io_uring, else Linux AIO, else threads."""
    config = config or IoEngineConfig()
    if config.kind == "threads":
        name, reason = "threads", "asked for by the config"
    else:
        direct = [why for ok, why in map(direct_io_supported, config.probe_paths) if not ok]
        refusals = {}
        for kind, err in (("io_uring", aio.io_uring_errno()), ("linux_aio", aio.linux_aio_errno())):
            setup = "io_uring_setup" if kind == "io_uring" else "io_setup"
            why = ([f"{setup} refused: {os.strerror(err)}"] if err else []) + direct
            if why:
                refusals[kind] = "; ".join(why)
        wanted = ["io_uring", "linux_aio"] if config.kind == "auto" else [config.kind]
        usable = [k for k in wanted if k not in refusals]
        if usable:
            name = usable[0]
            skipped = [f"{k}: {refusals[k]}" for k in wanted[:wanted.index(name)]]
            reason = f"{'io_uring_setup' if name == 'io_uring' else 'io_setup'} and O_DIRECT work" + (
                f" ({'; '.join(skipped)})" if skipped else "")
        elif config.kind != "auto":
            raise ConfigError(f"kind {config.kind!r} cannot be used here: {refusals[config.kind]}")
        else:
            name, reason = "threads", "; ".join(f"{k}: {v}" for k, v in refusals.items())
    engine = IoEngine(config, name, reason)
    logger.info("I/O engine: %s (%s)", name, reason)
    return engine
