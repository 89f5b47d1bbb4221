"""The state window through a daemon: sized from the daemon's pool (offload.plan.daemon_pool), the
rule against hand-worked cases and packed_quota_bytes, and a real daemon whose pool allows more
than buffer_count blocks per rank or does not."""
from __future__ import annotations

import logging
import types

import pytest

from daemon import TierClient, TierClientConfig
from offload import initialize
from offload.plan.daemon_pool import POOL_SHARE, daemon_window_size, reattached_window
from offload.checkpoint.resume import COMMIT_BYTES
from offload.plan.tier_plan import packed_quota_bytes, plan_bytes
from tests.daemon.conftest import STORE, start_daemon
from tests.offload import ckpt_worker
from tests.offload.test_daemon_tier import _train

MIB = 1 << 20


def _rule(blocks, **kw):
    base = dict(floor=2, fixed_bytes=MIB, largest_region_bytes=3 * MIB, pool_capacity_bytes=64 * MIB,
                pool_free_bytes=64 * MIB, max_quota_bytes=0, segment_bytes=8 * MIB, local_ranks=1)
    base.update(kw)
    return daemon_window_size(blocks, **base)


def test_window_from_the_pool_share_packed_in_segments():
    blocks = [3 * MIB] * 6  # 8 MiB segments with room for a 3 MiB region: 5 MiB of each is usable
    # one rank: 64 / 2 = 32 MiB, 4 segments, 20 MiB usable: 1 + 6 x 3 = 19 MiB, every block
    assert _rule(blocks) == (6, 64 * MIB // POOL_SHARE)
    # two ranks: 16 MiB each, 2 segments, 10 MiB usable: 1 + 3 x 3
    assert _rule(blocks, local_ranks=2) == (3, 16 * MIB)
    # another job holds 44 MiB: min(32, 20) / 2 = 10 MiB, one segment, 5 MiB usable: one block, floor 2
    assert _rule(blocks, local_ranks=2, pool_free_bytes=20 * MIB) == (2, 10 * MIB)
    # [sessions] max_quota_bytes caps it: one segment, one block
    assert _rule(blocks, floor=1, max_quota_bytes=8 * MIB) == (1, 8 * MIB)
    # nothing free: the floor; no blocks: the floor; a floor above the blocks stays (buffer_count)
    assert _rule(blocks, pool_free_bytes=0)[0] == 2
    assert _rule([], floor=3)[0] == 3
    assert _rule(blocks, floor=8)[0] == 8


@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("free_mib", [8, 40, 64])
def test_the_window_is_the_most_blocks_whose_packed_quota_fits(ranks, free_mib):
    blocks = [MIB, 3 * MIB, 2 * MIB, 3 * MIB, MIB, 2 * MIB, 3 * MIB]
    size, budget = _rule(blocks, floor=0, local_ranks=ranks, pool_free_bytes=free_mib * MIB)
    top = sorted(blocks, reverse=True)
    quota = [packed_quota_bytes(MIB + sum(top[:k]), 3 * MIB, 8 * MIB) for k in range(len(top) + 1)]
    assert size == 0 or quota[size] <= budget
    assert size == len(top) or quota[size + 1] > budget


def test_a_reattached_session_keeps_the_window_its_quota_holds():
    blocks = [3 * MIB] * 6
    kw = dict(floor=1, fixed_bytes=MIB, largest_region_bytes=3 * MIB)
    # opened with 2 segments (10 MiB usable: 3 blocks); the pool now has room for all 6
    old = types.SimpleNamespace(reattached=True, quota_bytes=16 * MIB, segment_bytes=8 * MIB)
    assert reattached_window(old, blocks, 6, **kw) == 3
    assert reattached_window(old, blocks, 2, **kw) == 2  # a smaller window stays
    assert reattached_window(types.SimpleNamespace(reattached=False), blocks, 6, **kw) == 6  # a new session
    assert reattached_window(old, blocks, 6, **{**kw, "floor": 4}) == 4  # buffer_count stays the floor


@pytest.mark.skipif(STORE != "swap", reason="needs the real swap layer in the daemon")
def test_a_rank_window_grows_with_the_daemon_pool_and_stays_at_buffer_count_without_room(tmp_path, monkeypatch,
                                                                                           caplog):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # reattach tokens
    daemon = start_daemon(pool={"capacity_bytes": 64 << 20, "segment_bytes": 4 << 20},
                          sessions={"default_quota_bytes": 4 << 20})
    try:
        monkeypatch.setenv("OFFLOAD_DAEMON_SOCKET", daemon.socket_path)
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        config = ckpt_worker.config("nvme", str(tmp_path), stage=2)
        config["zero_optimization"]["sub_group_size"] = 64  # ~18 sub-groups, buffer_count 4
        config["offload"] = {"job_id": "window-job"}
        floor = 4
        with caplog.at_level(logging.INFO, logger="offload.plan.memory"):
            engine, _, losses = _train(config, steps=4)
        window, groups = engine.adam.storage.window, len(engine.layout.sub_groups)
        assert groups > floor and window == groups  # 32 MiB of pool for one rank holds every block
        lines = [r.getMessage() for r in caplog.records
                 if r.name == "offload.plan.memory" and "window" in r.getMessage()]
        assert len(lines) == 1 and f"{groups} of {groups} blocks" in lines[0] and "buffer_count 4" in lines[0]
        plan = plan_bytes([sg.numel for sg in engine.layout.sub_groups], window=window, nvme=True, nvme_path=None)
        want = packed_quota_bytes(plan.resident_bytes + COMMIT_BYTES, max(plan.region_bytes), 4 << 20)
        assert [s["quota_bytes"] for s in daemon.status()["sessions"]] == [want]  # the quota follows the window
        engine.close()

        # another job holds all of the pool but one segment, and the node has two ranks: half a
        # segment each, less than the gradients and one block need: buffer_count
        bystander = TierClient(TierClientConfig(socket_path=daemon.socket_path, job_id="bystander", rank=0,
                                                quota_bytes=60 << 20))
        try:
            monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
            engine, _, small_losses = _train(config, steps=4)
            assert engine.adam.storage.window == floor
            engine.close()
        finally:
            bystander.close()
        assert small_losses == losses  # the window moves data, never the results
    finally:
        daemon.stop()


def test_gradient_tier_auto_judges_by_the_daemons_pool_not_this_process_memory(tmp_path, monkeypatch):
    """offload.gradient_tier "auto" through a daemon: the accumulators go to NVMe when they exceed this rank's
    share of the daemon's pool (the budget its window is sized from), however much memory the process sees."""
    from offload.config import read_config
    from offload.plan.memory import engine_optimizer_plan
    from offload.zero.layout import FlatLayout

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    daemon = start_daemon(pool={"capacity_bytes": 64 << 20, "segment_bytes": 4 << 20})
    try:
        monkeypatch.setenv("OFFLOAD_DAEMON_SOCKET", daemon.socket_path)
        raw = {"train_batch_size": 8, "offload": {"gradient_tier": "auto"},
               "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}}
        cfg = read_config(raw, world_size=1)
        layout = FlatLayout([("w", (6, 1 << 20), 0)], world_size=1, rank=0, bucket_numel=1 << 20,
                            sub_group_numel=1 << 20)  # 24 MiB of fp32 accumulators
        assert not engine_optimizer_plan(cfg, layout).grads_nvme  # one rank: 32 MiB of the 64 MiB pool
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        assert engine_optimizer_plan(cfg, layout).grads_nvme  # two ranks: 16 MiB each
        monkeypatch.delenv("LOCAL_WORLD_SIZE")
        bystander = TierClient(TierClientConfig(socket_path=daemon.socket_path, job_id="bystander", rank=0,
                                                quota_bytes=48 << 20))
        try:
            assert engine_optimizer_plan(cfg, layout).grads_nvme  # 16 MiB free
        finally:
            bystander.close()
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        bf16 = read_config({**raw, "data_types": {"grad_accum_dtype": "bf16"}}, world_size=1)
        assert not engine_optimizer_plan(bf16, layout).grads_nvme  # 12 MiB of bf16 accumulators fit in 16 MiB each
    finally:
        daemon.stop()


@pytest.mark.skipif(STORE != "swap", reason="needs the real swap layer in the daemon")
def test_the_estimate_sizes_the_window_from_the_daemons_pool_as_the_engine_does(tmp_path, monkeypatch):
    """``offload estimate`` with a config that names a daemon reads its pool (STATUS) and gives the window
    the engine then takes: every block where one rank's share holds them, buffer_count where another job
    holds the pool and the node has two ranks (before, the estimate always took buffer_count)."""
    import dataclasses

    from offload.plan.daemon_pool import read_pool
    from offload.plan.estimate import EstimateInput, estimate, shapes_from_model

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    daemon = start_daemon(pool={"capacity_bytes": 64 << 20, "segment_bytes": 4 << 20},
                          sessions={"default_quota_bytes": 4 << 20})
    try:
        monkeypatch.setenv("OFFLOAD_DAEMON_SOCKET", daemon.socket_path)
        config = ckpt_worker.config("nvme", str(tmp_path), stage=2)
        config["zero_optimization"]["sub_group_size"] = 64
        config["offload"] = {"job_id": "estimate-job"}
        shapes = shapes_from_model(ckpt_worker.model(), persistence_threshold=0)

        def estimated_window(ranks: int) -> int:
            inp = dataclasses.replace(EstimateInput.from_config(config, shapes),
                                      daemon_pool=read_pool(daemon.socket_path), local_ranks=ranks)
            parts = {what: b for what, _, b in estimate(inp, stages=[2]).row(stage=2, optimizer="nvme").parts}
            return parts["state window (host budget, buffer_count at least)"]

        def engine_window(engine) -> int:
            plan = plan_bytes([sg.numel for sg in engine.layout.sub_groups], window=0, nvme=True, nvme_path=None)
            return sum(sorted(plan.state_bytes, reverse=True)[:engine.adam.storage.window])

        alone = estimated_window(1)
        engine, _, _ = _train(config, steps=2)
        assert engine.adam.storage.window == len(engine.layout.sub_groups) > 4  # all of them, above buffer_count
        assert alone == engine_window(engine)
        engine.close()

        bystander = TierClient(TierClientConfig(socket_path=daemon.socket_path, job_id="bystander", rank=0,
                                                quota_bytes=60 << 20))
        try:
            crowded = estimated_window(2)
            monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
            engine, _, _ = _train(config, steps=2)
            assert engine.adam.storage.window == 4
            assert crowded == engine_window(engine) < alone
            engine.close()
        finally:
            bystander.close()
    finally:
        daemon.stop()


def test_the_estimate_judges_gradient_tier_auto_by_the_daemons_pool(tmp_path, monkeypatch, capsys):
    """``offload estimate --config`` through a daemon puts stage 3's accumulators where the engine's "auto"
    puts them (``engine_optimizer_plan``, which asks the same daemon), and says which pool it read; with the daemon
    gone, it says so and falls back."""
    import json

    from offload.cli import main
    from offload.config import read_config
    from offload.plan.memory import engine_optimizer_plan
    from offload.zero.layout import FlatLayout

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    raw = {"train_batch_size": 8, "offload": {"gradient_tier": "auto"},
           "zero_optimization": {"stage": 3, "sub_group_size": 1 << 20,
                                 "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
                                 "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(raw))
    layout = FlatLayout([("w", (6, 1 << 20), 0)], world_size=1, rank=0, bucket_numel=1 << 20,
                        sub_group_numel=1 << 20)  # a rank's 24 MiB of fp32 accumulators

    def estimated(ranks: int) -> str:
        assert main(["estimate", "--params", str(ranks * (6 << 20)), "--largest-layer", str(1 << 20), "--config",
                     str(path), "--world-size", str(ranks), "--detail", "3,nvme,nvme", "--no-baseline"]) == 0
        out = capsys.readouterr().out
        where = [line for line in out.splitlines() if "gradient accumulators" in line and "window" not in line]
        assert len(where) == 1, out
        return ("nvme" if "gradient_tier nvme" in where[0] else "host"), out

    daemon = start_daemon(pool={"capacity_bytes": 64 << 20, "segment_bytes": 4 << 20})
    try:
        monkeypatch.setenv("OFFLOAD_DAEMON_SOCKET", daemon.socket_path)
        cfg = read_config(raw, world_size=1)
        tier, out = estimated(1)
        assert not engine_optimizer_plan(cfg, layout).grads_nvme and tier == "host"  # one rank: 32 MiB of the 64 MiB pool
        assert f"through the daemon at {daemon.socket_path}: a pool of 0.07 GB (0.07 GB free)" in out
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        assert engine_optimizer_plan(cfg, layout).grads_nvme and estimated(2)[0] == "nvme"  # two ranks: 16 MiB each
        monkeypatch.delenv("LOCAL_WORLD_SIZE")
        bystander = TierClient(TierClientConfig(socket_path=daemon.socket_path, job_id="bystander", rank=0,
                                                quota_bytes=48 << 20))
        try:
            assert engine_optimizer_plan(cfg, layout).grads_nvme and estimated(1)[0] == "nvme"  # 16 MiB free
        finally:
            bystander.close()
    finally:
        daemon.stop()
    tier, out = estimated(1)  # no daemon: this machine's memory, and why
    assert tier == "host" and f"the daemon at {daemon.socket_path} could not be read" in out
