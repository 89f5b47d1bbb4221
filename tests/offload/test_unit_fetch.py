"""Stage 3's units through the ``Fetcher`` ([Note: unit fetches]), driven on the CPU: training is the
plain path's to the bit, units are started ahead within the prefetch budget and max_live, small units
go through the batched copy in one call, shards are held only while their copies read them; and
``UnitFetches`` alone, with events that finish when the test says so."""
from __future__ import annotations

import pytest
import torch

from offload import initialize
from offload.gpu.select import TransferPolicy
from offload.gpu.transfers import Fetcher, Pending
from offload.zero import unit_fetch
from offload.zero.unit_fetch import UnitFetches
from tests.offload import stage3_worker as w
from tests.offload.test_stage3 import UNIT, _deep


class RecordingBatch:
    """The batched copy, recording how many tensors each call moved."""

    def __init__(self):
        self.calls: list[int] = []

    def __call__(self, dsts, srcs, device=None):
        self.calls.append(len(srcs))
        for d, s in zip(dsts, srcs):
            d.copy_(s)
        return True


@pytest.fixture
def cpu_fetcher(monkeypatch):
    """Stage 3 builds its param fetcher on the CPU too; every unit of these models is below the threshold."""
    batch = RecordingBatch()
    monkeypatch.setattr(unit_fetch, "param_fetcher", lambda device: Fetcher(
        device, policy=TransferPolicy(batch_below_bytes=1 << 20), batched=batch))
    return batch


def _train(net, config, data):
    engine, _, _, _ = initialize(model=net, config=config)
    losses, pins = [], []
    try:
        for x, y in data:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            pins.append(sum(engine.stage3.shards._pins))
        with engine.stage3.coordinator.gathered():
            params = [p.detach().clone() for p in net.parameters()]
        return losses, params, engine.stage3.coordinator.stats(), pins
    finally:
        engine.close()


def _deep_data(n):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(4, 32, generator=g), torch.randn(4, 32, generator=g)) for _ in range(n)]


def _deep_config(path, param, **zero):
    config = w.config("cpu", param, str(path), **zero)
    config["train_batch_size"] = 4
    return config


@pytest.mark.parametrize("param", ["cpu", "nvme"])
def test_training_through_the_fetcher_is_the_plain_path_to_the_bit(tmp_path, monkeypatch, param):
    data = w.batches(6)
    plain_losses, plain_params, plain_stats, _ = _train(w.model(), w.config("cpu", param, str(tmp_path)), data)
    assert plain_stats.device_prefetches == 0
    batch = RecordingBatch()
    monkeypatch.setattr(unit_fetch, "param_fetcher", lambda device: Fetcher(
        device, policy=TransferPolicy(batch_below_bytes=1 << 20), batched=batch))
    losses, params, stats, pins = _train(w.model(), w.config("cpu", param, str(tmp_path)), data)
    assert losses == plain_losses
    assert all(torch.equal(p, q) for p, q in zip(params, plain_params))
    assert stats.device_prefetches > 0 and pins == [0] * len(data)  # copies done: no shard held between steps
    assert max(batch.calls) >= 2  # units started together went through one batched call


def test_every_layer_is_started_before_its_module_runs(tmp_path, cpu_fetcher):
    """From the second step on (the order is known), each layer's unit is gathered before the module's
    own pre-hook asks for it: the one after the last fetch, or (the first layer) after the last step."""
    seen = _gathered_before_use(tmp_path, prefetch=10 ** 9, max_live=10 ** 9)
    assert not any(seen[0])  # step 1: no order yet, nothing ahead
    assert all(all(step) for step in seen[1:])


@pytest.mark.parametrize("prefetch", [0, UNIT - 1])
def test_a_budget_under_one_unit_starts_nothing_ahead(tmp_path, cpu_fetcher, prefetch):
    seen = _gathered_before_use(tmp_path, prefetch=prefetch, max_live=10 ** 9)
    assert not any(any(step) for step in seen)


def test_max_live_of_one_unit_starts_only_the_next_steps_first_layer(tmp_path, cpu_fetcher):
    """The unit in use is all max_live allows; only between steps, with nothing gathered, is one started."""
    seen = _gathered_before_use(tmp_path, prefetch=10 ** 9, max_live=UNIT)
    assert seen[0] == [False] * 8 and all(step == [True] + [False] * 7 for step in seen[1:])


def test_a_budget_of_two_units_starts_two_ahead(tmp_path, cpu_fetcher):
    """Budget 2 units: after the first layer's fetch the next two are started in one call; every layer
    after the first is then ahead of its use, and calls carry one or two units, never more."""
    seen = _gathered_before_use(tmp_path, prefetch=2 * UNIT, max_live=10 ** 9, steps=3)
    assert all(all(step) for step in seen[1:])
    assert set(cpu_fetcher.calls) <= {2} and cpu_fetcher.calls  # lone units are single copies, not batched


