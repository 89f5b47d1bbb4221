"""Stage 3's gradient accumulators on NVMe (offload.gradient_tier, [Note: gradient tier] in
offload.zero.grad_tier): the same training, bit for bit, as with resident accumulators, while
no accumulator holds host memory between steps; "auto" chooses by the host budget; the config
errors name the key."""
from __future__ import annotations

import contextlib

import pytest
import torch

from csrc import ConfigError
from offload import initialize
from offload.config import read_config
from tests.offload import stage3_worker as w
from tests.offload.test_stage3 import _engine_run, _torch_run

STEPS = 6


def _config(tmp_path, tier: str, *, param_device: str = "nvme", gas: int = 1, state_dtype: str = "fp32",
            optimizer: str = "nvme", **offload) -> dict:
    config = w.config(optimizer, param_device, str(tmp_path))
    if optimizer == "cpu":  # the accumulators' swap file goes under the optimizer's nvme_path
        config["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(tmp_path)
    config["train_batch_size"] = w.GLOBAL_BATCH * gas
    config["gradient_accumulation_steps"] = gas
    config["offload"] = {"gradient_tier": tier, "state_dtype": state_dtype, **offload}
    return config


def _train(config: dict, *, gas: int = 1, inspect=None, after_micro_step=None):
    """``inspect(engine)`` after each step, ``after_micro_step(engine, i)`` after each micro-step."""
    net = w.model()
    engine, _, _, _ = initialize(model=net, config=config)
    try:
        losses = []
        for i, (ids, targets) in enumerate(w.batches(STEPS * gas)):
            loss = engine(ids, targets)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if inspect is not None and (i + 1) % gas == 0:
                inspect(engine)
            if after_micro_step is not None:
                after_micro_step(engine, i)
        with engine.stage3.coordinator.gathered():
            params = [p.detach().clone() for p in net.parameters()]
        return losses, params, engine.adam.storage.grads_tier is not None
    finally:
        engine.close()


def _grads_all_on_nvme(engine) -> None:
    """After a step: every accumulator is on NVMe (none holds host memory), and has an NVMe copy."""
    storage = engine.adam.storage
    storage.drain()
    for sg in engine.layout.sub_groups:
        assert storage.tier.info(f"grad.{sg.index}").tier.value == "nvme", sg.index


@pytest.mark.parametrize("param_device,gas,state_dtype,optimizer", [
    ("nvme", 1, "fp32", "nvme"), ("cpu", 2, "fp32", "nvme"), ("nvme", 2, "int8", "nvme"), ("cpu", 1, "bf16", "nvme"),
    ("cpu", 2, "fp32", "cpu"), ("none", 2, "int8", "cpu"), ("cpu", 1, "bf16", "cpu")])
def test_gradients_on_nvme_train_bit_equal_to_resident_ones(tmp_path, param_device, gas, state_dtype, optimizer):
    """Clipping on; with two micro-steps the second adds to what the first wrote back (a read). With the
    optimizer on cpu its state stays in host memory and only the accumulators go to NVMe ([Note: accumulators
    alone on NVMe] in offload.plan.tier_plan)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    kw = dict(param_device=param_device, gas=gas, state_dtype=state_dtype, optimizer=optimizer)
    host = _train(_config(tmp_path / "a", "host", **kw), gas=gas)
    nvme = _train(_config(tmp_path / "b", "nvme", **kw), gas=gas,
                  inspect=_grads_all_on_nvme if optimizer == "nvme" else _only_grads_on_nvme)
    assert host[2] is False and nvme[2] is True
    assert nvme[0] == host[0]
    assert all(torch.equal(a, b) for a, b in zip(nvme[1], host[1]))
    assert host[0][-1] < host[0][0]


def _only_grads_on_nvme(engine) -> None:
    """After a step with the optimizer on cpu: every accumulator on NVMe, every state block in host memory,
    and each accumulator's region the largest one's size, page-rounded (one size that comes and goes)."""
    _grads_all_on_nvme(engine)
    storage = engine.adam.storage
    sizes = {storage.tier.info(f"grad.{sg.index}").nbytes for sg in engine.layout.sub_groups}
    largest = max(sg.numel for sg in engine.layout.sub_groups) * storage.grad_dtype.itemsize
    assert sizes == {-(-largest // 4096) * 4096}
    for sg in engine.layout.sub_groups:
        assert storage.tier.info(f"state.{sg.index}").tier.value != "nvme", sg.index


def test_the_accumulators_are_written_and_read_through_nvme(tmp_path):
    """Bytes moved by the optimizer's tier grow by the accumulators: written once a step (each landed
    block goes back), read once (the step's pass), beside the state blocks."""
    moved, seen = {}, []

    def io(engine):
        s = engine.adam.storage.tier.stats()
        seen.append((s.bytes_read_total, s.bytes_written_total))

    for tier in ("host", "nvme"):
        (tmp_path / tier).mkdir()
        seen.clear()
        _train(_config(tmp_path / tier, tier), inspect=io)
        (r0, w0), (r1, w1) = seen[-2], seen[-1]
        moved[tier] = (r1 - r0, w1 - w0)
    grad_bytes = 4 * sum(sg.numel for sg in _layout(tmp_path))
    assert moved["nvme"][0] - moved["host"][0] >= grad_bytes  # read: the step's pass
    assert moved["nvme"][1] - moved["host"][1] >= grad_bytes  # written: landed blocks going back


def _layout(tmp_path):
    net = w.model()
    (tmp_path / "l").mkdir(exist_ok=True)
    engine, _, _, _ = initialize(model=net, config=_config(tmp_path / "l", "host"))
    try:
        return list(engine.layout.sub_groups)
    finally:
        engine.close()


def test_auto_chooses_by_the_host_budget(tmp_path, monkeypatch):
    """Without offload.host_memory_bytes the budget is half the memory available: made smaller than the
    accumulators here, "auto" puts them on NVMe; left as it is, in host memory. The same training."""
    from offload.plan import budget as window

    grad_bytes = 4 * sum(sg.numel for sg in _layout(tmp_path))
    (tmp_path / "small").mkdir()
    (tmp_path / "large").mkdir()
    large = _train(_config(tmp_path / "large", "auto"))
    monkeypatch.setattr(window, "available_bytes", lambda: 2 * grad_bytes - 2)
    small = _train(_config(tmp_path / "small", "auto"))
    assert small[2] is True and large[2] is False
    assert small[0] == large[0]


def test_auto_keeps_stages_0_to_2_and_a_cpu_optimizer_resident():
    from offload.zero.grad_tier import gradients_on_nvme

    tiny = {"partition_numel": 10 ** 9, "host_memory_bytes": 1 << 20}
    assert gradients_on_nvme("auto", stage=3, optimizer_nvme=True, **tiny)
    assert not gradients_on_nvme("auto", stage=2, optimizer_nvme=True, **tiny)
    assert not gradients_on_nvme("auto", stage=3, optimizer_nvme=False, **tiny)
    assert not gradients_on_nvme("host", stage=3, optimizer_nvme=True, **tiny)
    assert not gradients_on_nvme("auto", stage=3, optimizer_nvme=True, partition_numel=1000,
                                 host_memory_bytes=1 << 20)


@pytest.mark.parametrize("zero", [{"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}},
                                  {"stage": 3, "offload_optimizer": {"device": "none"}}])
def test_nvme_gradients_outside_stage3_with_an_offloaded_optimizer_are_an_error_naming_the_key(zero):
    with pytest.raises(ConfigError, match=r"offload.gradient_tier \"nvme\" needs zero_optimization.stage 3"):
        read_config({"train_batch_size": 8, "zero_optimization": zero, "offload": {"gradient_tier": "nvme"}}, world_size=1)


def test_an_unknown_gradient_tier_is_an_error_naming_the_key():
    with pytest.raises(ConfigError, match="gradient_tier"):
        read_config({"train_batch_size": 8, "offload": {"gradient_tier": "disk"}}, world_size=1)


def test_the_estimate_moves_the_accumulators_to_nvme_and_says_so():
    """A 2.36B GPT at stage 3, everything on NVMe, an 8 GiB host budget: "host" keeps 4 bytes per parameter
    resident (more than the budget), "nvme" moves them to the swap and into the window, which stays within
    the budget, and "auto" picks nvme (they exceed the budget)."""
    from offload.plan.estimate import EstimateInput, estimate, gpt_shapes
    from offload.plan.memory import GRADS_ON_NVME_PART

    shapes = gpt_shapes(vocab_size=69, n_layer=30, n_embd=2560, seq=32, batch=2, tied_head=True)
    rows = {}
    for tier in ("host", "nvme", "auto"):
        inp = EstimateInput(shapes=shapes, compute_bytes=2, state_dtype="int8", gradient_tier=tier,
                            host_memory_bytes=8 << 30)
        rows[tier] = estimate(inp, stages=(3,)).row(stage=3, optimizer="nvme", param="nvme")
    grads = dict((what, n) for what, _, n in rows["host"].parts)["fp32 gradient accumulators"]
    assert grads >= 4 * shapes.params
    nvme = {what: (where, n) for what, where, n in rows["nvme"].parts}
    assert nvme[GRADS_ON_NVME_PART] == ("nvme", grads)
    def on_nvme(row):  # what goes to the swap, less its rounding up to whole stripes
        return sum(b for what, where, b in row.parts if where == "nvme" and not what.startswith("rest of"))
    assert on_nvme(rows["nvme"]) == on_nvme(rows["host"]) + grads
    window = [n for what, where, n in rows["nvme"].parts if what.startswith("state window") and where == "host"]
    assert len(window) == 1 and window[0] <= 8 << 30  # the window takes the budget, accumulators and all
    assert rows["host"].host_bytes > grads > 8 << 30 and rows["nvme"].host_bytes < rows["host"].host_bytes
    assert rows["auto"] == rows["nvme"]


def test_the_pool_never_fragments_between_blocks_and_accumulators(tmp_path):
    """[Note: one slot a region]: a window of 2 places, 24 KiB state blocks and 16 KiB accumulators.
    Freed in this order, a first-fit pool of the same bytes would hold 24 KiB free in no run long enough
    for the third block; with one slot a region every allocation finds room while at most 2 x window
    regions are held."""
    from offload.config.sections import AioConfig
    from offload.plan.tier_plan import plan_bytes
    from offload.tiers import open_tier

    plan = plan_bytes([4096] * 4, window=2, nvme=True, nvme_path=str(tmp_path), state_bytes=[24 << 10] * 4,
                      grads_nvme=True)
    assert plan.slot_bytes == 24 << 10 and plan.resident_bytes == 4 * (24 << 10)
    tier = open_tier(plan, daemon_socket=None, job_id="t", rank=0, aio=AioConfig(), checksum=False)
    store = tier.store
    try:
        sizes = {"s1": 24 << 10, "s2": 24 << 10, "g1": 16 << 10, "g2": 16 << 10, "g3": 16 << 10, "s3": 24 << 10}
        for step in ("s1", "s2", "g1", "g2", "-s1", "g3", "-g1", "s3"):
            if step.startswith("-"):
                store.free(step[1:])
            else:
                store.allocate(step, sizes[step])
        assert sorted(store.names()) == ["g2", "g3", "s2", "s3"]
    finally:
        tier.close()


@pytest.mark.parametrize("stage,opt_device,tier", [(2, "cpu", "host"), (3, "nvme", "host"), (3, "nvme", "nvme")])
def test_bf16_accumulators_train_as_torch_on_bf16_rounded_gradients(tmp_path, stage, opt_device, tier):
    """data_types.grad_accum_dtype bf16: the accumulators take 2 bytes an element (resident or on NVMe) and
    the training is torch's AdamW on the gradients rounded to bf16, clipping on (the norm of what is stored)."""
    data = w.batches(STEPS)
    ref = w.model()
    want = _torch_run(ref, data, bf16_grads=True)
    config = w.config(opt_device, "nvme" if stage == 3 else "none", str(tmp_path))
    config["zero_optimization"]["stage"] = stage
    if stage != 3:
        del config["zero_optimization"]["offload_param"]
    config["data_types"] = {"grad_accum_dtype": "bf16"}
    config["offload"] = {"gradient_tier": tier}
    net = w.model()
    engine, _, _, _ = initialize(model=net, config=config)
    try:
        losses = _engine_run(engine, data)
        storage = engine.adam.storage
        for sg in engine.layout.sub_groups:
            assert storage.tier.info(f"grad.{sg.index}").nbytes == 2 * sg.numel
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5, atol=0)
        gathered = engine.stage3.coordinator.gathered() if stage == 3 else contextlib.nullcontext()
        with gathered:
            ours = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        theirs = torch.cat([q.detach().reshape(-1) for q in ref.parameters()])
        # A gradient one fp32 ulp off torch's (another summation order) can round to the neighbouring bf16
        # value: those few elements move apart by ~1e-4 relative; every other one is as close as fp32 runs are.
        apart = ~torch.isclose(ours, theirs, rtol=1e-5, atol=1e-6)
        assert int(apart.sum()) <= ours.numel() // 200, int(apart.sum())
        torch.testing.assert_close(ours, theirs, rtol=2e-3, atol=1e-4)
    finally:
        engine.close()


@pytest.mark.parametrize("config", [
    {"data_types": {"grad_accum_dtype": "fp16"}},
    {"data_types": {"grad_accum_dtype": "bf16"}},  # the optimizer not offloaded
    {"data_types": {"grad_accum_dtype": "bf16"}, "offload": {"delayed_update": True},
     "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
])
def test_unsupported_accumulator_dtypes_are_errors_naming_the_key(config):
    with pytest.raises(ConfigError, match="grad_accum_dtype"):
        read_config({"train_batch_size": 8, **config}, world_size=1)


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_the_estimate_counts_bf16_accumulators_at_two_bytes(tier, capsys):
    """10 Mi elements at stage 3, optimizer on NVMe: the accumulators' part is 2 bytes an element, in host
    memory or on NVMe as the gradient tier puts them; the command line takes the dtype too."""
    from offload.cli import main
    from offload.plan.estimate import EstimateInput, estimate, shapes_from_count

    n, mi = 10 << 20, 1 << 20
    rows = {d: estimate(EstimateInput(shapes=shapes_from_count(n, largest_layer=mi), compute_bytes=2,
                                      gradient_tier=tier, grad_accum_dtype=d), stages=(3,))
            .row(stage=3, optimizer="nvme", param="nvme") for d in ("fp32", "bf16")}
    parts = {d: {what: (where, b) for what, where, b in r.parts if what.startswith(("fp32 grad", "bf16 grad"))}
             for d, r in rows.items()}
    (fp32_where, fp32_bytes), = parts["fp32"].values()
    (bf16_what, (bf16_where, bf16_bytes)), = parts["bf16"].items()
    assert bf16_what.startswith("bf16 gradient accumulators") and bf16_where == fp32_where
    assert fp32_bytes == 2 * bf16_bytes >= 4 * n
    assert main(["estimate", "--params", "1e8", "--no-baseline", "--stage", "3", "--detail", "3,nvme,nvme",
                 "--gradient-tier", tier, "--grad-accum-dtype", "bf16"]) == 0
    assert "bf16 gradient accumulators" in capsys.readouterr().out


def test_a_part_landed_accumulator_left_by_a_cut_backward_is_counted_afresh(tmp_path):
    """A backward cut off after landing one piece of a sub-group that spans buckets: the next micro-step
    must not take its own landings for that sub-group's last ones (sending it back early, after which the
    next piece would claim it as zeros). The steps after are the uninterrupted run's, bit for bit."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ref = _train(_config(tmp_path / "a", "nvme"))

    def cut_once(engine, state={"done": False}):
        if state["done"]:
            return
        state["done"] = True
        storage = engine.adam.storage
        sg = next(g for g in engine.layout.sub_groups if len(g.pieces) >= 2)
        storage.grad_for_landing(sg.index, True).fill_(7.0)  # one piece's landing, then the backward dies
        storage.grad_landed(sg.index)

    got = _train(_config(tmp_path / "b", "nvme"), inspect=cut_once)
    assert got[0][1:] == ref[0][1:]
    assert all(torch.equal(a, b) for a, b in zip(got[1], ref[1]))


def test_a_cut_backward_keeps_what_it_added_on_nvme_as_in_host_memory(tmp_path):
    """Two micro-steps a step; at the first step's second micro-step a backward adds one piece of a sub-group
    that spans buckets, then dies. What it added stays in the accumulator (as autograd's .grad keeps what a
    cut backward accumulated): the next micro-step's backward writes the part-landed accumulator back as it
    is, so with the accumulators on NVMe the run is the resident accumulators' run, bit for bit."""
    def cut_once(engine, i):
        if i != 0:  # after the cycle's first micro-step: the cut backward adds to what that one wrote back
            return
        storage = engine.adam.storage
        sg = next(g for g in engine.layout.sub_groups if len(g.pieces) >= 2)
        piece = sg.pieces[0]
        storage.begin_landing()
        acc = storage.grad_for_landing(sg.index, False)
        acc[piece.sub_start:piece.sub_start + piece.numel].add_(7.0)  # one piece's landing, then the backward dies
        storage.grad_landed(sg.index)

    runs = {}
    for tier in ("host", "nvme"):
        (tmp_path / tier).mkdir()
        runs[tier] = _train(_config(tmp_path / tier, tier, gas=2), gas=2, after_micro_step=cut_once)
    (tmp_path / "uncut").mkdir()
    uncut = _train(_config(tmp_path / "uncut", "host", gas=2), gas=2)
    assert runs["nvme"][0] == runs["host"][0]
    assert all(torch.equal(a, b) for a, b in zip(runs["nvme"][1], runs["host"][1]))
    assert not all(torch.equal(a, b) for a, b in zip(runs["host"][1], uncut[1]))  # the cut's landing counted


def test_nvme_gradients_beside_a_cpu_optimizer_need_its_nvme_path():
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu"}}
    with pytest.raises(ConfigError, match=r"zero_optimization.offload_optimizer.nvme_path=None: set it .* when "
                                          r"offload.gradient_tier is 'nvme'"):
        read_config({"train_batch_size": 8, "zero_optimization": zero, "offload": {"gradient_tier": "nvme"}}, world_size=1)
