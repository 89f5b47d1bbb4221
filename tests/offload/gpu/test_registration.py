"""CUDA host registration of the tier's segments: once per segment, undone on close, idempotent.

The CUDA calls are injected (a recorder), so the bookkeeping is tested here without a GPU; the
addresses registered are checked against the memory itself (bytes written at an address are read
back through the tier's own view), for the embedded store and for a real daemon's segments.
"""
from __future__ import annotations

import ctypes
import logging

import pytest
import torch

from csrc import ConfigError, OffloadError
from offload.gpu.registration import REGISTER_FLAGS, HostRegistration, cuda_host_api
from offload.tiers import Tier
from swap import TierStore
from tests.daemon.conftest import STORE, start_daemon


class Recorder:
    """A fake CUDA runtime: records calls, refuses a double registration as CUDA does."""

    def __init__(self, fail_unregister: set[int] = frozenset()) -> None:
        self.calls: list[tuple] = []
        self.live: dict[int, int] = {}
        self.fail_unregister = set(fail_unregister)

    def register(self, address: int, nbytes: int, flags: int) -> None:
        if address in self.live:
            raise OffloadError("cudaHostRegister: cudaErrorHostMemoryAlreadyRegistered")
        self.calls.append(("register", address, nbytes, flags))
        self.live[address] = nbytes

    def unregister(self, address: int) -> None:
        self.calls.append(("unregister", address))
        if address in self.fail_unregister:
            raise OffloadError("cudaHostUnregister: cudaErrorHostMemoryNotRegistered")
        del self.live[address]


def _store(segments: int = 3, segment_bytes: int = 1 << 20) -> TierStore:
    return TierStore.create(host_capacity_bytes=segments * segment_bytes, swap_paths=[], swap_capacity_bytes=0,
                            segment_bytes=segment_bytes)


def _check_addresses_are_the_tier_memory(store, names: list[str]) -> None:
    """Bytes written at a registered address + the region's offset are what the region reads."""
    ranges = store.host_ranges()
    for i, name in enumerate(names):
        view = store.host_view(name)
        mark = bytes([i + 1]) * 64
        hits = 0
        for address, nbytes in ranges:
            base = ctypes.addressof(ctypes.c_char.from_buffer(view))
            if address <= base < address + nbytes:
                ctypes.memmove(base, mark, len(mark))
                hits += 1
        assert hits == 1, f"region {name} lies in exactly one registered range"
        assert bytes(store.host_view(name)[:64]) == mark


def test_embedded_store_segments_registered_once_and_unregistered_on_close():
    api = Recorder()
    store = _store()
    tier = Tier(store, "embedded")
    try:
        tier.register_with_cuda(api)
        expected = [(seg.address, seg.nbytes) for seg in store.pool.segments]
        assert len(expected) == 3
        assert [c[1:] for c in api.calls] == [(a, n, REGISTER_FLAGS) for a, n in expected]
        tier.register_with_cuda(api)  # again: nothing new
        assert len(api.calls) == 3 and tier.registration.ranges == dict(expected)
        for k in range(4):
            store.allocate(f"r{k}", 300_000)
        _check_addresses_are_the_tier_memory(store, [f"r{k}" for k in range(4)])
    finally:
        tier.close()
    assert api.live == {}
    assert sorted(c[1] for c in api.calls if c[0] == "unregister") == sorted(a for a, _ in expected)
    tier.close()  # idempotent
    assert len(api.calls) == 6


def test_unregister_happens_before_the_store_closes():
    order = []

    class Store:
        def host_ranges(self):
            return [(4096, 8192)]

        def close(self):
            order.append("store closed")

    class Api(Recorder):
        def unregister(self, address):
            order.append("unregistered")
            super().unregister(address)

    tier = Tier(Store(), "fake")
    tier.register_with_cuda(Api())
    tier.close()
    assert order == ["unregistered", "store closed"]


def test_bookkeeping_rules():
    api = Recorder(fail_unregister={1 << 20})
    reg = HostRegistration(api)
    assert reg.register(1 << 20, 4096) is True
    assert reg.register(1 << 20, 4096) is False  # the same range: no second CUDA call
    with pytest.raises(ConfigError, match="overlaps"):
        reg.register((1 << 20) + 2048, 4096)
    with pytest.raises(ConfigError, match="nbytes"):
        reg.register(1 << 22, 0)
    assert reg.register_all([(1 << 22, 4096), (1 << 20, 4096), (1 << 23, 8192)]) == 2
    reg.unregister(1 << 22)
    reg.unregister(1 << 22)  # not registered any more: a no-op
    assert reg.ranges == {1 << 20: 4096, 1 << 23: 8192}
    reg.close()  # the failing unregister is logged, the other still done
    assert api.live == {1 << 20: 4096}
    assert [c for c in api.calls if c[0] == "unregister"] == [("unregister", 1 << 22), ("unregister", 1 << 20),
                                                                ("unregister", 1 << 23)]
    with pytest.raises(ConfigError, match="closed"):
        reg.register(1 << 24, 4096)


def test_without_cuda_registration_is_a_logged_no_op(caplog):
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: cuda_host_api() is the real runtime here")
    assert cuda_host_api() is None
    store = _store(segments=2)
    tier = Tier(store, "embedded")
    with caplog.at_level(logging.DEBUG, logger="offload.gpu.registration"):
        tier.register_with_cuda()
    assert not tier.registration.active and tier.registration.ranges == {}
    assert sum("left unregistered" in r.getMessage() for r in caplog.records) == 2
    tier.close()


@pytest.mark.skipif(STORE != "swap", reason="needs the real swap layer in the daemon")
def test_daemon_client_segment_mappings_registered_once_and_unregistered_before_unmapping(tmp_path):
    from daemon import TierClient, TierClientConfig

    daemon = start_daemon(pool={"capacity_bytes": 16 << 20, "segment_bytes": 4 << 20},
                          sessions={"default_quota_bytes": 12 << 20})
    api = Recorder()
    try:
        client = TierClient(TierClientConfig(socket_path=daemon.socket_path, job_id="reg", rank=0,
                                             quota_bytes=12 << 20, token_dir=str(tmp_path)))
        tier = Tier(client, "daemon", daemon=True)
        tier.register_with_cuda(api)
        ranges = client.host_ranges()
        assert len(ranges) >= 1 and sum(n for _, n in ranges) >= 12 << 20
        assert sorted(c[1:3] for c in api.calls) == sorted(ranges)
        tier.register_with_cuda(api)
        assert len(api.calls) == len(ranges)
        for k in range(3):
            client.allocate(f"r{k}", 1 << 20)
        _check_addresses_are_the_tier_memory(client, [f"r{k}" for k in range(3)])
        tier.close()
        assert api.live == {} and len(api.calls) == 2 * len(ranges)
    finally:
        daemon.stop()


@pytest.mark.cuda
def test_registered_pool_is_pinned_for_torch():
    store = _store(segments=1)
    tier = Tier(store, "embedded")
    try:
        tier.register_with_cuda()
        store.allocate("x", 1 << 16)
        host = torch.frombuffer(store.host_view("x"), dtype=torch.float32)
        assert host.is_pinned()
        host.copy_(torch.arange(host.numel(), dtype=torch.float32))
        dev = host.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(dev.cpu(), host)
    finally:
        tier.close()