def _gathered_before_use(tmp_path, *, prefetch, max_live, steps=3):
    net = _deep()
    config = _deep_config(tmp_path, "cpu", stage3_prefetch_bucket_size=prefetch, stage3_max_live_parameters=max_live,
                          stage3_max_reuse_distance=0)
    engine, _, _, _ = initialize(model=net, config=config)
    coordinator = engine.stage3.coordinator
    unit_of = dict(coordinator.plan.module_units)
    seen: list[list[bool]] = []
    for layer in net.layers:  # runs before the coordinator's own pre-hook: was the unit already there?
        layer.register_forward_pre_hook(lambda m, a: seen[-1].append(coordinator.is_gathered(unit_of[m][0])),
                                        prepend=True)
    try:
        for x, y in _deep_data(steps):
            seen.append([])
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
    finally:
        engine.close()
    return seen


def test_a_tight_nvme_window_matches_the_plain_path(tmp_path, monkeypatch):
    """buffer_count 3: at most 2 shards pinned by copies at once (one slot left for the unit in use)."""
    data = _deep_data(5)
    config = _deep_config(tmp_path, "nvme")
    config["zero_optimization"]["offload_param"]["buffer_count"] = 3
    plain = _train(_deep(), config, data)
    monkeypatch.setattr(unit_fetch, "param_fetcher", lambda device: Fetcher(device, batched=RecordingBatch()))
    fetched = _train(_deep(), config, data)
    assert fetched[0] == plain[0] and all(torch.equal(p, q) for p, q in zip(fetched[1], plain[1]))
    assert fetched[2].device_prefetches > 0 and fetched[3] == [0] * len(data)


# -- UnitFetches alone ------------------------------------------------------------------------------


class Event:
    def __init__(self):
        self.done = False
        self.synced = 0

    def query(self):
        return self.done

    def synchronize(self):
        self.synced += 1
        self.done = True


class FakeFetcher:
    def __init__(self):
        self.events: list[Event] = []
        self.waited: list[Event] = []

    def start_fetch(self, pairs):
        for d, s in pairs:
            d.copy_(s)
        self.events.append(Event())
        return Pending(tuple(t for p in pairs for t in p), self.events[-1])

    def wait_fetch(self, pending):
        self.waited.append(pending.event)

    def wait_sources(self, pending):
        pending.event.synchronize()


class Shards:
    def __init__(self, n):
        self.values = [torch.full((4,), float(i)) for i in range(n)]
        self.held = [0] * n

    def acquire(self, u):
        self.held[u] += 1
        return self.values[u]

    def release(self, u, *, dirty):
        assert not dirty and self.held[u] > 0
        self.held[u] -= 1


def _fetches(n, max_pinned):
    full = [torch.empty(4) for _ in range(n)]
    for f in full:
        f.untyped_storage().resize_(0)
    fetcher, shards = FakeFetcher(), Shards(n)
    return UnitFetches(fetcher, shards, full, max_pinned=max_pinned), fetcher, shards, full


def test_shards_are_held_until_their_copy_finishes():
    fetches, fetcher, shards, full = _fetches(4, max_pinned=None)
    fetches.start([0, 1])
    fetches.start([2])
    assert shards.held == [1, 1, 1, 0] and fetches.in_flight(0) and fetches.in_flight(2)
    assert torch.equal(full[1], shards.values[1])  # the buffer was sized and filled
    fetcher.events[1].done = True
    fetches.settle()  # only the finished copy lets go of its shard
    assert shards.held == [1, 1, 0, 0]
    fetches.ready(0)
    fetches.ready(0)  # once told, the compute stream is not told again
    assert fetcher.waited == [fetcher.events[0]] and not fetches.in_flight(0) and fetches.in_flight(1)
    fetches.settle(block=True)
    assert shards.held == [0, 0, 0, 0] and fetcher.events[0].synced == 1 and fetches.pinned == 0


def test_a_full_window_waits_for_the_oldest_copy_only():
    fetches, fetcher, shards, _ = _fetches(5, max_pinned=3)
    fetches.start([0, 1])
    fetches.start([2])
    assert fetches.room() == 0
    fetches.start([3])  # 3 pinned + 1 > 3: the oldest copy (units 0 and 1) is waited for and let go
    assert fetcher.events[0].synced == 1 and fetcher.events[1].synced == 0
    assert shards.held == [0, 0, 1, 1, 0] and fetches.pinned == 2
    fetches.forget(3)  # freed unused: nobody waits for it, and its shard still goes back when the copy ends
    assert not fetches.in_flight(3)
    fetches.settle(block=True)
    assert shards.held == [0] * 5
