"""[Note: GPU-resident share] in offload.zero.device_share: ``offload_optimizer.ratio`` below 1 keeps the last
sub-groups' state on the model's device, stepped there by torch's fused AdamW, first; the rest is offloaded
as before. Oracles: torch's AdamW on the same model and data; the same split without the overlapped step,
bit for bit; the tier's own regions."""
from __future__ import annotations

import pytest
import torch

from csrc import ConfigError
from offload.builder import initialize
from offload.config import read_config
from offload.zero import optimizer as optimizer_module
from offload.zero.device_share import auto_ratio, device_buckets, device_sub_groups
from offload.zero.layout import FlatLayout
from tests.offload.harness import (
    engine_config, loss_fn, make_batches, param_groups, run_engine, run_torch, twin_models,
)

STEPS = 12
BATCH = 8


def _config(device: str, tmp_path, *, ratio, stage: int = 1, gas: int = 1, param: str = "none", **offload):
    config = engine_config(stage=stage, device=device, nvme_path=tmp_path, batch_size=BATCH, gas=gas,
                           offload=offload)
    config["zero_optimization"]["offload_optimizer"]["ratio"] = ratio
    if param != "none":
        config["zero_optimization"]["offload_param"] = {"device": param}
    if stage == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every param in a unit with shards
    return config


def _layout(sizes: list[int], sub: int) -> FlatLayout:
    return FlatLayout([(f"p{i}", (n,), 0) for i, n in enumerate(sizes)], world_size=1, rank=0,
                      bucket_numel=10**9, sub_group_numel=sub)


def test_the_last_sub_groups_nearest_the_share_are_kept():
    layout = _layout([640] * 10, 640)  # ten sub-groups of 640
    assert device_sub_groups(layout, 1.0) == frozenset()
    assert device_sub_groups(layout, 0.0) == frozenset(range(10))
    assert device_sub_groups(layout, 0.5) == frozenset(range(5, 10))
    assert device_sub_groups(layout, 0.72) == frozenset({7, 8, 9})  # 28% of the elements: 3 of 10 sub-groups
    assert device_sub_groups(layout, 0.96) == frozenset()  # 4%: nearer none than one
    # every piece of a device bucket is in a kept sub-group
    split = _layout([1000, 1000, 1200], 640)
    kept = device_sub_groups(split, 0.5)
    for b in device_buckets(split, kept):
        assert all(sg.index in kept for sg in split.sub_groups for p in sg.pieces if p.bucket == b)
    assert device_buckets(split, frozenset()) == frozenset()


