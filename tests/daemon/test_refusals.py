"""Refused requests in the daemon's log and its error counter: a line per session and request kind (rate
limited, the rest counted in the next line), naming the session, the key and the value; the counter counts
each refusal, and a clean session adds nothing to it."""
from __future__ import annotations

import re

import pytest

from csrc.errors import QuotaExceededError
from daemon.client import TierClient, TierClientConfig
from tests.daemon.prom import scrape

MiB = 1 << 20


def errors(port: int) -> dict[str, float]:
    return {dict(labels)["kind"]: v for (name, labels), v in scrape(port).items() if name == "offload_errors_total"}


def refusals(log: str) -> list[str]:
    return [line for line in log.splitlines() if "WARNING daemon.connection: refused " in line]


def test_a_clean_session_counts_no_error(daemon_factory):
    d = daemon_factory()
    c = TierClient(TierClientConfig(socket_path=d.socket_path, job_id="clean", timeout_seconds=20))
    c.allocate("x", MiB)
    c.wait_for_evict(c.evict(["x"]), timeout_seconds=20)
    c.wait_for_prefetch(c.prefetch(["x"]), timeout_seconds=20)
    c.close()
    assert errors(d.metrics_port) == {}
    assert refusals(d.log()) == []


def test_refusals_are_logged_once_per_session_and_kind_and_all_counted(daemon_factory):
    d = daemon_factory(sessions={"max_regions_per_session": 2})
    with pytest.raises(QuotaExceededError):  # refused before there is a session: the HELLO's job and rank
        TierClient(TierClientConfig(socket_path=d.socket_path, job_id="greedy", rank=3, quota_bytes=1 << 40,
                                    timeout_seconds=20))
    c = TierClient(TierClientConfig(socket_path=d.socket_path, job_id="many", rank=1, timeout_seconds=20))
    c.allocate("a", 4096)
    c.allocate("b", 4096)
    for i in range(5):
        with pytest.raises(QuotaExceededError, match="max_regions_per_session = 2"):
            c.allocate(f"more{i}", 4096)
    with pytest.raises(Exception):
        c.host_view("never-allocated")  # another kind, REGION: a line of its own
    c.close()
    lines = refusals(d.log())
    hello = [line for line in lines if "refused HELLO" in line]
    assert len(hello) == 1, lines
    assert "job 'greedy' rank 3" in hello[0] and f"quota of {1 << 40} bytes exceeds" in hello[0], hello
    assert "[sessions] max_quota_bytes" in hello[0]
    allocate = [line for line in lines if "refused ALLOCATE" in line]
    assert len(allocate) == 1, lines  # five refusals, one line
    assert re.search(r"job 'many' rank 1 \(session \d+, uid \d+\): QuotaExceededError: .*"
                     r"\[sessions\] max_regions_per_session = 2", allocate[0]), allocate
    assert len([line for line in lines if "refused REGION" in line]) == 1, lines
    counted = errors(d.metrics_port)
    assert counted["QuotaExceededError"] == 6 and sum(counted.values()) == 7, counted
