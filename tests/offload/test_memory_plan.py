"""The memory plan ([Note: memory plan] in offload.plan.memory): what ``offload estimate`` prints for a config
is what the engine then allocates, over a matrix of configs (stages, cpu/nvme, state dtypes, the gradient
tier, params offloaded, embedded or through a node daemon). The engine's side is read from its tiers, not
from the plan: the embedded store's pool and swap capacities, the daemon session's quota, the bytes the
session holds after a step, and with everything in host memory the regions it allocated, byte for byte."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from offload import initialize
from offload.config import read_config
from offload.plan.daemon_pool import read_pool
from offload.plan.estimate import EstimateInput, estimate, shapes_from_model
from tests.daemon.conftest import STORE, start_daemon

# the optimizer tier's parts of a row; the rest are the model's device, stage 3's shards and the update's staging
NOT_OPTIMIZER = ("param shards", "rest of the shards", "param staging", "rollback copies", "process")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 80), nn.GELU(), nn.Linear(80, 64))


def _config(tmp_path, *, stage: int, opt: str, param: str = "none", state_dtype: str = "fp32",
            gradient_tier: str = "auto", host_memory_bytes: int | None = None, daemon: str | None = None,
            persistence_threshold: int = 0) -> dict:
    offload: dict = {"state_dtype": state_dtype, "gradient_tier": gradient_tier}
    if host_memory_bytes is not None:
        offload["host_memory_bytes"] = host_memory_bytes
    if daemon is not None:
        offload["daemon_socket"] = daemon
    swap = opt == "nvme" or gradient_tier == "nvme"  # (cpu: the accumulators' swap file goes there)
    opt_section = {"device": opt, **({"nvme_path": str(tmp_path)} if swap else {}), "buffer_count": 2}
    zero = {"stage": stage, "sub_group_size": 2048, "reduce_bucket_size": 3000, "offload_optimizer": opt_section,
            "stage3_param_persistence_threshold": persistence_threshold}
    if param != "none":
        zero["offload_param"] = {"device": param, **({"nvme_path": str(tmp_path)} if param == "nvme" else {})}
    return {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": zero, "offload": offload}


def _row(config: dict, model: nn.Module, daemon_socket: str | None):
    cfg = read_config(config, world_size=1)
    shapes = shapes_from_model(model, persistence_threshold=cfg.zero.stage3_param_persistence_threshold)
    inp = EstimateInput.from_config(config, shapes)
    if daemon_socket is not None:
        inp = dataclasses.replace(inp, daemon_pool=read_pool(daemon_socket))
    z = cfg.zero
    return estimate(inp, stages=[z.stage]).row(stage=z.stage, optimizer=z.offload_optimizer.device.value,
                                               param=z.offload_param.device.value)


def _optimizer_parts(row, where: str) -> int:
    return sum(n for what, w, n in row.parts if w == where and not what.startswith(NOT_OPTIMIZER))


def stepped_within_the_estimate(engine, row):
    """One step; the embedded store's pool and swap capacities are ``row``'s optimizer parts, byte for byte.
    Returns the store's stats."""
    _step(engine)
    stats = engine.tier.store.stats()
    assert stats.host_pool_capacity_bytes == _optimizer_parts(row, "host") + _optimizer_parts(row, "reserved")
    assert stats.swap_capacity_bytes == _optimizer_parts(row, "nvme")
    return stats


def _step(engine) -> None:
    x = torch.randn(4, 64)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()


CASES = [  # stage, optimizer, params, state dtype, gradient tier, host budget (KiB; None: the machine's),
    # stage3_param_persistence_threshold
    (1, "cpu", "none", "fp32", "auto", None, 0),
    (2, "cpu", "none", "int8", "auto", None, 0),
    (2, "nvme", "none", "fp32", "auto", 1024, 0),
    (2, "nvme", "none", "bf16", "auto", None, 0),
    (3, "cpu", "cpu", "fp32", "auto", None, 0),
    (3, "nvme", "none", "int8", "host", 1024, 0),
    (3, "nvme", "nvme", "fp32", "nvme", 1024, 0),
    (3, "nvme", "cpu", "bf16", "nvme", None, 0),
    # the window at its floor, and the persistent biases' bucket (last in the partition) landing after the
    # others: a sub-group it shares with the bucket before waits part-landed while each other bucket lands
    (3, "nvme", "nvme", "fp32", "nvme", 64, 100),
    # the state in host memory, the accumulators alone on NVMe ([Note: accumulators alone on NVMe])
    (3, "cpu", "cpu", "int8", "nvme", None, 0),
    (3, "cpu", "none", "fp32", "nvme", None, 100),
]


