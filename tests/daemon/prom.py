"""A real Prometheus (Debian's /usr/bin/prometheus) for the tests: the shipped scrape config pointed at a
daemon, scraping every second, and its query API."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Callable, Iterator

import pytest

PROMETHEUS = "/usr/bin/prometheus"
REPO = Path(__file__).resolve().parents[2]
needs_prometheus = pytest.mark.skipif(not os.access(PROMETHEUS, os.X_OK),
                                      reason=f"{PROMETHEUS} is absent (apt install prometheus)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample a daemon's /metrics serves: (name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


class Prometheus:
    def __init__(self, port: int, workdir: str) -> None:
        self.port = port
        self.workdir = workdir

    def query(self, expr: str) -> list:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=5) as r:
            reply = json.load(r)
        assert reply["status"] == "success", reply
        return reply["data"]["result"]

    def wait_for(self, expr: str, done: Callable[[list], bool], timeout_seconds: float = 60.0) -> list:
        """The result of ``expr`` once ``done(result)`` holds (or the last one after the timeout)."""
        result: list = []
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            try:
                result = self.query(expr)
                if done(result):
                    break
            except OSError:
                pass  # not listening yet
            time.sleep(0.5)
        return result

    def log(self) -> str:
        return Path(self.workdir, "prometheus.log").read_text()[-3000:]


@contextlib.contextmanager
def prometheus(metrics_port: int) -> Iterator[Prometheus]:
    """Prometheus scraping the daemon on ``metrics_port`` with the shipped config, every second."""
    shipped = (REPO / "tools/prometheus/offload.yml").read_text()
    work = tempfile.mkdtemp(prefix="ofl-prom-")
    config = shipped.replace("127.0.0.1:9464", f"127.0.0.1:{metrics_port}").replace("scrape_interval: 5s",
                                                                                    "scrape_interval: 1s")
    Path(work, "prometheus.yml").write_text(config)
    port = _free_port()
    log = open(Path(work, "prometheus.log"), "wb")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={work}/prometheus.yml", f"--storage.tsdb.path={work}/data",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        yield Prometheus(port, work)
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()
        shutil.rmtree(work, ignore_errors=True)
