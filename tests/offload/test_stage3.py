"""Stage 3 (params partitioned, gathered per unit, offloaded to host or NVMe) against plain torch:
the same losses and weights as torch.optim.AdamW for every offload pair over 50 steps, one rank and two
under torchrun; the gathered parameters stay within stage3_max_live_parameters; a model built under
init_context is never held whole and starts from the values the plain build has."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from offload import init_context, initialize
from tests.offload import stage3_worker as w
from tests import child_pythonpath

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "offload", "stage3_worker.py")
STEPS = 20
EQUIV_STEPS = 50  # the equivalence runs: 50 fp32 steps against torch


def _torch_run(net: torch.nn.Module, data, *, clip: float = 1.0, bf16_grads: bool = False):
    """torch's AdamW; ``bf16_grads``: on the gradients rounded to bf16 (what bf16 accumulators hold)."""
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    for ids, targets in data:
        loss = net(ids, targets)
        opt.zero_grad()
        loss.backward()
        if bf16_grads:
            for p in net.parameters():
                p.grad = p.grad.bfloat16().float()
        torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses


def _engine_run(engine, data):
    losses = []
    for ids, targets in data:
        loss = engine(ids, targets)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("opt_device", ["none", "cpu", "nvme"])
@pytest.mark.parametrize("param_device", ["none", "cpu", "nvme"])
def test_stage3_matches_torch_adamw(tmp_path, opt_device, param_device):
    """50 fp32 steps, clipping on, a tied embedding: losses to 1e-5 relative and final weights as close
    as the CPU Adam's own tests hold them; the parameters between steps hold no memory."""
    data = w.batches(EQUIV_STEPS)
    ref = w.model()
    ref_losses = _torch_run(ref, data)
    net = w.model()
    engine, _, _, _ = initialize(model=net, config=w.config(opt_device, param_device, str(tmp_path)))
    try:
        losses = _engine_run(engine, data)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        parked = [p for p, r in zip(net.parameters(), ref.parameters()) if r.numel() >= 100]
        assert parked and all(p.numel() == 0 for p in parked)  # [Note: parked params]: safe to read, no memory
        assert [p.norm() for p in parked] and net.state_dict()
        with engine.stage3.coordinator.gathered():
            for p, q in zip(net.parameters(), ref.parameters()):
                torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
        if param_device == "nvme":  # the shards went to NVMe and came back, prefetched along the recorded order
            io = engine.stage3.param_tier.store.stats()
            assert io.bytes_written_total > 0 and io.bytes_read_total > 0
            assert engine.stage3.coordinator.stats().prefetches > 0
    finally:
        engine.close()


class Deep(torch.nn.Module):
    def __init__(self, layers: int = 8, width: int = 32) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return torch.nn.functional.mse_loss(x, y)


def _deep():
    torch.manual_seed(0)
    return Deep()


UNIT, UNITS, PERSISTENT = 32 * 32, 8, 8 * 32  # Deep(): a unit per weight; the biases are persistent


