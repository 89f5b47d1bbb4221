"""Per-job series from JOB_STEP reports, against a real daemon process: what /metrics serves is the
sum of what the clients reported; malformed reports are refused by name and harm no one; the job cap
holds; a finished job's series go after the reattach grace, and a running job's stay."""
from __future__ import annotations

import os
import time

import pytest

from csrc.errors import ConfigError, ProtocolError
from daemon.client import DaemonConnection, TierClient, TierClientConfig
from daemon.protocol import PROTOCOL_VERSION, Kind
from offload.cli import format_status
from tests.daemon.prom import scrape

UID = str(os.getuid())


def job_samples(samples: dict, job: str) -> dict[tuple[str, tuple], float]:
    return {k: v for k, v in samples.items() if k[0].startswith("offload_job_") and ("job", job) in k[1]}


def labels(job: str, rank: int, **extra: str) -> tuple:
    return tuple(sorted({"uid": UID, "job": job, "rank": str(rank), **extra}.items()))


def client(d, job: str, rank: int = 0) -> TierClient:
    return TierClient(TierClientConfig(socket_path=d.socket_path, job_id=job, rank=rank, timeout_seconds=20))


def report(c: TierClient, step: int, **over) -> bool:
    figures = dict(step=step, step_seconds=0.25, io_wait_seconds=0.05, read_bytes=1000 * step, write_bytes=7 * step,
                   skipped_steps=0, loss_scale=1024.0)
    figures.update(over)
    return c.job_step(**figures)


def test_series_are_the_sums_of_the_reports_per_job_and_rank(daemon_factory):
    d = daemon_factory()
    ranks = [client(d, "sums", r) for r in range(2)]
    other = client(d, "other")
    try:
        for step in range(1, 5):
            for r, c in enumerate(ranks):
                assert report(c, step, read_bytes=100 * (r + 1), skipped_steps=int(step == 2 and r == 1),
                              loss_scale=512.0 * (step + r))
        assert report(other, 9, step_seconds=1.5)
        got = scrape(d.metrics_port)
        for r in range(2):
            assert got[("offload_job_step", labels("sums", r))] == 4
            assert got[("offload_job_steps_total", labels("sums", r))] == 4
            assert got[("offload_job_skipped_steps_total", labels("sums", r))] == r
            assert got[("offload_job_step_seconds_total", labels("sums", r))] == pytest.approx(1.0)
            assert got[("offload_job_io_wait_seconds_total", labels("sums", r))] == pytest.approx(0.2)
            assert got[("offload_job_bytes_total", labels("sums", r, direction="read"))] == 400 * (r + 1)
            assert got[("offload_job_bytes_total", labels("sums", r, direction="write"))] == 7 * (1 + 2 + 3 + 4)
            assert got[("offload_job_loss_scale", labels("sums", r))] == 512.0 * (4 + r)
        assert got[("offload_job_step_seconds_total", labels("other", 0))] == 1.5
        assert got[("offload_jobs", ())] == 2
        status = d.status()
        rows = {(s["job_id"], s["rank"]): s["training"] for s in status["sessions"]}
        assert rows[("sums", 1)]["step"] == 4 and rows[("sums", 1)]["skipped_steps_total"] == 1
        assert rows[("sums", 0)]["steps_per_second"] > 0
        text = format_status(status)
        assert "sums (uid" in text and "2 ranks" in text
        assert any(line.strip().startswith("rank 1 attached") and "step 4," in line for line in text.splitlines())
    finally:
        for c in (*ranks, other):
            c.close()


def test_malformed_reports_are_refused_by_name_and_harm_no_one(daemon_factory):
    d = daemon_factory()
    good = client(d, "bystander")
    conn = DaemonConnection(d.socket_path, 20)
    _, fds = conn.request(Kind.HELLO, {"version": PROTOCOL_VERSION, "job_id": "sloppy", "rank": 0, "quota_bytes": 0})
    for fd in fds:
        os.close(fd)
    whole = {"step": 1, "step_seconds": 0.1, "io_wait_seconds": 0.0, "read_bytes": 10, "write_bytes": 10,
             "skipped_steps": 0, "loss_scale": 1.0}
    bad = [
        ({k: v for k, v in whole.items() if k != "loss_scale"}, ProtocolError, "JOB_STEP: missing field 'loss_scale'"),
        ({**whole, "read_bytes": "10"}, ProtocolError, "JOB_STEP: field 'read_bytes' has type str"),
        ({**whole, "step": 1.5}, ProtocolError, "JOB_STEP: field 'step' has type float"),
        ({**whole, "write_bytes": -4096}, ConfigError, r"JOB_STEP: field 'write_bytes' must be in \[0, "),
        ({**whole, "step_seconds": 1e12}, ConfigError, r"JOB_STEP: field 'step_seconds' must be in \[0, 86400\]"),
        ({**whole, "loss_scale": float("nan")}, ProtocolError, "not JSON .*NaN"),
        ({**whole, "skipped_steps": True}, ProtocolError, "JOB_STEP: field 'skipped_steps' has type bool"),
        ({**whole, "tokens": 5}, ProtocolError, "JOB_STEP: unknown field 'tokens'"),
    ]
    try:
        for i, (body, error, message) in enumerate(bad):
            with pytest.raises(error, match=message):
                conn.request(Kind.JOB_STEP, body)
            assert report(good, i + 1)  # the others are served between the bad ones
        assert conn.request(Kind.JOB_STEP, whole)[0] == {"labelled": True}  # the same connection goes on
        sessionless = DaemonConnection(d.socket_path, 20)
        with pytest.raises(ProtocolError, match="JOB_STEP before HELLO"):
            sessionless.request(Kind.JOB_STEP, whole)
        sessionless.close()
        got = scrape(d.metrics_port)
        assert got[("offload_job_steps_total", labels("sloppy", 0))] == 1  # only the good report counted
        assert got[("offload_job_bytes_total", labels("sloppy", 0, direction="write"))] == 10
        assert got[("offload_job_steps_total", labels("bystander", 0))] == len(bad)
        assert got[("offload_errors_total", (("kind", "ProtocolError"),))] >= 6
        assert d.proc.poll() is None
    finally:
        conn.close()
        good.close()


