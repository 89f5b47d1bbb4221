"""Host memory the GPU can DMA from directly: the tier's segments registered with CUDA.

The embedded ``TierStore``'s pool and the daemon client's mappings of its memfd segments
are plain shared memory. A copy from pageable memory to the GPU goes through a staging
buffer of the driver (the bytes cross the host's memory twice, and the copy blocks); once
a range is registered (``cudaHostRegister``, page-locked and mapped into the GPU's
address space) the copy engines read it directly and ``copy_(non_blocking=True)`` is truly
asynchronous, and kernels can load from it through its mapped address.

[Note: one registration per segment] Registration pins every page of the range and
costs about a millisecond per GiB, so it is done once per segment when the tier opens,
never per region or per copy. A segment is registered with ``Portable`` (valid in every
CUDA context of the process) and ``Mapped`` (kernels may address it: the batched
gather of ``offload.gpu.gather``). Registering the same address twice is a no-op; a
second range overlapping a registered one is refused (CUDA would fail it anyway, with a
less helpful error). Every range is unregistered on ``close``, before the mapping goes
away (unmapping registered memory is undefined behaviour in CUDA's terms).

Where CUDA is absent (this CPU build of torch, CI) registration is a no-op with a debug
log: the copies that would use it run on the CPU.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Iterable, Protocol

from csrc import ConfigError, OffloadError

logger = logging.getLogger(__name__)

__all__ = ["CudaHostApi", "HostRegistration", "TorchCudart", "cuda_host_api", "tier_host_ranges"]

REGISTER_PORTABLE = 0x01  # cudaHostRegisterPortable
REGISTER_MAPPED = 0x02  # cudaHostRegisterDevicemap (cudaHostRegisterMapped)
REGISTER_FLAGS = REGISTER_PORTABLE | REGISTER_MAPPED


class CudaHostApi(Protocol):
    """The two CUDA calls registration needs (injected in tests)."""

    def register(self, address: int, nbytes: int, flags: int) -> None:
        """Page-lock and map ``nbytes`` at ``address``; raises ``OSError``-like ``OffloadError`` on failure."""

    def unregister(self, address: int) -> None:
        """Undo ``register`` of the range starting at ``address``."""


class TorchCudart:
    """``CudaHostApi`` over torch's binding of the CUDA runtime (``torch.cuda.cudart()``)."""

    def __init__(self, cudart: Any) -> None:
        self._cudart = cudart

    def _check(self, err: Any, what: str) -> None:
        if err != self._cudart.cudaError.success:
            raise OffloadError(f"{what} failed: {self._cudart.cudaGetErrorString(err)}")

    def register(self, address: int, nbytes: int, flags: int) -> None:
        self._check(self._cudart.cudaHostRegister(address, nbytes, flags),
                    f"cudaHostRegister({address:#x}, {nbytes})")

    def unregister(self, address: int) -> None:
        self._check(self._cudart.cudaHostUnregister(address), f"cudaHostUnregister({address:#x})")


def cuda_host_api() -> CudaHostApi | None:
    """torch's CUDA runtime binding, or None where CUDA is not available."""
    import torch

    if not torch.cuda.is_available():
        return None
    return TorchCudart(torch.cuda.cudart())


def tier_host_ranges(store: Any) -> list[tuple[int, int]]:
    """``(address, nbytes)`` of every host segment of a tier (``TierStore`` or ``TierClient``)."""
    ranges = getattr(store, "host_ranges", None)
    if ranges is None:
        raise ConfigError(f"{type(store).__name__} does not say where its host memory is (no host_ranges())")
    return list(ranges())


class HostRegistration:
    """Host ranges registered with CUDA, once each (see [Note: one registration per segment])."""

    def __init__(self, api: CudaHostApi | None, *, flags: int = REGISTER_FLAGS) -> None:
        self._api = api
        self._flags = flags
        self._lock = threading.Lock()
        self._ranges: dict[int, int] = {}  # address -> nbytes, registered with CUDA
        self._closed = False

    @property
    def active(self) -> bool:
        """Whether registration does anything here (CUDA is present)."""
        return self._api is not None

    @property
    def ranges(self) -> dict[int, int]:
        """A copy of what is registered now: address -> nbytes."""
        with self._lock:
            return dict(self._ranges)

    def register(self, address: int, nbytes: int) -> bool:
        """Register one range; True if it was registered by this call, False if it already was
        (or CUDA is absent). A different range overlapping a registered one is a ``ConfigError``."""
        if nbytes <= 0:
            raise ConfigError(f"host registration: nbytes must be > 0, got {nbytes}")
        with self._lock:
            if self._closed:
                raise ConfigError("host registration is closed")
            known = self._ranges.get(address)
            if known == nbytes:
                return False
            for start, size in self._ranges.items():
                if start < address + nbytes and address < start + size:
                    raise ConfigError(f"host range [{address:#x}, +{nbytes}) overlaps the registered "
                                      f"[{start:#x}, +{size})")
            if self._api is None:
                logger.debug("no CUDA: host range %#x (+%d bytes) left unregistered", address, nbytes)
                return False
            self._api.register(address, nbytes, self._flags)
            self._ranges[address] = nbytes
        logger.debug("registered host range %#x (+%d bytes) with CUDA", address, nbytes)
        return True

    def register_all(self, ranges: Iterable[tuple[int, int]]) -> int:
        """Register every range not registered yet; returns how many were new."""
        return sum(self.register(address, nbytes) for address, nbytes in ranges)

    def register_tier(self, store: Any) -> int:
        """Register every host segment of a tier (``TierStore`` or ``TierClient``)."""
        count = self.register_all(tier_host_ranges(store))
        if self.active:
            logger.info("registered %d host segment(s) of the tier with CUDA (%d bytes)", count,
                        sum(self.ranges.values()))
        return count

    def unregister(self, address: int) -> None:
        """Unregister one range (a no-op if it is not registered)."""
        with self._lock:
            if self._ranges.pop(address, None) is None:
                return
            self._api.unregister(address)

    def close(self) -> None:
        """Unregister everything; idempotent. A failure is logged and the rest still unregistered."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            ranges, self._ranges = self._ranges, {}
        for address in ranges:
            try:
                self._api.unregister(address)
            except OffloadError as exc:
                logger.warning("on close: %s", exc)

    def __enter__(self) -> "HostRegistration":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
