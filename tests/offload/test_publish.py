"""[Note: publish as stepped] in offload.zero.optimizer: each sub-group's updated params start for the device
as soon as its Adam pass has written them, where nothing reads the params before ``publish``; the result is
the whole-partition copy's, bit for bit. On the CPU, a Fetcher without a GPU (copies at once, as the engine's
on a GPU queues them) is given to the optimizer, and what it is asked to copy, and when, is recorded beside the
order of the Adam passes."""
from __future__ import annotations

import pytest
import torch

from offload.gpu.transfers import Fetcher
from offload.zero import optimizer as optimizer_module
from tests.offload.harness import engine_config, make_batches, run_engine, twin_models

STEPS = 6
BATCH = 8


class RecordingFetcher(Fetcher):
    """The CPU's Fetcher, telling ``log`` which sub-groups each start_fetch copies."""

    def __init__(self, adam, log: list) -> None:
        super().__init__(torch.device("cpu"))
        self.adam, self.log = adam, log

    def start_fetch(self, pairs):
        starts = {dst.data_ptr() for dst, _ in pairs}
        sgs = sorted({sg.index for sg in self.adam.layout.sub_groups for p in sg.pieces
                      if self.adam.flat_params[p.flat_start:].data_ptr() in starts})
        self.log.append(("fetch", tuple(sgs)))
        return super().start_fetch(pairs)


def _run(monkeypatch, *, fetcher: bool, offload: dict, device: str = "cpu", tmp_path=None, gas: int = 1):
    log: list = []
    init, step_one = optimizer_module.PartitionedAdam.__init__, optimizer_module.PartitionedAdam._step_sub_group

    def patched_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if fetcher:
            self._fetcher = RecordingFetcher(self, log)

    def logged_step(self, sg, *args, **kwargs):
        log.append(("adam", sg.index))
        return step_one(self, sg, *args, **kwargs)

    monkeypatch.setattr(optimizer_module.PartitionedAdam, "__init__", patched_init)
    monkeypatch.setattr(optimizer_module.PartitionedAdam, "_step_sub_group", logged_step)
    model, _ = twin_models()
    config = engine_config(stage=1, device=device, nvme_path=tmp_path, batch_size=BATCH, gas=gas, offload=offload)
    config["zero_optimization"]["sub_group_size"] = 300  # several sub-groups of the twin model
    seen = {}

    def inspect(engine, step):
        seen["sub_groups"] = len(engine.layout.sub_groups)
        seen["early"] = engine.overlap.early_sub_groups if engine.overlap is not None else 0

    losses, params = run_engine(model, config, make_batches(STEPS, BATCH * gas), gas=gas, on_step=inspect)
    return losses, params, log, seen


def _steps(log: list) -> list[list]:
    """The log cut where a step's passes begin (sub-group 0's pass: the first to land, and the first stepped)."""
    out: list[list] = []
    for entry in log:
        if entry == ("adam", 0) or not out:
            out.append([])
        out[-1].append(entry)
    return out


@pytest.mark.parametrize("device,gas", [("cpu", 1), ("nvme", 2)])
def test_each_sub_group_goes_to_the_device_as_it_is_stepped(monkeypatch, tmp_path, device, gas):
    offload = {"overlap_step": True}
    losses, params, log, seen = _run(monkeypatch, fetcher=True, offload=offload, device=device, tmp_path=tmp_path,
                                     gas=gas)
    n = seen["sub_groups"]
    assert n >= 3 and seen["early"] > 0  # several sub-groups, some stepped under backward
    steps = _steps(log)
    assert len(steps) == STEPS
    for step in steps:
        # the sub-groups stepped under backward go over together once the verdict holds (before any later pass),
        # then each later one alone right after its own pass: none is left for publish, none goes twice
        first = next(i for i, e in enumerate(step) if e[0] == "fetch")
        early = [e[1] for e in step[:first]]
        assert step[first] == ("fetch", tuple(early)) and early == list(range(len(early))), step
        later = step[first + 1:]
        assert later == [x for i in range(len(early), n) for x in (("adam", i), ("fetch", (i,)))], step
    # the same training as the whole-partition copy at publish (no fetcher: the copy the CPU makes)
    (tmp_path / "ref").mkdir()
    ref_losses, ref_params, ref_log, _ = _run(monkeypatch, fetcher=False, offload=offload, device=device,
                                              tmp_path=tmp_path / "ref", gas=gas)
    assert not any(e[0] == "fetch" for e in ref_log)
    assert losses == ref_losses
    for name in ref_params:
        assert torch.equal(params[name], ref_params[name]), name


def test_the_delayed_update_publishes_whole_at_the_next_boundary(monkeypatch):
    """Its step runs beside the next forward, which reads the params: nothing goes over before publish."""
    losses, params, log, seen = _run(monkeypatch, fetcher=True,
                                     offload={"delayed_update": True, "delayed_update_warmup_steps": 1})
    n = seen["sub_groups"]
    fetches = [e[1] for e in log if e[0] == "fetch"]
    # the warm-up step is an ordinary one (each sub-group as it is stepped); the delayed ones go whole
    assert fetches[:n] == [(i,) for i in range(n)], fetches
    assert len(fetches) > n and all(f == tuple(range(n)) for f in fetches[n:]), fetches


def test_a_step_cut_short_leaves_nothing_unpublished(monkeypatch, tmp_path):
    """A step that raises after some sub-groups went over: the params written again from the masters (a
    checkpoint loaded, say) all go over, those too, and equal the masters."""
    from offload.builder import initialize
    from tests.offload.harness import loss_fn

    log: list = []
    init = optimizer_module.PartitionedAdam.__init__

    def patched_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._fetcher = RecordingFetcher(self, log)

    monkeypatch.setattr(optimizer_module.PartitionedAdam, "__init__", patched_init)
    model, _ = twin_models()
    config = engine_config(stage=1, device="cpu", batch_size=BATCH, offload={"overlap_step": False})
    config["zero_optimization"]["sub_group_size"] = 300
    engine, _, _, _ = initialize(model=model, config=config)
    try:
        engine.adam.use_staging()  # a GPU model's staging buffer, on the CPU
        step_one = engine.adam._step_sub_group

        def failing(sg, *args, **kwargs):
            if sg.index == 2:
                raise RuntimeError("planted")
            return step_one(sg, *args, **kwargs)

        engine.adam._step_sub_group = failing
        (x, y), = make_batches(1, BATCH)
        engine.backward(loss_fn(engine(x), y))
        with pytest.raises(RuntimeError, match="planted"):
            engine.step()
        assert [e for e in log if e[0] == "fetch"] == [("fetch", (0,)), ("fetch", (1,))]
        log.clear()
        engine.adam._step_sub_group = step_one
        engine.adam.write_params_from_master()
        n = len(engine.layout.sub_groups)
        assert log == [("fetch", tuple(range(n)))]
        for sg, state in engine.adam.iter_states():
            master = engine.adam.storage.format.master(sg, state)
            for p in sg.pieces:
                flat = engine.adam.flat_params[p.flat_start:p.flat_start + p.numel]
                assert torch.equal(flat, master[p.sub_start:p.sub_start + p.numel].to(flat.dtype))
    finally:
        engine.close()
