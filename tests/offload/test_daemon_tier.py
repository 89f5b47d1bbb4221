"""The engine's tier is the node daemon when the config names one: the same training, bit for bit,
as with the embedded store, its state in the daemon's memory and swap, and all of it freed at close."""
from __future__ import annotations

import os

import pytest
import torch

from offload import initialize
from tests.daemon.conftest import STORE, start_daemon
from tests.daemon.test_refusals import errors, refusals
from tests.offload import ckpt_worker

pytestmark = pytest.mark.skipif(STORE != "swap", reason="needs the real swap layer in the daemon")


def _logged(caplog, text):
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def _train(config, steps=12):
    net = ckpt_worker.model()
    engine, _, _, _ = initialize(model=net, config=config)
    losses = []
    for x, y in ckpt_worker.batches(steps):
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, net, losses


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_training_through_the_daemon_matches_the_embedded_store(tmp_path, device, monkeypatch, caplog):
    """Also: each run says once where its state lives (the daemon's socket and session; the swap
    files' directory), and with the daemon a config's nvme_path is named as not used."""
    caplog.set_level("INFO", logger="offload.builder")
    daemon = start_daemon(pool={"capacity_bytes": 64 << 20, "segment_bytes": 4 << 20},
                          sessions={"default_quota_bytes": 8 << 20})
    try:
        monkeypatch.setenv("OFFLOAD_DAEMON_SOCKET", daemon.socket_path)
        config = ckpt_worker.config(device, str(tmp_path), stage=2)
        config["offload"] = {"job_id": "test-job"}
        engine, net, losses = _train(config)
        stats = engine.offload_stats()
        assert stats.tier.startswith("daemon ")
        assert _logged(caplog, "optimizer state in") == [f"rank 0: optimizer state in daemon {daemon.socket_path} "
                                                         "(job 'test-job', rank 0)"]
        unused = _logged(caplog, "nvme_path")
        assert unused == ([f"zero_optimization.offload_optimizer.nvme_path {tmp_path} is not used: the daemon at "
                           f"{daemon.socket_path} holds this state, in its pool and its own swap paths"]
                          if device == "nvme" else [])
        caplog.clear()
        status = daemon.status()
        assert [s["job_id"] for s in status["sessions"]] == ["test-job"]
        if device == "nvme":
            assert stats.bytes_written_total > 0 and stats.bytes_read_total > 0
            # on NVMe, or on its way there or back (the last step's evicts can still be in flight)
            assert stats.state_bytes_by_tier["nvme"] + stats.state_bytes_by_tier.get("in_flight", 0) > 0
        engine.close()
        assert errors(daemon.metrics_port) == {}  # a clean job adds nothing to offload_errors_total
        monkeypatch.delenv("OFFLOAD_DAEMON_SOCKET")
        config.pop("offload")
        embedded, ref_net, ref_losses = _train(config)
        assert not embedded.offload_stats().tier.startswith("daemon")
        where = _logged(caplog, "optimizer state in")
        assert len(where) == 1 and not _logged(caplog, "nvme_path"), where
        if device == "nvme":  # the swap files' own directory, which exists while the engine is open
            swap_dir = where[0].rpartition("swap files in ")[2]
            assert os.path.dirname(swap_dir) == str(tmp_path) and os.path.isdir(swap_dir), where
        embedded.close()
        assert losses == ref_losses
        for p, q in zip(net.parameters(), ref_net.parameters()):
            assert torch.equal(p, q)
        assert daemon.status()["sessions"] == []
    finally:
        daemon.stop()


def test_a_clean_job_counts_no_error_while_its_evicts_are_in_flight(tmp_path, monkeypatch):
    """Issue 41: the engine asks whether its evicts are done (a wait with timeout 0, HostWindow.poll) each time
    it reports where its state is. On a slow daemon every step's evicts are still in flight when it asks:
    "not yet" is no error of the daemon's ([Note: a poll is a question] in daemon.handlers)."""
    daemon = start_daemon(slow=True, pool={"capacity_bytes": 64 << 20, "segment_bytes": 4 << 20},
                          sessions={"default_quota_bytes": 8 << 20})
    try:
        monkeypatch.setenv("OFFLOAD_DAEMON_SOCKET", daemon.socket_path)
        monkeypatch.setenv("WIDTH", "8192")  # 2.2 MB of state in three sub-groups: each evict takes a while
        monkeypatch.setenv("SUB_GROUP", "65536")
        net = ckpt_worker.model()
        engine, _, _, _ = initialize(model=net, config=ckpt_worker.config("nvme", str(tmp_path), stage=2))
        asked_in_flight = 0
        for x, y in ckpt_worker.batches(4):
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()
            asked_in_flight += engine.offload_stats().state_bytes_by_tier.get("in_flight", 0) > 0
        engine.close()
        assert asked_in_flight > 0  # the race of the issue happened
        assert errors(daemon.metrics_port) == {}
        assert refusals(daemon.log()) == []
    finally:
        daemon.stop()