@pytest.mark.parametrize("param_device", ["cpu", "nvme"])
@pytest.mark.parametrize("max_live,reuse,units_held", [
    (2500, 0, 1),  # nothing kept for reuse: only the unit in use
    (0, 0, 1),  # a limit below one unit: the unit in use still is gathered, nothing else
    (2500, 10 ** 9, 2),  # reuse wanted, but 2 units fit under 2500 elements and 3 do not
    (10 ** 9, 10 ** 9, UNITS),  # no limit: every unit stays gathered between forward and backward
])
def test_gathered_parameters_stay_within_max_live(tmp_path, max_live, reuse, units_held, param_device):
    """Eight 32x32 layers. The peak of gathered non-persistent elements never passes
    max(max_live, one unit), and is exactly the units the limits allow (from element counts); the
    bytes the unit buffers' storages held at the peak are those elements plus the persistent unit's
    (none with the shards in host memory on one rank: gathered by alias). Training still matches torch."""
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(4, 32, generator=g), torch.randn(4, 32, generator=g)) for _ in range(6)]
    ref_losses = _torch_run(_deep(), data)
    net = _deep()
    config = w.config("cpu", param_device, str(tmp_path), stage3_max_live_parameters=max_live,
                      stage3_max_reuse_distance=reuse)
    config["train_batch_size"] = 4
    engine, _, _, _ = initialize(model=net, config=config)
    try:
        losses = _engine_run(engine, data)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        stats = engine.stage3.coordinator.stats()
        assert stats.peak_live_numel <= max(max_live, UNIT)
        assert stats.peak_live_numel == units_held * UNIT
        padded_persistent = -(-PERSISTENT // 64) * 64  # the persistent unit is padded to ALIGN_ELEMENTS
        held = 4 * (units_held * UNIT + padded_persistent) if param_device == "nvme" else 0
        assert stats.peak_live_bytes == held
    finally:
        engine.close()


@pytest.mark.parametrize("param_device", ["cpu", "none"])
def test_one_rank_on_the_cpu_gathers_by_pointing_at_the_shard(tmp_path, param_device):
    """[Note: gather by alias]: gathered, every parameter is a view of its unit's shard (its address
    inside the shard, no copy: a write to the shard shows in the parameter); released, it holds no
    memory again; and the model trains as torch's (the step's writes reach the params)."""
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(4, 32, generator=g), torch.randn(4, 32, generator=g)) for _ in range(4)]
    ref_losses = _torch_run(_deep(), data)
    net = _deep()
    config = w.config("cpu", param_device, str(tmp_path), stage3_max_reuse_distance=0)
    config["train_batch_size"] = 4
    engine, _, _, _ = initialize(model=net, config=config)
    try:
        losses = _engine_run(engine, data)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        coordinator, layout = engine.stage3.coordinator, engine.stage3.layout
        params = list(net.parameters())
        units = [b for b in layout.buckets if b.index not in coordinator.plan.persistent]
        with coordinator.gathered_units(range(len(layout.buckets)), free=True):
            for b in units:
                shard = engine.stage3.shards.acquire(b.index)
                try:
                    for i in b.slots:
                        lo = layout.slots[i].offset - b.start
                        assert params[i].data_ptr() == shard[lo:].data_ptr(), f"param {i} is not its shard"
                    before = params[b.slots[0]].detach().clone()
                    shard[layout.slots[b.slots[0]].offset - b.start] += 1.0
                    assert params[b.slots[0]].detach().view(-1)[0] == before.view(-1)[0] + 1.0
                    shard[layout.slots[b.slots[0]].offset - b.start] -= 1.0
                finally:
                    engine.stage3.shards.release(b.index, dirty=False)
        assert all(params[i].untyped_storage().nbytes() == 0 for b in units for i in b.slots)
    finally:
        engine.close()


def test_init_context_builds_the_model_in_its_partitions(tmp_path):
    """Under init_context the model is meta (no memory); initialize puts it in its shards on NVMe one
    module at a time, never holding more than one layer plus the persistent params, and it trains
    exactly as the model built the plain way with the same seed."""
    config = w.config("nvme", "nvme", str(tmp_path))
    torch.manual_seed(0)
    with init_context(config):
        net = w.Tiny()
    assert all(p.is_meta for p in net.parameters())
    engine, _, _, _ = initialize(model=net, config=config)
    try:
        data = w.batches(STEPS)
        ref_losses = _torch_run(w.model(), data)
        parts = engine.stage3
        total = 4 * sum(b.numel for b in parts.layout.buckets)
        largest_layer = 4 * max(b.numel for b in parts.layout.buckets)
        persistent = 4 * sum(parts.layout.buckets[u].numel for u in parts.coordinator.plan.persistent)
        assert parts.materialize_peak_bytes <= largest_layer + persistent < total
        assert parts.param_tier.store.stats().bytes_written_total >= total  # every shard went to NVMe
        torch.testing.assert_close(torch.tensor(_engine_run(engine, data)), torch.tensor(ref_losses),
                                   rtol=1e-5, atol=0)
    finally:
        engine.close()