def test_auto_keeps_what_the_device_has_free():
    layout = _layout([6400], 640)  # 6400 elements: 102,400 bytes on a device
    assert auto_ratio(layout, torch.device("cpu")) == 1.0
    cuda = torch.device("cuda", 0)
    total = 1_000_000
    assert auto_ratio(layout, cuda, free_bytes=total // 2, total_bytes=total) == 1.0  # nothing above the reserve
    assert auto_ratio(layout, cuda, free_bytes=total // 2 + 51_200, total_bytes=total) == pytest.approx(0.5)
    assert auto_ratio(layout, cuda, free_bytes=total, total_bytes=total) == 0.0  # all of it fits


@pytest.mark.parametrize("device,stage,gas,param", [("cpu", 1, 1, "none"), ("cpu", 2, 2, "none"), ("nvme", 2, 1, "none"),
                                                    ("cpu", 3, 1, "none"), ("cpu", 3, 2, "cpu"), ("nvme", 3, 1, "cpu")])
def test_a_split_optimizer_trains_as_torch_does(tmp_path, device, stage, gas, param):
    model, twin = twin_models()
    seen = {}

    def inspect(engine, step):
        storage = engine.adam.storage
        seen["kept"] = storage.on_device
        seen["bytes"] = storage.bytes_by_tier()
        seen["sizes"] = {sg.index: sg.numel for sg in engine.layout.sub_groups}
        for i in range(len(engine.layout.sub_groups)):  # the tier holds the offloaded share only
            name = f"state.{i}"
            if i in storage.on_device:
                with pytest.raises(ConfigError):
                    engine.tier.store.info(name)
            else:
                assert engine.tier.store.info(name).nbytes == 12 * seen["sizes"][i]

    config = _config(device, tmp_path, ratio=0.5, stage=stage, gas=gas, param=param)
    losses, params = run_engine(model, config, make_batches(STEPS, BATCH * gas), gas=gas, on_step=inspect)
    want_losses, want = run_torch(twin, make_batches(STEPS, BATCH * gas), gas=gas)
    n = len(seen["sizes"])
    assert n >= 4 and seen["kept"] == frozenset(range(n - len(seen["kept"]), n)) and 0 < len(seen["kept"]) < n
    assert seen["bytes"]["device"] == 12 * sum(seen["sizes"][i] for i in seen["kept"])
    assert seen["bytes"]["device"] + seen["bytes"]["host"] + seen["bytes"]["nvme"] == 12 * sum(seen["sizes"].values())
    assert losses == pytest.approx(want_losses, rel=1e-5)
    for name, value in want.items():
        torch.testing.assert_close(params[name], value)


def _spied(monkeypatch, model, config, batches, gas: int = 1):
    """Train; log, per Adam pass, the sub-group and whether cpu_adam (host) or torch stepped it."""
    log: list[tuple[int, bool]] = []
    current: list[int] = []
    step_sg, step_pieces = optimizer_module.PartitionedAdam._step_sub_group, optimizer_module.PartitionedAdam._step_pieces

    def logged_sg(self, sg, *args, **kwargs):
        current[:] = [sg.index]
        return step_sg(self, sg, *args, **kwargs)

    def logged_pieces(self, *args, host=True, **kwargs):
        if not log or log[-1] != (current[0], host):  # one entry a pass (a pass makes a call per param group)
            log.append((current[0], host))
        return step_pieces(self, *args, host=host, **kwargs)

    monkeypatch.setattr(optimizer_module.PartitionedAdam, "_step_sub_group", logged_sg)
    monkeypatch.setattr(optimizer_module.PartitionedAdam, "_step_pieces", logged_pieces)
    seen = {}

    def inspect(engine, step):
        seen["kept"] = engine.adam.storage.on_device
        seen["n"] = len(engine.layout.sub_groups)
        seen["early"] = engine.overlap.early_sub_groups if engine.overlap is not None else 0
        seen["rollbacks"] = engine.overlap.rollbacks if engine.overlap is not None else 0

    losses, params = run_engine(model, config, batches, gas=gas, on_step=inspect)
    return losses, params, log, seen


@pytest.mark.parametrize("clip", [0.0, 5.0])  # 5.0 clips some steps of this model at gas 2, not all (test_overlap)
def test_the_overlapped_split_is_the_serial_split_bit_for_bit(monkeypatch, tmp_path, clip):
    """The overlapped step takes the offloaded share under backward (undone where the clip bites), the device's
    share after it, first; the results are the same split's without the overlap, bit for bit."""
    runs = {}
    for overlap in (False, True):
        model, _ = twin_models()
        config = _config("cpu", tmp_path, ratio=0.5, stage=2, gas=2, overlap_step=overlap)
        config["gradient_clipping"] = clip
        runs[overlap] = _spied(monkeypatch, model, config, make_batches(STEPS, 2 * BATCH), gas=2)
    (l0, p0, log0, seen0), (l1, p1, log1, seen1) = runs[False], runs[True]
    kept, n = seen1["kept"], seen1["n"]
    assert l0 == l1
    for name in p0:
        assert torch.equal(p0[name], p1[name]), name
    assert seen1["early"] > 0 and seen0["early"] == 0
    if clip:
        assert seen1["rollbacks"] > 0
    for log in (log0, log1):
        assert all(host == (sg not in kept) for sg, host in log)  # torch steps the kept, cpu_adam the rest
        assert {sg for sg, _ in log} == set(range(n))
    # serial: every step takes the device's share first, then the host's in order
    step = [sg for sg, _ in log0[:len({sg for sg, _ in log0})]]
    assert step == sorted(kept) + sorted(set(range(n)) - kept)
    # overlapped: no kept sub-group is ever stepped under backward (none before the device's share of its step)
    starts = [k for k, (sg, _) in enumerate(log1) if sg == min(kept)]
    assert len(starts) == STEPS
    for a, b in zip(starts, starts[1:] + [len(log1)]):
        chunk = [sg for sg, _ in log1[a:b]]
        assert not kept & set(chunk[len(kept):])


def test_no_copy_of_the_staging_buffer_reaches_the_device_share(monkeypatch, tmp_path):
    """The overlapped step stages the offloaded share's params; the device's share is written in place and
    must not be copied over from the staging buffer (planting that copy breaks the torch comparison above)."""
    copied: list[int] = []
    staged = optimizer_module.PartitionedAdam._staged_pairs

    def logged(self, sgs):
        sgs = list(sgs)
        copied.extend(sgs)
        return staged(self, sgs)

    monkeypatch.setattr(optimizer_module.PartitionedAdam, "_staged_pairs", logged)
    model, twin = twin_models()
    seen = {}
    config = _config("cpu", tmp_path, ratio=0.5, stage=1, overlap_step=True)
    losses, params = run_engine(model, config, make_batches(STEPS, BATCH),
                                on_step=lambda engine, step: seen.update(kept=engine.adam.storage.on_device))
    _, want = run_torch(twin, make_batches(STEPS, BATCH))
    assert copied and not set(copied) & seen["kept"]
    for name, value in want.items():
        torch.testing.assert_close(params[name], value)


def test_ratio_zero_keeps_everything_on_the_device(tmp_path):
    model, twin = twin_models()
    losses, params = run_engine(model, _config("cpu", tmp_path, ratio=0.0), make_batches(STEPS, BATCH))
    _, want = run_torch(twin, make_batches(STEPS, BATCH))
    for name, value in want.items():
        torch.testing.assert_close(params[name], value)


@pytest.mark.parametrize("change,words", [
    ({"stage": 3, "offload": {"gradient_tier": "nvme"}}, "gradient_tier"),
    ({"device": "none"}, "device cpu or nvme"),
    ({"offload": {"delayed_update": True}}, "delayed_update"),
    ({"offload": {"state_dtype": "int8"}}, "state_dtype"),
    ({"offload": {"daemon_socket": "/tmp/none.sock"}}, "daemon"),
    ({"ratio": 1.5}, "ratio"),
    ({"ratio": "half"}, "ratio"),
    ({"ratio": True}, "ratio"),
])
def test_what_the_share_cannot_run_with_is_refused_by_name(tmp_path, change, words):
    config = engine_config(stage=change.get("stage", 2), device=change.get("device", "cpu"), batch_size=BATCH,
                           offload=change.get("offload", {}))
    config["zero_optimization"]["offload_optimizer"]["ratio"] = change.get("ratio", 0.5)
    with pytest.raises(ConfigError, match="ratio") as info:
        read_config(config, world_size=1)
    assert words in str(info.value)


def test_auto_on_a_cpu_model_offloads_it_all(tmp_path):
    model, _ = twin_models()
    engine, _, _, _ = initialize(model=model, config=_config("cpu", tmp_path, ratio="auto"),
                                 model_parameters=param_groups(model))
    try:
        assert engine.adam.storage.on_device == frozenset()
        x, y = make_batches(1, BATCH)[0]
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    finally:
        engine.close()


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_the_tier_is_planned_for_the_offloaded_share_only(tmp_path, device):
    """The memory plan's regions are the offloaded sub-groups' (a state block and an accumulator each), so the
    host pool (and swap) the engine opens shrink by the device's share."""
    from offload.plan.memory import engine_optimizer_plan

    layout = _layout([640] * 10, 640)
    config = read_config(_config(device, tmp_path, ratio=0.5, stage=2), world_size=1)
    full = engine_optimizer_plan(config, layout, log=False)
    half = engine_optimizer_plan(config, layout, log=False, on_device=device_sub_groups(layout, 0.5))
    assert len(full.tier.region_bytes) == 20 and len(half.tier.region_bytes) == 10
    assert sum(half.tier.region_bytes) * 2 == sum(full.tier.region_bytes)
    if device == "cpu":
        assert half.tier.resident_bytes * 2 == full.tier.resident_bytes
    else:
        assert half.tier.swap_bytes * 2 == full.tier.swap_bytes


@pytest.mark.parametrize("stage,opt", [(1, "cpu"), (2, "nvme")])
def test_the_estimate_prints_what_the_split_engine_allocates(tmp_path, monkeypatch, stage, opt):
    """``offload estimate --config`` with a ratio: the embedded store's pool and swap are its offloaded parts, byte
    for byte, and its device rows are the kept share's state and accumulators."""
    from tests.offload.test_memory_plan import _config as plan_config, _model, _row, stepped_within_the_estimate

    monkeypatch.delenv("OFFLOAD_DAEMON_SOCKET", raising=False)
    monkeypatch.setattr("offload.plan.budget.available_bytes", lambda: 64 << 20)
    config = plan_config(tmp_path, stage=stage, opt=opt)
    config["zero_optimization"]["offload_optimizer"]["ratio"] = 0.5
    model = _model()
    row = _row(config, model, None)
    engine, _, _, _ = initialize(model=model, config=config)
    try:
        stepped_within_the_estimate(engine, row)
        kept = sum(n for what, where, n in row.parts if where == "device" and "offload_optimizer.ratio" in what)
        storage = engine.adam.storage
        assert kept == storage.bytes_by_tier()["device"] + sum(storage.grad(i).nbytes for i in storage.on_device) > 0
    finally:
        engine.close()


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_a_checkpoint_of_the_split_state_resumes_bit_for_bit(tmp_path, device):
    """Saved after 4 steps and loaded into a new engine (its device share freshly made), 4 more steps are the
    uninterrupted run's, bit for bit: the kept share's master and moments go through the checkpoint too."""
    batches = make_batches(8, BATCH)

    def train(engine, part):
        for x, y in part:
            engine.backward(loss_fn(engine(x), y))
            engine.step()

    def fresh():
        model, _ = twin_models()
        config = _config(device, tmp_path / "swap", ratio=0.5, stage=2)
        return model, initialize(model=model, config=config, model_parameters=param_groups(model))[0]

    (tmp_path / "swap").mkdir()
    runs = []
    for interrupted in (False, True):
        model, engine = fresh()
        try:
            train(engine, batches[:4])
            if interrupted:
                engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
                engine.close()
                model, engine = fresh()
                engine.load_checkpoint(str(tmp_path / "ckpt"), tag="t")
            assert engine.adam.storage.on_device
            train(engine, batches[4:])
            runs.append({n: p.detach().clone() for n, p in model.named_parameters()})
        finally:
            engine.close()
    for name, value in runs[0].items():
        assert torch.equal(value, runs[1][name]), name


def test_the_device_sum_of_squares_is_the_hosts():
    """device_sumsq (gradients landed on the device: read once at the step) in chunks, against cpu_adam's own."""
    from cpu_adam import grad_sumsq
    from offload.zero.device_adam import device_sumsq

    t = torch.randn(1001, generator=torch.Generator().manual_seed(3))
    for chunk in (7, 1000, 1001, 1 << 24):
        assert float(device_sumsq(t, chunk=chunk)) == pytest.approx(grad_sumsq([t]), rel=1e-12)


def test_storage_refuses_kept_sub_groups_beside_accumulators_on_nvme():
    """The plan never asks for both (gradient_tier "auto" stays in host memory beside a kept share, "nvme" is a
    ConfigError): the storage says so rather than lose track of a kept accumulator."""
    from offload.zero.states import StateStorage

    layout = _layout([640] * 4, 640)
    with pytest.raises(ConfigError, match="accumulators off NVMe"):
        StateStorage(layout, tier=object(), nvme=False, device=torch.device("cpu"), window=2, grad_window=2,
                     on_device=frozenset({3}))
