"""offload.state_dtype: bf16 / int8 Adam moments in the tier (cpu and nvme), sized at their real
size, trained against torch's AdamW, and checkpoints that move between state dtypes."""
from __future__ import annotations

import math

import pytest
import torch

from cpu_adam.quant import dequantize
from offload.builder import initialize
from offload.config import read_config
from offload.zero.state_format import StateFormat
from tests.offload.harness import (assert_losses_close, engine_config, loss_fn, make_batches, param_groups,
                                   run_engine, run_torch, twin_models)

STEPS = 30


def _config(device, tmp_path, state_dtype, stage=2):
    return engine_config(stage=stage, device=device, nvme_path=tmp_path if device == "nvme" else None,
                         offload={"state_dtype": state_dtype})


@pytest.mark.parametrize("device", ["cpu", "nvme"])
@pytest.mark.parametrize("state_dtype,rel", [("bf16", 0.02), ("int8", 0.05)])
def test_training_tracks_torch_adamw(tmp_path, device, state_dtype, rel):
    ours_model, torch_model = twin_models()
    batches = make_batches(STEPS, 8)
    ours, _ = run_engine(ours_model, _config(device, tmp_path, state_dtype), batches)
    theirs = run_torch(torch_model, batches)[0]
    assert theirs[-1] < 0.5 * theirs[0]
    assert_losses_close(ours, theirs, rel=rel)


def test_unknown_state_dtype_is_an_error_naming_the_key():
    from csrc import ConfigError

    with pytest.raises(ConfigError, match=r"offload\.state_dtype.*fp8"):
        read_config(_config("cpu", None, "fp8"), world_size=1)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_state_blocks_have_their_real_size(tmp_path, device, state_dtype):
    model, _ = twin_models()
    engine, _, _, _ = initialize(model=model, config=_config(device, tmp_path, state_dtype),
                                 model_parameters=param_groups(model))
    try:
        layout = engine.layout
        n = sum(sg.numel for sg in layout.sub_groups)
        blocks = sum(math.ceil(p.numel / 256) for sg in layout.sub_groups for p in sg.pieces)
        want = {"fp32": 12 * n, "bf16": 8 * n,  # master 4 + two moments of 4 / 2 bytes
                "int8": sum(-(-6 * sg.numel // 4) * 4 for sg in layout.sub_groups) + 8 * blocks}[state_dtype]
        assert sum(engine.adam.storage.bytes_by_tier().values()) == want
        store = engine.adam.storage.tier
        for sg in layout.sub_groups:  # the tier's regions are that size too
            assert store.info(f"state.{sg.index}").nbytes == engine.adam.storage.format.state_bytes(sg)
    finally:
        engine.close()


def _trained(tmp_path, state_dtype, steps=5):
    model, _ = twin_models()
    engine, _, _, _ = initialize(model=model, config=_config("cpu", tmp_path, state_dtype),
                                 model_parameters=param_groups(model))
    for x, y in make_batches(steps, 8):
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    return engine


def _fp32_states(engine):
    fmt = engine.adam.storage.format
    return [fmt.unpack(sg, engine.adam.storage.state(sg.index)).clone() for sg in engine.layout.sub_groups]


@pytest.mark.parametrize("saved,loaded", [("int8", "fp32"), ("fp32", "int8"), ("bf16", "int8")])
def test_checkpoints_move_between_state_dtypes(tmp_path, saved, loaded):
    """Checkpoints hold fp32 (dequantized) states: what one dtype saved, another loads, with the
    masters exact and the moments as close as the loading dtype stores them."""
    src = _trained(tmp_path / "a", saved)
    try:
        src.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
        want = _fp32_states(src)
    finally:
        src.close()
    dst = _trained(tmp_path / "b", loaded, steps=1)
    try:
        dst.load_checkpoint(str(tmp_path / "ckpt"), tag="t")
        got = _fp32_states(dst)
        for sg, w, g in zip(dst.layout.sub_groups, want, got):
            n = sg.numel
            assert torch.equal(g[:n], w[:n])  # the fp32 master, bit for bit
            if loaded == "fp32":
                assert torch.equal(g[n:], w[n:])
            else:  # requantized: within one code's step of the largest value of each 256-block
                torch.testing.assert_close(g[n:2 * n], w[n:2 * n], rtol=0.02, atol=0.02 * w[n:2 * n].abs().max())
                torch.testing.assert_close(g[2 * n:], w[2 * n:], rtol=0.02, atol=0.02 * w[2 * n:].max())
            assert (g[2 * n:] >= 0).all()
    finally:
        dst.close()


def test_int8_blocks_hold_codes_and_scales_the_kernel_reads(tmp_path):
    """The int8 block's moments, read through its piece views and dequantized, are the fp32 moments
    that ``unpack`` (the checkpoint's view) gives."""
    engine = _trained(tmp_path, "int8")
    try:
        fmt = engine.adam.storage.format
        for sg in engine.layout.sub_groups:
            block = engine.adam.storage.state(sg.index)
            full = fmt.unpack(sg, block)
            for p in sg.pieces:
                st = fmt.piece(sg, block, p)
                a, b = p.sub_start, p.sub_start + p.numel
                assert torch.equal(dequantize(st.exp_avg, st.exp_avg_scale, signed=True), full[sg.numel + a:sg.numel + b])
                assert st.exp_avg_scale.abs().max() > 0  # it has been stepped
    finally:
        engine.close()


@pytest.mark.parametrize("state_dtype,per", [("fp32", 12.0), ("bf16", 8.0), ("int8", 6.0 + 8 / 256)])
def test_estimate_follows_the_state_bytes(state_dtype, per):
    """10 Mi elements, sub-groups of 4, 4 and 2 Mi (whole pages and 256-blocks): the state blocks on
    NVMe are ``per`` bytes an element (master 4 + moments), the host holds the fp32 grads and them all."""
    from offload.plan.estimate import EstimateInput, estimate, shapes_from_count

    n, mi = 10 << 20, 1 << 20
    row = estimate(EstimateInput(shapes=shapes_from_count(n, largest_layer=mi), compute_bytes=4,
                                 state_dtype=state_dtype)).row(stage=2, optimizer="nvme")
    states = sum(b for what, where, b in row.parts if where == "nvme" and "master + moments" in what)
    assert states == per * n and row.nvme_bytes == -(-states // (1 << 20)) * (1 << 20)  # the swap file: whole stripes
    assert row.host_bytes == 4 * n + per * n


def test_stage3_int8_states_track_torch_adamw(tmp_path):
    ours_model, torch_model = twin_models()
    batches = make_batches(STEPS, 8)
    ours, _ = run_engine(ours_model, _config("cpu", tmp_path, "int8", stage=3), batches)
    theirs = run_torch(torch_model, batches)[0]
    assert_losses_close(ours, theirs, rel=0.05)


def test_consolidate_of_an_int8_run_gives_its_fp32_masters(tmp_path):
    from offload.checkpoint import consolidate

    engine = _trained(tmp_path, "int8")
    try:
        path = engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters() if p.requires_grad}
    finally:
        engine.close()
    state = consolidate(path, str(tmp_path / "out.pt"))
    assert all(state[n].dtype == torch.float32 for n in params)
    for n, p in params.items():  # the CPU model's params are the masters the step wrote
        assert torch.equal(state[n], p), n
