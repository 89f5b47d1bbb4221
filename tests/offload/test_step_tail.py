"""[Note: the step under the next forward] in offload.zero.step_tail: with ``offload.step_under_forward`` the
sub-groups left after backward are stepped on the overlap's worker while the next forward runs, each module
waiting only for its own params. Oracles: the serial step (``overlap_step`` false), bit for bit; torch's AdamW.
The worker is slowed here (a sleep per Adam pass on its thread) so that the forward really runs beside it:
a module that read its params without waiting would read the last step's."""
from __future__ import annotations

import threading

import pytest
import torch

from csrc import ConfigError
from offload.builder import initialize
from offload.config import read_config
from offload.zero import optimizer as optimizer_module
from tests.offload.conftest import FEW_EARLY
from tests.offload.harness import (
    HIDDEN, IN_FEATURES, OUT_FEATURES, engine_config, loss_fn, make_batches, param_groups, run_engine, run_torch, twin_models,
)

STEPS = 8
BATCH = 8


@pytest.fixture(autouse=True)
def _few_early(few_early):
    """(tests/offload/conftest.py's ``few_early``, for every test here)"""


def _config(tmp_path, *, tail: bool, overlap: bool = True, device: str = "cpu", stage: int = 1, gas: int = 1,
            ratio: float | None = None, clip: float = 0.0):
    config = engine_config(stage=stage, device=device, nvme_path=tmp_path, batch_size=BATCH, gas=gas,
                           gradient_clipping=clip, offload={"overlap_step": overlap, "step_under_forward": tail})
    config["zero_optimization"]["sub_group_size"] = 300  # a dozen sub-groups of the tiny model
    if ratio is not None:
        config["zero_optimization"]["offload_optimizer"]["ratio"] = ratio
    return config


def _run(tmp_path, **kw):
    model, _ = twin_models()
    gas = kw.get("gas", 1)
    seen: dict = {"waits": [], "sub_groups": 0}

    def inspect(engine, step):
        tail = engine.overlap.tail if engine.overlap is not None else None
        seen["sub_groups"] = len(engine.layout.sub_groups)
        if tail is not None:  # the schedule: which sub-groups under backward, which under the next forward
            seen.setdefault("schedule", []).append((list(engine.overlap.last_early), list(tail._order)))
        seen["stats"] = engine.offload_stats()
        if tail is not None:
            seen["waits"].append(list(tail.last_waits))  # the forward of this step, under the last step's tail
            seen["busy"] = seen.get("busy", 0) + tail.busy

    losses, params = run_engine(model, _config(tmp_path, **kw), make_batches(STEPS, BATCH * gas), gas=gas,
                                on_step=inspect)
    return losses, params, seen


@pytest.mark.parametrize("stage,device,gas,ratio,clip", [
    (0, "cpu", 1, None, 0.0), (1, "nvme", 1, None, 0.0), (2, "cpu", 2, None, 5.0), (1, "cpu", 1, 0.5, 0.0),
])
def test_the_step_under_the_forward_is_the_serial_step_bit_for_bit(slow_worker, tmp_path, stage, device, gas,
                                                                    ratio, clip):
    losses, params, seen = _run(tmp_path, tail=True, stage=stage, device=device, gas=gas, ratio=ratio, clip=clip)
    serial_losses, serial_params, _ = _run(tmp_path, tail=False, overlap=False, stage=stage, device=device, gas=gas,
                                           ratio=ratio, clip=clip)
    assert losses == serial_losses
    for name in params:
        assert torch.equal(params[name], serial_params[name]), name
    stats = seen["stats"]
    assert stats.sub_groups_stepped_under_forward_total > 0 and seen["busy"] == STEPS  # each step left a tail
    n = seen["sub_groups"]
    for early, tail in seen["schedule"]:  # every host sub-group once: the first under backward, the rest after
        kept = set(range(n)) - set(early) - set(tail)
        assert not set(early) & set(tail) and len(early) <= FEW_EARLY and early == sorted(early)
        assert all(i > max(early, default=-1) for i in kept) and (ratio is not None or not kept)
    assert stats.forward_wait_seconds_total > 0
    n = seen["sub_groups"]
    for waits in seen["waits"][1:]:  # every forward after a step waited, module by module, along the order
        needs = [need for _, need in waits]
        assert needs and needs == sorted(needs) and len(set(needs)) == len(needs)
        assert needs[-1] <= n
        if ratio is None:  # (with half on the device, the tail is two sub-groups, one module's)
            assert needs[0] < needs[-1]  # the first module waited for a part, not for the whole step


