"""The engine's tier is the node daemon when the config names one: the same training, bit for bit,
as with the embedded store, its state in the daemon's memory and swap, and all of it freed at close."""
from __future__ import annotations

import pytest
import torch

from offload import initialize
from tests.daemon.conftest import STORE, start_daemon
from tests.daemon.test_refusals import errors
from tests.offload import ckpt_worker

pytestmark = pytest.mark.skipif(STORE != "swap", reason="needs the real swap layer in the daemon")


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
def test_training_through_the_daemon_matches_the_embedded_store(tmp_path, device, monkeypatch):
    daemon = start_daemon(pool={"capacity_bytes": 64 << 20, "segment_bytes": 4 << 20},
                          sessions={"default_quota_bytes": 8 << 20})
    try:
        monkeypatch.setenv("OFFLOAD_DAEMON_SOCKET", daemon.socket_path)
        config = ckpt_worker.config(device, str(tmp_path), stage=2)
        config["offload"] = {"job_id": "test-job"}
        engine, net, losses = _train(config)
        stats = engine.offload_stats()
        assert stats.tier.startswith("daemon ")
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
        embedded.close()
        assert losses == ref_losses
        for p, q in zip(net.parameters(), ref_net.parameters()):
            assert torch.equal(p, q)
        assert daemon.status()["sessions"] == []
    finally:
        daemon.stop()
