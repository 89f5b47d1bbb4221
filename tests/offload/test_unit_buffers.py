"""Stage 3's unit gradient buffers, reused from unit to unit within a backward ([Note: unit buffers reused]),
or, one rank on the CPU, no buffer: the params' own gradients ([Note: gradients landed from the params]):
every unit landed holds exactly what a fresh zeroed buffer would (the gradients in their slots, zeros in
the padding and in the slots of parameters no gradient reached), against torch's own gradients."""
from __future__ import annotations

import torch

from offload import initialize
from tests.offload import stage3_worker as w

WIDTH, SKIPPED = 30, 3
# Weights of 900 and 930 elements: every unit padded to 960 (ALIGN_ELEMENTS 64), so buffers pass between
# units whose padding starts at different places. Backward lands 4, 2, 1, 0, then 3 (never used).
DIMS = [(30, 30), (30, 31), (31, 30), (30, 30), (30, 30)]


class Skips(torch.nn.Module):
    """Units of one padded size, one never used (its unit is landed at the end of backward with no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(i, o) for i, o in DIMS)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x, y):
        for i, layer in enumerate(self.layers):
            if i != SKIPPED:
                x = torch.tanh(layer(x))
        return torch.nn.functional.mse_loss(x, y)


def test_reused_unit_buffers_land_what_fresh_zeroed_ones_would(tmp_path):
    g = torch.Generator().manual_seed(4)
    data = [(torch.randn(4, WIDTH, generator=g), torch.randn(4, WIDTH, generator=g)) for _ in range(3)]
    ref = Skips()
    net = Skips()
    config = w.config("cpu", "cpu", str(tmp_path))
    config["train_batch_size"] = 4
    engine, _, _, _ = initialize(model=net, config=config)
    reducer = engine.reducer
    landed: list[tuple[int, torch.Tensor]] = []
    land = reducer._land

    def capture(bucket, grad, first, final):
        if isinstance(grad, torch.Tensor):
            landed.append((bucket.index, grad.clone()))
        else:  # one rank on the CPU: the params' own gradients, read through a source
            whole = torch.full((bucket.numel,), float("nan"))
            for off, t in grad(bucket.start, bucket.numel):
                whole[off:off + t.numel()] = t
            landed.append((bucket.index, whole))
        return land(bucket, grad, first, final)

    reducer._land = capture
    try:
        for step, (x, y) in enumerate(data):
            landed.clear()
            with engine.stage3.coordinator.gathered():  # the reference starts each step from the engine's params
                with torch.no_grad():
                    for p, q in zip(net.parameters(), ref.parameters()):
                        q.copy_(p)
            ref.zero_grad(set_to_none=True)
            ref(x, y).backward()
            engine.backward(engine(x, y))
            layout = engine.layout
            units = {b.index for b in layout.buckets}
            assert {u for u, _ in landed} == units, "every unit lands once per backward"
            grads = [q.grad for q in ref.parameters()]
            for u, got in landed:
                b = layout.buckets[u]
                want = torch.zeros(b.numel)
                for i in b.slots:
                    s = layout.slots[i]
                    if grads[i] is not None:
                        want[s.offset - b.start:s.offset - b.start + s.numel] = grads[i].reshape(-1)
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=f"step {step}, unit {u}")
            engine.step()
        assert len(landed) >= 3  # several units of one size: buffers were reused
    finally:
        engine.close()


def test_the_step_reads_no_param_shard_from_nvme(tmp_path):
    """[Note: the step reads no shard] The step overwrites every param of a shard: none is read from
    NVMe for it (the param tier's own read counter), and training still matches torch."""
    from tests.offload.test_stage3 import _torch_run

    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(4, WIDTH, generator=g), torch.randn(4, WIDTH, generator=g)) for _ in range(6)]
    ref_losses = _torch_run(Skips(), data)
    config = w.config("cpu", "nvme", str(tmp_path), offload_param={"device": "nvme", "nvme_path": str(tmp_path),
                                                                  "buffer_count": 3},
                      sub_group_size=10 ** 6)  # no shard split over sub-groups (one that is may be read again)
    config["train_batch_size"] = 4
    engine, _, _, _ = initialize(model=Skips(), config=config)
    store = engine.stage3.param_tier.store
    losses, step_reads, pass_reads = [], [], []
    try:
        for x, y in data:
            r0 = store.stats().bytes_read_total
            loss = engine(x, y)
            engine.backward(loss)
            r1 = store.stats().bytes_read_total
            engine.step()
            step_reads.append(store.stats().bytes_read_total - r1)
            pass_reads.append(r1 - r0)
            losses.append(loss.item())
        assert sum(pass_reads) > 0  # the shards do live on NVMe: forward and backward read them
        # After the step the persistent units (biases) are gathered again: those reads, and no other.
        layout, persistent = engine.layout, engine.stage3.coordinator.plan.persistent
        regather = sum(-(-layout.buckets[u].shard_numel * 4 // 4096) * 4096 for u in persistent)
        assert len(layout.buckets) - len(persistent) >= 4 and regather > 0
        assert step_reads == [regather] * len(data)
    finally:
        engine.close()
    # Unused layer 3 never gets a gradient here, and torch's AdamW skips it while the engine lands zeros
    # (weight decay moves it): the losses do not depend on it, as it is never used.
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)


def test_a_shard_given_back_mid_step_is_read_again(tmp_path):
    """Sub-groups of 512 elements split every 960-element shard, and the window holds two shards for
    the step's writes: a shard goes back to NVMe with one piece written and comes in again for the
    next; that time it is read (else the first piece would be lost). Training matches torch."""
    from tests.offload.test_stage3 import _engine_run, _torch_run

    g = torch.Generator().manual_seed(6)
    data = [(torch.randn(4, WIDTH, generator=g), torch.randn(4, WIDTH, generator=g)) for _ in range(6)]
    ref_losses = _torch_run(Skips(), data)
    config = w.config("cpu", "nvme", str(tmp_path), offload_param={"device": "nvme", "nvme_path": str(tmp_path),
                                                                  "buffer_count": 3}, sub_group_size=512)
    config["train_batch_size"] = 4
    net = Skips()
    engine, _, _, _ = initialize(model=net, config=config)
    try:
        losses = _engine_run(engine, data)
        with engine.stage3.coordinator.gathered():
            got = [p.detach().clone() for p in net.parameters()]
    finally:
        engine.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    ref = Skips()
    _torch_run(ref, data)
    for i, (p, q) in enumerate(zip(got, ref.parameters())):
        if i // 2 != SKIPPED:  # the unused layer: torch skips it, the engine decays it
            torch.testing.assert_close(p, q.detach(), rtol=1e-5, atol=1e-6)