def test_the_job_cap_holds_and_a_finished_job_makes_room(daemon_factory):
    d = daemon_factory(metrics={"max_jobs": 2}, sessions={"reattach_grace_seconds": 0.5})
    a, b, c = client(d, "a"), client(d, "b"), client(d, "c")
    try:
        assert report(a, 1) and report(b, 1)
        assert not report(c, 1) and not report(c, 2)  # over the cap: counted, not labelled, no error
        got = scrape(d.metrics_port)
        assert {dict(k[1])["job"] for k in got if k[0] == "offload_job_step"} == {"a", "b"}
        assert got[("offload_job_reports_over_cap_total", ())] == 2
        assert got[("offload_jobs", ())] == 2
        a.close()  # job a is finished: its series go once the grace has passed, and c gets its place
        deadline = time.monotonic() + 20
        while job_samples(scrape(d.metrics_port), "a") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not job_samples(scrape(d.metrics_port), "a")
        assert report(c, 3)
        got = scrape(d.metrics_port)
        assert got[("offload_job_step", labels("c", 0))] == 3
        assert got[("offload_jobs", ())] == 2 and got[("offload_job_reports_over_cap_total", ())] == 2
    finally:
        for x in (a, b, c):
            x.close()


def test_a_finished_jobs_series_go_after_the_grace_and_a_running_jobs_stay(daemon_factory):
    grace = 1.5
    d = daemon_factory(sessions={"reattach_grace_seconds": grace})
    ranks = [client(d, "done", r) for r in range(2)]
    running = client(d, "running")
    for r, c in enumerate(ranks):
        report(c, 5)
    report(running, 5)
    ranks[0].close()  # one rank of two ended: the job is not finished
    ranks[1].detach()  # the other crashed: kept for a reattach within the grace
    closed_at = time.monotonic()
    time.sleep(grace / 3)
    assert job_samples(scrape(d.metrics_port), "done")
    ranks[1] = client(d, "done", 1)  # reattached (its token): the job goes on, and so do its counters
    assert report(ranks[1], 6)
    assert scrape(d.metrics_port)[("offload_job_steps_total", labels("done", 1))] == 2
    ranks[1].detach()
    detached_at = time.monotonic()
    while job_samples(scrape(d.metrics_port), "done") and time.monotonic() < detached_at + 20:
        time.sleep(0.05)
    gone_after = time.monotonic() - detached_at
    assert not job_samples(scrape(d.metrics_port), "done")
    assert gone_after >= grace * 0.9, gone_after  # not before the reattach grace of the last rank
    assert time.monotonic() - closed_at >= grace
    got = scrape(d.metrics_port)
    assert got[("offload_job_step", labels("running", 0))] == 5 and got[("offload_jobs", ())] == 1
    assert [s["job_id"] for s in d.status()["sessions"]] == ["running"]
    running.close()


def test_hello_takes_the_versions_the_daemon_speaks(daemon_factory):
    from daemon.protocol import MIN_PROTOCOL_VERSION

    d = daemon_factory()
    for version in (MIN_PROTOCOL_VERSION, PROTOCOL_VERSION):
        conn = DaemonConnection(d.socket_path, 20)
        reply, fds = conn.request(Kind.HELLO, {"version": version, "job_id": f"v{version}", "rank": 0,
                                               "quota_bytes": 0})
        for fd in fds:
            os.close(fd)
        assert reply["version"] == PROTOCOL_VERSION
        conn.close()
    conn = DaemonConnection(d.socket_path, 20)
    with pytest.raises(ProtocolError, match=f"protocol version 1 not spoken here .*{MIN_PROTOCOL_VERSION} to "
                                            f"{PROTOCOL_VERSION}"):
        conn.request(Kind.HELLO, {"version": 1, "job_id": "old", "rank": 0, "quota_bytes": 0})
    conn.close()