@pytest.mark.parametrize("stage,opt,param,state_dtype,gradient_tier,host_kib,persistence", CASES)
def test_the_embedded_engine_allocates_what_the_estimate_prints(tmp_path, monkeypatch, stage, opt, param, state_dtype,
                                                                 gradient_tier, host_kib, persistence):
    """The embedded store's pool and swap are the estimate's optimizer parts, byte for byte, and the engine
    steps within them: with the gradient accumulators on NVMe the window holds every accumulator a landing
    needs at once."""
    monkeypatch.delenv("OFFLOAD_DAEMON_SOCKET", raising=False)
    monkeypatch.setattr("offload.plan.budget.available_bytes", lambda: 64 << 20)  # the same budget for both
    config = _config(tmp_path, stage=stage, opt=opt, param=param, state_dtype=state_dtype,
                     gradient_tier=gradient_tier, host_memory_bytes=host_kib and host_kib << 10,
                     persistence_threshold=persistence)
    model = _model()
    row = _row(config, model, None)
    engine, _, _, _ = initialize(model=model, config=config)
    try:
        stats = stepped_within_the_estimate(engine, row)
        if opt == "cpu" and gradient_tier != "nvme":  # every region in host memory: the pool is what they take
            assert stats.host_pool_used_bytes == stats.host_pool_capacity_bytes
        else:
            assert 0 < stats.host_pool_used_bytes <= stats.host_pool_capacity_bytes
        if param != "none":
            ps = engine.stage3.shards.tier.stats()
            shards = {w: sum(n for what, where, n in row.parts if where == w and "shards" in what) for w in ("host", "nvme")}
            assert (ps.host_pool_capacity_bytes, ps.swap_capacity_bytes) == (shards["host"], shards["nvme"])
    finally:
        engine.close()


DAEMON_CASES = [  # stage, optimizer, params, state dtype, gradient tier
    (2, "cpu", "none", "fp32", "auto"),
    (2, "cpu", "none", "int8", "auto"),
    (2, "nvme", "none", "bf16", "auto"),
    (3, "nvme", "nvme", "int8", "nvme"),
    (3, "cpu", "cpu", "fp32", "auto"),
    (3, "cpu", "cpu", "int8", "nvme"),
]


@pytest.mark.skipif(STORE != "swap", reason="needs the real swap layer in the daemon")
@pytest.mark.parametrize("stage,opt,param,state_dtype,gradient_tier", DAEMON_CASES)
def test_a_daemon_session_is_lent_what_the_estimate_prints(tmp_path, monkeypatch, stage, opt, param, state_dtype,
                                                           gradient_tier):
    """Through a daemon the estimate reads its pool as the engine does; each session's quota is the plan's
    session (packed in the daemon's segments), and what the optimizer's session holds after a step (its
    regions, commit region and undo log) is what the estimate puts in host memory, or, with the state on
    NVMe, no more than that."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    daemon = start_daemon(pool={"capacity_bytes": 64 << 20, "segment_bytes": 1 << 20},
                          sessions={"default_quota_bytes": 4 << 20})
    try:
        config = _config(tmp_path, stage=stage, opt=opt, param=param, state_dtype=state_dtype,
                         gradient_tier=gradient_tier, daemon=daemon.socket_path)
        model = _model()
        row = _row(config, model, daemon.socket_path)
        engine, _, _, _ = initialize(model=model, config=config)
        try:
            _step(engine)
            client = engine.tier.store
            quotas = [client.quota_bytes]
            if param != "none":
                quotas.append(engine.stage3.shards.tier.quota_bytes)
            assert quotas == list(row.sessions)
            held = client.stats().host_pool_used_bytes
            planned = _optimizer_parts(row, "host")
            whole = opt == "cpu" and gradient_tier != "nvme"  # else a window, not always full
            assert (held == planned) if whole else (0 < held <= planned), (held, planned, row.parts)
        finally:
            engine.close()
    finally:
        daemon.stop()


@pytest.mark.parametrize("key,value,what", [("host_memory_bytes", 64 << 10, "needs in host memory at once"),
                                            ("swap_capacity_bytes", 64 << 10, "of optimizer state to place on NVMe")])
def test_a_capacity_below_the_plan_is_an_error_that_names_it(tmp_path, monkeypatch, key, value, what):
    """offload.host_memory_bytes below what the window needs at once, or offload.swap_capacity_bytes below the
    state (though the swap file would round it up to a whole stripe), refused at initialize, naming the key."""
    from csrc import ConfigError

    monkeypatch.delenv("OFFLOAD_DAEMON_SOCKET", raising=False)
    config = _config(tmp_path, stage=2, opt="nvme")
    config["offload"][key] = value
    with pytest.raises(ConfigError, match=f"offload.{key} \\({value}\\) is below .* {what}"):
        initialize(model=_model(), config=config)
