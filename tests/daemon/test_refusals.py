"""Refused requests in the daemon's log and its error counter: a line per session and request kind (rate
limited, the rest counted in the next line), naming the session, the key and the value; the counter counts
each refusal, and a clean session adds nothing to it."""
from __future__ import annotations

import re
import time

import pytest

from csrc.errors import QuotaExceededError
from daemon.client import TierClient, TierClientConfig
from tests.daemon.conftest import STORE
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


def _poll_until_done(wait, handle, deadline_seconds: float = 60.0) -> int:
    """Ask with timeout 0 until the transfer is done; how many times the answer was "not yet"."""
    not_yet, deadline = 0, time.monotonic() + deadline_seconds
    while True:
        try:
            wait(handle, timeout_seconds=0)
            return not_yet
        except TimeoutError:
            not_yet += 1
            assert time.monotonic() < deadline, f"still in flight after {deadline_seconds} s"
            time.sleep(0.005)


def test_a_poll_that_finds_the_transfer_running_is_no_error(daemon_factory):
    """[Note: a poll is a question] A wait with timeout_seconds 0 asks whether a transfer is done (the engine's
    HostWindow.poll and .arrived do, every step): "not yet" is a TimeoutError to the client, as on a local
    store, but no error of the daemon's: neither counted in offload_errors_total nor logged as a refusal."""
    d = daemon_factory(slow=True, pool={"segment_bytes": 4 * MiB})
    c = TierClient(TierClientConfig(socket_path=d.socket_path, job_id="poller", quota_bytes=4 * MiB,
                                    timeout_seconds=20))
    c.allocate("x", 4 * MiB)
    evict_polls = _poll_until_done(c.wait_for_evict, c.evict(["x"]))  # slow on the real store: 4 KiB writes
    prefetch_polls = _poll_until_done(c.wait_for_prefetch, c.prefetch(["x"]))  # slow on both stores
    assert prefetch_polls > 0 and (evict_polls > 0 or STORE != "swap"), (evict_polls, prefetch_polls)
    c.close()
    assert errors(d.metrics_port) == {}
    assert refusals(d.log()) == []


def test_a_wait_that_runs_out_of_time_is_counted_and_logged(daemon_factory):
    """A client that waited its whole (nonzero) limit got an error: counted and logged, and the transfer goes
    on, to be waited for again."""
    d = daemon_factory(slow=True, pool={"segment_bytes": 4 * MiB})
    c = TierClient(TierClientConfig(socket_path=d.socket_path, job_id="late", rank=2, quota_bytes=4 * MiB,
                                    timeout_seconds=20))
    c.allocate("x", 4 * MiB)
    c.wait_for_evict(c.evict(["x"]), timeout_seconds=60)
    h = c.prefetch(["x"])  # slow: 1 s in the double, 4 KiB reads one at a time on the real store
    with pytest.raises(TimeoutError, match=r"prefetch not done after 0.02 s; regions still in flight: x"):
        c.wait_for_prefetch(h, timeout_seconds=0.02)
    c.wait_for_prefetch(h, timeout_seconds=60)
    c.close()
    assert errors(d.metrics_port) == {"TimeoutError": 1.0}
    lines = refusals(d.log())
    assert len(lines) == 1 and re.search(r"refused WAIT_PREFETCH of job 'late' rank 2 .*: TimeoutError: "
                                         r"prefetch not done after 0.02 s", lines[0]), lines


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
