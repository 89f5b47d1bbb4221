"""offload.master_dtype "bf16": the offloaded master stored as bfloat16 beside compressed moments
([Note: a bf16 master] in csrc/ofl_adam.h), trained against torch's AdamW, sized at its real size,
the model's params equal to it, the same bits run after run, and checkpoints that move to and
from an fp32 master."""
from __future__ import annotations

import math

import pytest
import torch

from csrc import ConfigError
from offload.builder import initialize
from offload.config import read_config
from tests.offload.harness import (assert_losses_close, engine_config, loss_fn, make_batches, param_groups,
                                   run_engine, run_torch, twin_models)

STEPS = 30


def _config(device, tmp_path, state_dtype="int8", master_dtype="bf16", stage=2):
    return engine_config(stage=stage, device=device, nvme_path=tmp_path if device == "nvme" else None,
                         offload={"state_dtype": state_dtype, "master_dtype": master_dtype})


@pytest.mark.parametrize("device,state_dtype,stage", [("cpu", "int8", 2), ("nvme", "bf16", 2), ("nvme", "int8", 3)])
def test_training_tracks_torch_adamw(tmp_path, device, state_dtype, stage):
    ours_model, torch_model = twin_models()
    batches = make_batches(STEPS, 8)
    ours, _ = run_engine(ours_model, _config(device, tmp_path, state_dtype, stage=stage), batches)
    theirs = run_torch(torch_model, batches)[0]
    assert theirs[-1] < 0.5 * theirs[0]
    assert_losses_close(ours, theirs, rel=0.05)


def test_config_errors_name_the_keys():
    with pytest.raises(ConfigError, match=r"offload\.master_dtype.*fp16"):
        read_config(_config("cpu", None, master_dtype="fp16"), world_size=1)
    with pytest.raises(ConfigError, match=r"offload\.master_dtype \"bf16\" needs offload\.state_dtype"):
        read_config(_config("cpu", None, state_dtype="fp32"), world_size=1)


def _engine(tmp_path, device="cpu", state_dtype="int8", master_dtype="bf16", stage=2):
    tmp_path.mkdir(parents=True, exist_ok=True)
    model, _ = twin_models()
    engine, _, _, _ = initialize(model=model, config=_config(device, tmp_path, state_dtype, master_dtype, stage),
                                 model_parameters=param_groups(model))
    return engine


def _train(engine, steps=5, seed=1):
    for x, y in make_batches(steps, 8, seed=seed):
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    return engine