def test_modules_wait_in_the_order_the_forward_reaches_them(slow_worker, tmp_path):
    """TinyNet's forward reaches the root (its unused param), fc1, ln1, fc2, ln2, head: the tail steps their
    sub-groups in that order, and each module waits only for the order up to its own last sub-group, all of
    them its own or an earlier module's."""
    model, _ = twin_models()
    engine, _, _, _ = initialize(model=model, config=_config(tmp_path, tail=True), model_parameters=param_groups(model))
    try:
        tail, layout = engine.overlap.tail, engine.layout
        for x, y in make_batches(3, BATCH):
            engine.backward(loss_fn(engine(x), y))
            engine.step()
        sgs_of: dict[str, set[int]] = {}
        for sg in layout.sub_groups:
            for p in sg.pieces:
                for slot, _, _, _ in layout.param_runs(p):
                    module = slot.name.rpartition(".")[0] or "<root>"
                    sgs_of.setdefault(module, set()).add(sg.index)
        forward = ["<root>", "fc1", "ln1", "fc2", "ln2", "head"]
        assert tail.forward_order == forward
        order = tail.order(set(range(len(layout.sub_groups))) - set(range(FEW_EARLY)))  # this step's tail, as stepped
        waits = tail.last_waits  # the third forward's, under the second step's tail (the same order)
        assert len(waits) >= 3 and [name for name, _ in waits] == [m for m in forward if m in dict(waits)]
        for name, need in waits:
            before = set().union(*(sgs_of[m] for m in forward[:forward.index(name) + 1]))
            assert need == 1 + max(order.index(s) for s in sgs_of[name] if s in order)
            assert set(order[:need]) <= before, (name, need, order)
        assert waits[0][1] < len(order)  # the first module waited for a part of the tail, not all of it
    finally:
        engine.close()


class Backwards(torch.nn.Module):
    """Its modules registered in the reverse of the order its forward calls them: the sub-groups' own order (cut
    from the last registered) is then the forward's reversed, and only the recorded forward order steps fc1's
    first."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = torch.nn.Linear(HIDDEN, OUT_FEATURES)
        self.fc2 = torch.nn.Linear(HIDDEN, HIDDEN)
        self.fc1 = torch.nn.Linear(IN_FEATURES, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.nn.functional.gelu(self.fc2(torch.nn.functional.gelu(self.fc1(x)))))


def test_the_first_module_called_is_stepped_first_whatever_the_registration(slow_worker, tmp_path):
    results = []
    for tail in (True, False):
        model = Backwards()
        engine, _, _, _ = initialize(model=model, config=_config(tmp_path, tail=tail, overlap=tail))
        try:
            for x, y in make_batches(4, BATCH):
                engine.backward(loss_fn(engine(x), y))
                engine.step()
            if tail:
                waits, order, layout = engine.overlap.tail.last_waits, engine.overlap.tail._order, engine.layout
                assert engine.overlap.tail.forward_order == ["fc1", "fc2", "head"]
            engine.settle()
            results.append({n: p.detach().clone() for n, p in model.named_parameters()})
        finally:
            engine.close()
    for name, value in results[0].items():
        assert torch.equal(value, results[1][name]), name
    fc1 = {sg.index for sg in layout.sub_groups for p in sg.pieces
           for slot, _, _, _ in layout.param_runs(p) if slot.name.startswith("fc1.")}
    assert waits[0][0] == "fc1" and set(order[:waits[0][1]]) <= fc1 and waits[0][1] < len(order)


def test_settle_gives_the_steps_params_to_a_script_that_reads_them(slow_worker, tmp_path):
    """Between step() and the next forward the params are not all the step's; engine.settle() makes them so,
    and so do the engine's own reads (consolidated_16bit_state_dict)."""
    engines = []
    for tail in (True, False):
        model, _ = twin_models()
        engines.append(initialize(model=model, config=_config(tmp_path, tail=tail, overlap=tail),
                                  model_parameters=param_groups(model))[0])
    try:
        for x, y in make_batches(3, BATCH):
            for engine in engines:
                engine.backward(loss_fn(engine(x), y))
                engine.step()
        ours, serial = engines
        assert ours.overlap.tail.busy
        state = ours.consolidated_16bit_state_dict()
        assert not ours.overlap.tail.busy
        for name, value in serial.consolidated_16bit_state_dict().items():
            assert torch.equal(state[name], value), name
        x, y = make_batches(1, BATCH, seed=7)[0]
        for engine in engines:
            engine.backward(loss_fn(engine(x), y))
            engine.step()
        ours.settle()
        for (name, a), (_, b) in zip(ours.module.named_parameters(), serial.module.named_parameters()):
            assert torch.equal(a, b), name
    finally:
        for engine in engines:
            engine.close()