def _torchrun(args, *, ranks, timeout=240):
    env = dict(os.environ, PYTHONPATH=child_pythonpath(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, WORKER, *args] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
        "--standalone", WORKER, *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.parametrize("opt_device", ["none", "cpu", "nvme"])
@pytest.mark.parametrize("param_device", ["none", "cpu", "nvme"])
def test_two_ranks_match_torch(tmp_path, opt_device, param_device):
    """Two ranks under torchrun (gloo), each with half of the global batch, 50 fp32 steps: the mean of their
    losses is torch's full-batch loss and the final weights are torch's, to 1e-5; the ranks agree exactly."""
    data = w.batches(EQUIV_STEPS)
    ref = w.model()
    ref_losses = _torch_run(ref, data)
    _torchrun([opt_device, param_device, str(tmp_path), str(EQUIV_STEPS)], ranks=2)
    b0, b1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    mean = (torch.tensor(b0["losses"]) + torch.tensor(b1["losses"])) / 2
    torch.testing.assert_close(mean, torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for p, q, r in zip(ref.parameters(), b0["params"], b1["params"]):
        torch.testing.assert_close(q, p.detach(), rtol=1e-5, atol=1e-6)
        assert torch.equal(q, r)


@pytest.mark.parametrize("param_device,grads", [("cpu", "host"), ("nvme", "host"), ("nvme", "nvme")])
def test_checkpoint_resume_is_the_uninterrupted_run(tmp_path, param_device, grads):
    """Stage 3, optimizer on NVMe: save at step 10, load into a fresh engine, go on to 20: the same losses
    and weights bit for bit as one run to 20 (fp32); also with the gradient accumulators on NVMe."""
    data = w.batches(STEPS)
    config = w.config("nvme", param_device, str(tmp_path))
    config["offload"] = {"gradient_tier": grads}

    def engine_for():
        net = w.model()
        return initialize(model=net, config=config)[0], net

    whole, whole_net = engine_for()
    expected = _engine_run(whole, data)
    with whole.stage3.coordinator.gathered():
        expected_params = [p.detach().clone() for p in whole_net.parameters()]
    whole.close()
    first, _ = engine_for()
    _engine_run(first, data[:10])
    first.save_checkpoint(str(tmp_path / "ckpt"), client_state={"next": 10})
    first.close()
    resumed, net = engine_for()
    _, client = resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert client == {"next": 10} and resumed.global_steps == 10
    try:
        assert _engine_run(resumed, data[10:]) == expected[10:]
        with resumed.stage3.coordinator.gathered():
            for p, q in zip(net.parameters(), expected_params):
                assert torch.equal(p.detach(), q)
    finally:
        resumed.close()


class Reversible(Deep):
    """Deep, whose layers run last to first while ``reverse`` is set: a fetch order that changes."""

    reverse = False

    def forward(self, x, y):
        for layer in (reversed(self.layers) if self.reverse else self.layers):
            x = torch.tanh(layer(x))
        return torch.nn.functional.mse_loss(x, y)


def _fetches_per_step(tmp_path, reverse_at: list[bool], *, prefetch_numel: int = UNIT, reuse: int = 10 ** 9,
                      losses: list[float] | None = None) -> list[tuple[int, int]]:
    """(units gathered, shard prefetches started) in each step, the params on NVMe; the losses to ``losses``."""
    tmp_path.mkdir()
    torch.manual_seed(0)
    net = Reversible()
    g = torch.Generator().manual_seed(2)
    config = w.config("cpu", "nvme", str(tmp_path), stage3_max_live_parameters=10 * UNIT,
                      stage3_max_reuse_distance=reuse, stage3_prefetch_bucket_size=prefetch_numel)
    config["train_batch_size"] = 4
    engine, _, _, _ = initialize(model=net, config=config)
    per_step, before = [], (0, 0)
    try:
        for reverse in reverse_at:
            net.reverse = reverse
            loss = engine(torch.randn(4, 32, generator=g), torch.randn(4, 32, generator=g))
            engine.backward(loss)
            engine.step()
            if losses is not None:
                losses.append(loss.item())
            stats = engine.stage3.coordinator.stats()
            per_step.append((stats.gathers - before[0], stats.prefetches - before[1]))
            before = (stats.gathers, stats.prefetches)
    finally:
        engine.close()
    return per_step


def test_a_changed_fetch_order_replaces_the_recorded_one(tmp_path):
    """[Note: fetch order]: three steps in one order, then four in the reverse. The first reversed step
    follows the stale order (it fetches and prefetches more than it would knowing the order), and records
    the new one: from the next step on, the fetch statistics are those of a run that only ever ran
    reversed."""
    changed = _fetches_per_step(tmp_path / "changed", [False] * 3 + [True] * 4)
    always = _fetches_per_step(tmp_path / "always", [True] * 7)
    assert changed[:3] == always[:3]  # the same counts in either direction (a mirror image)
    assert changed[3] > always[3], "the step after the change should pay for the stale order"
    assert changed[4:] == always[4:]


def test_prefetches_along_a_stale_order_never_block_the_shard_needed_now(tmp_path):
    """A prefetch budget of every unit, more than the NVMe window holds: after the order changes the
    window fills with prefetches along the stale order, all in flight; the shard the forward needs
    then waits for the oldest of them to land and takes its place (it used to fail: no room). The
    run still matches torch."""
    pattern = [False] * 2 + [True] * 3
    torch.manual_seed(0)
    ref = Reversible()
    g = torch.Generator().manual_seed(2)
    opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.01)
    ref_losses = []
    for reverse in pattern:
        ref.reverse = reverse
        loss = ref(torch.randn(4, 32, generator=g), torch.randn(4, 32, generator=g))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        ref_losses.append(loss.item())
    losses: list[float] = []
    _fetches_per_step(tmp_path / "run", pattern, prefetch_numel=UNITS * UNIT, reuse=0, losses=losses)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
