"""Swap: async direct NVMe I/O, shared-memory host buffers, swap space, and TierStore.

```python
from swap import (HostPool, HostPoolConfig, SwapSpace, SwapSpaceConfig, IoEngineConfig, open_engine,
                  TierStore, TierStoreConfig, RegionInfo, TierStats, Tier)
pool = HostPool(HostPoolConfig(capacity_bytes=1 << 30, segment_bytes=256 << 20))
engine = open_engine(IoEngineConfig(probe_paths=["/nvme0"]))  # engine.name: "io_uring", "linux_aio" or "threads"
space = SwapSpace(SwapSpaceConfig(paths=["/nvme0"], capacity_bytes=64 << 30), engine=engine)
store = TierStore(TierStoreConfig(), pool=pool, space=space, engine=engine)
info = store.allocate("layer0.exp_avg", nbytes)   # RegionInfo(name, nbytes, segment_index, offset, tier)
store.host_view("layer0.exp_avg")[:] = ...; store.mark_dirty("layer0.exp_avg")
h = store.evict(["layer0.exp_avg"]); store.wait_for_evict(h)
h = store.prefetch(["layer0.exp_avg"]); store.wait_for_prefetch(h, timeout_seconds=None)
```

Notes on the contract (issue 3) where the shape is more precise than the brief:
- ``Tier`` has four values: HOST, NVME, HOST_AND_NVME (clean host copy, equal to the NVMe
  copy) and IN_FLIGHT. ``RegionInfo.segment_index`` / ``offset`` are None while a region
  has no host copy; a prefetch may place the host copy elsewhere, so ask ``store.info``.
- ``host_view`` returns a ``memoryview`` (``torch.frombuffer(view, dtype=...)`` makes a tensor).
- A new region's host bytes are undefined until written (the pool does not zero them).
- ``wait_for_*`` raise ``TimeoutError`` (builtin) when ``timeout_seconds`` passes; the
  transfer continues and can be waited for again.
- ``flush()`` writes back every dirty region but keeps host copies (tier HOST_AND_NVME).
- A TierStore registers its pool's segments with an io_uring engine (pinned once) and
  unregisters them at ``close()``; the pool must outlive the store.
- ``engine.stats()`` is a dict of totals; ``store.placements(name)`` says where a region's
  NVMe copy lies (``Placement`` tuples).
- Errors: ``TierFullError`` (no room: host pool, swap extents, or ENOSPC on the file system),
  ``SwapIOError`` (an OSError: a failed, short or truncated transfer, a deleted swap file,
  a missing or unwritable path), ``ChecksumError`` (a SwapIOError: data changed on disk).
"""
from csrc.errors import ChecksumError, SwapIOError, TierFullError
from swap.aio import crc32c, crc32c_hardware
from swap.buffers import HostBlock, HostPool, HostPoolConfig, HostSegment
from swap.engine import ALIGNMENT_BYTES, IoEngine, IoEngineConfig, IoRequest, direct_io_supported, open_engine
from swap.extents import ExtentAllocator, align_up
from swap.space import Placement, SwapSpace, SwapSpaceConfig
from swap.store import RegionInfo, Tier, TierStats, TierStore, TierStoreConfig, TransferHandle

__all__ = [
    "ALIGNMENT_BYTES",
    "ChecksumError",
    "ExtentAllocator",
    "HostBlock",
    "HostPool",
    "HostPoolConfig",
    "HostSegment",
    "IoEngine",
    "IoEngineConfig",
    "IoRequest",
    "Placement",
    "RegionInfo",
    "SwapIOError",
    "SwapSpace",
    "SwapSpaceConfig",
    "Tier",
    "TierFullError",
    "TierStats",
    "TierStore",
    "TierStoreConfig",
    "TransferHandle",
    "align_up",
    "crc32c",
    "crc32c_hardware",
    "direct_io_supported",
    "open_engine",
]