def test_a_failure_on_the_worker_reaches_the_next_forward(monkeypatch, tmp_path):
    step_one = optimizer_module.PartitionedAdam._step_sub_group
    calls = {"n": 0}

    def failing(self, *args, **kwargs):
        if threading.current_thread().name.startswith("offload-overlap"):
            calls["n"] += 1
            if calls["n"] == 30:
                raise RuntimeError("planted failure in the tail's Adam pass")
        return step_one(self, *args, **kwargs)

    monkeypatch.setattr(optimizer_module.PartitionedAdam, "_step_sub_group", failing)
    model, _ = twin_models()
    engine, _, _, _ = initialize(model=model, config=_config(tmp_path, tail=True), model_parameters=param_groups(model))
    with pytest.raises(RuntimeError, match="planted failure"):
        for x, y in make_batches(STEPS, BATCH):
            engine.backward(loss_fn(engine(x), y))
            engine.step()
    with pytest.raises(RuntimeError, match="planted failure"):
        engine.close()  # raised again, once the tier is closed
    with pytest.raises(ConfigError, match="closed"):
        engine.tier.store.allocate("after", 4096)


def test_it_trains_as_torch_does(tmp_path):
    model, twin = twin_models()
    _, params = run_engine(model, _config(tmp_path, tail=True), make_batches(STEPS, BATCH))
    _, want = run_torch(twin, make_batches(STEPS, BATCH))
    for name, value in want.items():
        torch.testing.assert_close(params[name], value)


@pytest.mark.parametrize("change,words", [
    ({"overlap_step": False}, "overlap_step False"),
    ({"stage": 3}, "stage 3"),
    ({"device": "none"}, "offload_optimizer none"),
    ({"delayed_update": True}, "delayed_update True"),
])
def test_what_it_cannot_run_with_is_refused_by_name(change, words):
    offload = {"step_under_forward": True, "overlap_step": change.get("overlap_step", "auto"),
               **({"delayed_update": True, "overlap_step": "auto"} if "delayed_update" in change else {})}
    config = engine_config(stage=change.get("stage", 2), device=change.get("device", "cpu"), batch_size=BATCH,
                           offload=offload)
    with pytest.raises(ConfigError, match="step_under_forward") as info:
        read_config(config, world_size=1)
    assert words in str(info.value)


def test_where_the_step_gathers_after_it_the_tail_is_off(caplog):
    """Stages 1-2 over several ranks all-gather the shards after the step, and a CPU model has no overlapped
    step: the tail does not run, and says why."""
    from types import SimpleNamespace

    from offload.zero.step_tail import attach_tail

    adam = SimpleNamespace(gather=True, _node=None, _params_out=None)
    overlap = SimpleNamespace(tail=None, pool=None)
    with caplog.at_level("WARNING"):
        assert attach_tail(overlap, adam, torch.nn.Linear(2, 2), [], recorded=False) is None
        assert attach_tail(None, adam, torch.nn.Linear(2, 2), [], recorded=False) is None
    assert overlap.tail is None and "all-gathered" in caplog.text and "CPU model" in caplog.text