@pytest.mark.parametrize("device", ["cpu", "nvme"])
@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_state_blocks_have_their_real_size(tmp_path, device, state_dtype):
    engine = _engine(tmp_path, device, state_dtype)
    try:
        layout = engine.layout
        n = sum(sg.numel for sg in layout.sub_groups)
        blocks = sum(math.ceil(p.numel / 256) for sg in layout.sub_groups for p in sg.pieces)
        want = {"bf16": 6 * n,  # master 2 + two bf16 moments
                "int8": sum(-(-4 * sg.numel // 4) * 4 for sg in layout.sub_groups) + 8 * blocks}[state_dtype]
        assert sum(engine.adam.storage.bytes_by_tier().values()) == want
        storage = engine.adam.storage
        for sg in layout.sub_groups:
            assert storage.tier.info(f"state.{sg.index}").nbytes == storage.format.state_bytes(sg)
    finally:
        engine.close()


def _masters(engine):
    storage, out = engine.adam.storage, []
    for sg in engine.layout.sub_groups:
        out.append(storage.format.master(sg, storage.acquire(sg.index)).clone())
        storage.release(sg.index, dirty=False)
    return out


def _stage3_config(tmp_path):
    cfg = _config("nvme", tmp_path, stage=3)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 100  # partition the small model
    cfg["bf16"] = {"enabled": True}
    return cfg


@pytest.mark.parametrize("stage", [2, 3])
def test_params_are_the_bf16_masters_and_runs_repeat_bit_for_bit(tmp_path, stage):
    """Stage 2 (fp32 model): each param is its master widened. Stage 3 (bf16 model, params on their
    shards): each shard holds its master's bits. Two runs give the same masters."""
    runs = []
    for k in range(2):
        if stage == 2:
            engine = _engine(tmp_path / str(k))
        else:
            (tmp_path / str(k)).mkdir()
            model, _ = twin_models()
            engine, _, _, _ = initialize(model=model, config=_stage3_config(tmp_path / str(k)),
                                         model_parameters=param_groups(model))
        try:
            _train(engine)
            masters = _masters(engine)
            assert all(m.dtype == torch.bfloat16 for m in masters)
            shards = engine.stage3.shards if stage == 3 else None
            partitioned = 0
            for sg, m in zip(engine.layout.sub_groups, masters):
                for p in sg.pieces:
                    want = m[p.sub_start:p.sub_start + p.numel]
                    if stage == 2:
                        assert torch.equal(engine.adam.flat_params[p.flat_start:p.flat_start + p.numel], want.float())
                        continue
                    shard = shards.acquire(p.bucket)
                    start = p.flat_start - engine.layout.buckets[p.bucket].shard_start(engine.layout.rank)
                    assert shard.dtype == torch.bfloat16
                    assert torch.equal(shard[start:start + p.numel], want)
                    shards.release(p.bucket, dirty=False)
                    partitioned += p.numel
            assert stage == 2 or partitioned > 1000
            runs.append(torch.cat(masters))
        finally:
            engine.close()
    assert torch.equal(runs[0], runs[1])


def _fp32_states(engine):
    fmt = engine.adam.storage.format
    return [fmt.unpack(sg, engine.adam.storage.state(sg.index)).clone() for sg in engine.layout.sub_groups]


@pytest.mark.parametrize("saved,loaded", [("bf16", "fp32"), ("fp32", "bf16")])
def test_checkpoints_move_between_master_dtypes(tmp_path, saved, loaded):
    """Checkpoints hold the fp32 form: a bf16 master saves exactly, and an fp32 one loads into a bf16
    master rounded to nearest; the int8 moments as close as int8 stores them."""
    src = _train(_engine(tmp_path / "a", master_dtype=saved))
    try:
        src.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
        want = _fp32_states(src)
    finally:
        src.close()
    dst = _train(_engine(tmp_path / "b", master_dtype=loaded), steps=1, seed=3)
    try:
        dst.load_checkpoint(str(tmp_path / "ckpt"), tag="t")
        got = _fp32_states(dst)
        for sg, w, g in zip(dst.layout.sub_groups, want, got):
            n = sg.numel
            assert torch.equal(g[:n], w[:n] if loaded == "fp32" else w[:n].to(torch.bfloat16).float())
            # requantized: within one code's step of the largest value of each 256-block
            torch.testing.assert_close(g[n:2 * n], w[n:2 * n], rtol=0.02, atol=0.02 * w[n:2 * n].abs().max())
            torch.testing.assert_close(g[2 * n:], w[2 * n:], rtol=0.02, atol=0.02 * w[2 * n:].max())
        _train(dst, steps=2)  # and it trains on
    finally:
        dst.close()


@pytest.mark.parametrize("state_dtype,per", [("bf16", 6.0), ("int8", 4.0 + 8 / 256)])
def test_estimate_follows_the_state_bytes(state_dtype, per):
    from offload.plan.estimate import EstimateInput, estimate, shapes_from_count

    n, mi = 10 << 20, 1 << 20
    row = estimate(EstimateInput(shapes=shapes_from_count(n, largest_layer=mi), compute_bytes=4,
                                 state_dtype=state_dtype, master_dtype="bf16")).row(stage=2, optimizer="nvme")
    states = sum(b for what, where, b in row.parts if where == "nvme" and "master + moments" in what)
    assert states == per * n and row.nvme_bytes == -(-states // (1 << 20)) * (1 << 20)  # the swap file: whole stripes
    assert row.host_bytes == 4 * n + per * n
    assert any(what.startswith("bf16 master + moments") for what, _, _ in row.parts)
