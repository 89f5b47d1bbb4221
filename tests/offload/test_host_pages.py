"""``offload.huge_pages``: the embedded store's pool private on huge pages ("auto", where the kernel gives
them) or shared on 4 KiB pages ("off"); the same training either way ([Note: private pools] in swap.buffers)."""
from __future__ import annotations

import pytest

from swap.buffers import resolve_huge_pages
from tests.offload import ckpt_worker
from tests.offload.test_daemon_tier import _train

_PRIVATE = resolve_huge_pages("auto", 1 << 30, 1 << 21, shared=False)[0] != "off"


@pytest.mark.parametrize("stage", [2, 3])
def test_the_pool_follows_offload_huge_pages_and_training_does_not(tmp_path, stage, monkeypatch):
    monkeypatch.delenv("OFFLOAD_DAEMON_SOCKET", raising=False)
    runs = {}
    for mode in ("off", "auto"):
        config = ckpt_worker.config("nvme", str(tmp_path), stage=stage)
        if stage == 3:
            config["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path)}
        config["offload"] = {"huge_pages": mode}
        engine, net, losses = _train(config, steps=4)
        pools = [engine.tier.store.pool] + ([engine.stage3.param_tier.store.pool] if stage == 3 else [])
        private = mode == "auto" and _PRIVATE
        for pool in pools:
            assert pool.config.shared is not private
            assert all((seg.fd is None) == private for seg in pool.segments)
            assert all(seg.huge in (("thp", "hugetlb") if private else ("off",)) for seg in pool.segments)
        runs[mode] = losses, [p.detach().clone() for p in net.parameters()]
        engine.close()
    assert runs["off"][0] == runs["auto"][0]
    assert all((a == b).all() for a, b in zip(runs["off"][1], runs["auto"][1]))
