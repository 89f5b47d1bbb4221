"""Per-job metrics of training through the node daemon (issue 10, item 4), with real processes: a real
Prometheus scrapes a real daemon while two ranks train under torchrun, and its query API returns each
rank's step count and bytes moved, equal to what the engine's offload_stats() says; two jobs train on one
daemon at once, each equal to its run alone, within their quotas, and a kill -9 of one job's rank does not
disturb the other."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from tests.daemon.conftest import STORE, start_daemon
from tests.daemon.prom import needs_prometheus, prometheus, scrape
from tests.offload.resume_worker import read_losses
from tests import child_pythonpath

pytestmark = pytest.mark.skipif(STORE != "swap", reason="needs the real swap layer in the daemon")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "offload", "resume_worker.py")
STEPS = 16
RANKS = 2


def _torchrun(workdir, *, socket=None, restarts=0, **env) -> subprocess.Popen:
    full = dict(os.environ, PYTHONPATH=child_pythonpath(ROOT), OMP_NUM_THREADS="1", **{k: str(v) for k, v in env.items()})
    full.pop("OFFLOAD_DAEMON_SOCKET", None)
    if socket:
        full["OFFLOAD_DAEMON_SOCKET"] = socket
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(RANKS), "--max-restarts",
           str(restarts), "--monitor-interval", "0.5", "--standalone", WORKER, "nvme", str(workdir), str(STEPS)]
    return subprocess.Popen(cmd, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    _, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-4000:]
    return err


def _losses(workdir, rank):
    return read_losses(workdir, rank, STEPS)


def _final(workdir, rank):
    return torch.load(os.path.join(workdir, f"final-rank{rank}.pt"))


def _same_as(reference, workdir):
    for r in range(RANKS):
        assert _losses(workdir, r) == _losses(reference, r)
        for p, q in zip(_final(workdir, r)["params"], _final(reference, r)["params"]):
            assert torch.equal(p, q)


def _key(job: str, rank: int, **extra: str) -> tuple:
    """A series' labels as ``scrape`` keys them."""
    return tuple(sorted({"uid": str(os.getuid()), "job": job, "rank": str(rank), **extra}.items()))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same two ranks on embedded stores, alone and uninterrupted."""
    workdir = tmp_path_factory.mktemp("alone")
    _finish(_torchrun(workdir))
    return workdir


@needs_prometheus
def test_prometheus_returns_each_ranks_steps_and_bytes_as_the_engine_counted(tmp_path, reference):
    daemon = start_daemon(sessions={"default_quota_bytes": 8 << 20, "reattach_grace_seconds": 60.0})
    try:
        with prometheus(daemon.metrics_port) as prom:
            prom.wait_for("up", lambda r: bool(r) and r[0]["value"][1] == "1")  # scraping before the run starts
            _finish(_torchrun(tmp_path, socket=daemon.socket_path, JOB_ID="scraped-run"))
            sel = '{job="scraped-run"}'
            steps = prom.wait_for(f"offload_job_step{sel}",
                                  lambda r: len(r) == RANKS and all(float(x["value"][1]) == STEPS for x in r))
            assert sorted(r["metric"]["rank"] for r in steps) == ["0", "1"], prom.log()
            assert all(float(r["value"][1]) == STEPS for r in steps), steps
            moved = {(r["metric"]["rank"], r["metric"]["direction"]): float(r["value"][1])
                     for r in prom.query(f"offload_job_bytes_total{sel}")}
            reports = {r["metric"]["rank"]: float(r["value"][1]) for r in prom.query(f"offload_job_steps_total{sel}")}
            seen = prom.query(f"count_over_time(offload_job_step{sel}[10m])")
        for r in range(RANKS):
            final = _final(tmp_path, r)
            assert final["global_steps"] == STEPS and final["reports"] == STEPS
            assert final["bytes_read_total"] > 0 and final["bytes_written_total"] > 0
            assert moved[(str(r), "read")] == final["bytes_read_total"]
            assert moved[(str(r), "write")] == final["bytes_written_total"]
            assert reports[str(r)] == final["optimizer_steps"] + final["skipped_steps"] == STEPS
        assert all(float(x["value"][1]) >= 1 for x in seen)
        _same_as(reference, tmp_path)  # reporting changes nothing in the training
    finally:
        daemon.stop()


def test_two_jobs_at_once_equal_their_runs_alone_and_a_crash_of_one_leaves_the_other(tmp_path, reference):
    daemon = start_daemon(pool={"capacity_bytes": 64 << 20, "segment_bytes": 4 << 20},
                          sessions={"default_quota_bytes": 8 << 20, "reattach_grace_seconds": 60.0})
    samples: list[dict] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                samples.append(daemon.status())
            except OSError:
                pass
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        crashing = _torchrun(tmp_path / "a", socket=daemon.socket_path, restarts=1, JOB_ID="job-a",
                             FAULT="kill-forward", FAULT_STEP=STEPS // 2, FAULT_RANK=1)
        steady = _torchrun(tmp_path / "b", socket=daemon.socket_path, JOB_ID="job-b")
        err_a, err_b = _finish(crashing), _finish(steady)
        after = daemon.status()
        series = scrape(daemon.metrics_port)
    finally:
        stop.set()
        watcher.join(10)
        daemon.stop()
    assert f"resumed from the daemon at step {STEPS // 2}" in err_a
    assert "resumed" not in err_b
    _same_as(reference, tmp_path / "a")
    _same_as(reference, tmp_path / "b")  # the other job's crash changed nothing in it
    assert _final(tmp_path / "b", 1)["resumed_step"] is None
    both = [s for s in samples if {x["job_id"] for x in s["sessions"]} == {"job-a", "job-b"}]
    assert both, "the two jobs never held sessions at the same time"
    for s in samples:  # quotas hold: each session within its own, the pool within its capacity
        assert s["pool"]["used_bytes"] <= s["pool"]["capacity_bytes"]
        assert sum(x["quota_bytes"] for x in s["sessions"]) <= s["pool"]["capacity_bytes"]
        for x in s["sessions"]:
            assert 0 < x["quota_bytes"] <= 8 << 20
            assert x["stats"].get("host_pool_used_bytes", 0) <= x["quota_bytes"]
    assert after["sessions"] == []
    for job in ("job-a", "job-b"):  # the restarted ranks of job a go on with their counters
        for r in range(RANKS):
            key = _key(job, r)
            assert series[("offload_job_step", key)] == STEPS
            assert series[("offload_job_steps_total", key)] == STEPS


def test_one_rank_reports_every_step_and_a_refused_report_never_stops_training(tmp_path, monkeypatch, caplog):
    from csrc.errors import ProtocolError
    from offload import initialize
    from tests.offload import ckpt_worker

    daemon = start_daemon(sessions={"default_quota_bytes": 8 << 20, "reattach_grace_seconds": 60.0})
    batches = ckpt_worker.batches(8)

    def train(engine, some):
        for x, y in some:
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()
    try:
        config = ckpt_worker.config("nvme", str(tmp_path), stage=2)
        embedded, _, _, _ = initialize(model=ckpt_worker.model(), config=config)
        assert embedded.reporter is None  # embedded stores: nothing is reported
        embedded.close()
        config["offload"] = {"job_id": "one-rank", "daemon_socket": daemon.socket_path}
        engine, _, _, _ = initialize(model=ckpt_worker.model(), config=config)
        train(engine, batches[:5])
        row = daemon.status()["sessions"][0]["training"]
        assert engine.reporter.reports == 5 and row["step"] == 5 and row["steps_total"] == 5
        assert row["read_bytes_total"] == engine.offload_stats().bytes_read_total > 0
        engine.adam.storage.drain()  # the last step's evicts: after them nothing moves
        stats = engine.offload_stats()
        assert row["write_bytes_total"] <= stats.bytes_written_total  # the last evicts come with the next report
        engine.close()  # its closing report carries them
        got = scrape(daemon.metrics_port)
        key = _key("one-rank", 0)
        assert got[("offload_job_steps_total", key)] == 5 and got[("offload_job_step", key)] == 5
        assert got[("offload_job_bytes_total", _key("one-rank", 0, direction="read"))] == stats.bytes_read_total
        assert got[("offload_job_bytes_total", _key("one-rank", 0, direction="write"))] == stats.bytes_written_total
        assert got[("offload_job_step_seconds_total", key)] == pytest.approx(stats.step_seconds_total)
        assert got[("offload_job_io_wait_seconds_total", key)] == pytest.approx(stats.io_wait_seconds_total)

        config["offload"]["job_id"] = "refused"
        engine, _, _, _ = initialize(model=ckpt_worker.model(), config=config)
        train(engine, batches[:2])

        def refuse(**figures):  # as a daemon that does not know JOB_STEP answers
            raise ProtocolError("unknown message kind 19")
        monkeypatch.setattr(engine.reporter._client, "job_step", refuse)
        train(engine, batches[2:])
        assert engine.global_steps == 8 and not engine.reporter.enabled and engine.reporter.reports == 2
        assert sum("refused the step report" in r.getMessage() for r in caplog.records) == 1
        assert daemon.status()["sessions"][0]["training"]["step"] == 2
        engine.close()
        assert daemon.status()["sessions"] == []
    finally:
        daemon.stop()


def test_a_quota_that_packs_into_the_daemons_segments(tmp_path):
    """Regions never span the daemon's segments: 1 MiB grads and 3 MiB state blocks in 4 MiB segments
    leave holes that the resident bytes alone do not count; the engine asks for a quota that packs."""
    from offload import initialize

    daemon = start_daemon(pool={"capacity_bytes": 128 << 20, "segment_bytes": 4 << 20},
                          sessions={"default_quota_bytes": 4 << 20})
    try:
        torch.manual_seed(0)
        net = torch.nn.Linear(1024, 1536, bias=False)  # 6 sub-groups of 256 Ki elements
        config = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                  "zero_optimization": {"stage": 1, "sub_group_size": 1 << 18, "offload_optimizer": {
                      "device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 4}},
                  "offload": {"job_id": "packing", "daemon_socket": daemon.socket_path}}
        engine, _, _, _ = initialize(model=net, config=config)
        for _ in range(3):
            engine.backward(net(torch.randn(4, 1024)).square().mean())
            engine.step()
        assert engine.global_steps == 3
        quota = daemon.status()["sessions"][0]["quota_bytes"]
        # 6 grads + 4 blocks + the commit region are 18.25 MiB: 5 segments failed; with room for one
        # 3 MiB region in every 4 MiB segment it is 19 segments
        assert quota == 19 * (4 << 20)
        engine.close()
    finally:
        daemon.stop()
