"""A real Prometheus (Debian's /usr/bin/prometheus) scrapes the daemon; its query API returns our bytes."""
from __future__ import annotations

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

import pytest

from daemon.client import TierClient, TierClientConfig

PROMETHEUS = "/usr/bin/prometheus"
pytestmark = pytest.mark.skipif(not os.access(PROMETHEUS, os.X_OK), reason=f"{PROMETHEUS} is absent (apt install prometheus)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _query(port: int, expr: str) -> list:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as r:
        reply = json.load(r)
    assert reply["status"] == "success", reply
    return reply["data"]["result"]


def test_prometheus_scrapes_the_bytes_we_moved(daemon_factory):
    d = daemon_factory()
    c = TierClient(TierClientConfig(socket_path=d.socket_path, job_id="scraped", rank=0, timeout_seconds=20))
    names = [f"p{i}" for i in range(3)]
    for n in names:
        c.allocate(n, 2 << 20)
        c.host_view(n)[:] = bytes([1]) * (2 << 20)
    c.wait_for_evict(c.evict(names), timeout_seconds=20)
    c.wait_for_prefetch(c.prefetch(names), timeout_seconds=20)
    c.report_step(0.3)
    moved = d.status()["bytes_moved"]
    assert moved == {"read": 6 << 20, "write": 6 << 20}

    # The shipped scrape config, pointed at this daemon, scraping every second.
    shipped = (Path(__file__).resolve().parents[2] / "tools/prometheus/offload.yml").read_text()
    work = tempfile.mkdtemp(prefix="ofl-prom-")
    config = shipped.replace("127.0.0.1:9464", f"127.0.0.1:{d.metrics_port}").replace("scrape_interval: 5s",
                                                                                      "scrape_interval: 1s")
    Path(work, "prometheus.yml").write_text(config)
    port = _free_port()
    log = open(Path(work, "prometheus.log"), "wb")
    prom = subprocess.Popen([PROMETHEUS, f"--config.file={work}/prometheus.yml", f"--storage.tsdb.path={work}/data",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        result = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                result = _query(port, 'offload_swap_bytes_total{job="offload-daemon",tier="nvme"}')
                if len(result) == 2:
                    break
            except OSError:
                pass  # not listening yet
            time.sleep(0.5)
        got = {r["metric"]["direction"]: float(r["value"][1]) for r in result}
        assert got == {"read": moved["read"], "write": moved["write"]}, Path(work, "prometheus.log").read_text()[-3000:]
        steps = _query(port, "offload_optimizer_step_seconds_count")
        assert float(steps[0]["value"][1]) == 1.0
        assert _query(port, 'offload_pinned_pool_bytes{state="used"}')[0]["value"][1] == str(c.quota_bytes)
    finally:
        prom.terminate()
        try:
            prom.wait(20)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait(10)
        log.close()
        c.close()
        shutil.rmtree(work, ignore_errors=True)


def test_grafana_dashboard_queries_only_metrics_the_daemon_exports():
    from daemon.metrics import DaemonMetrics
    import re

    exported = {m.name for m in DaemonMetrics().registry.collect()}
    dash = json.loads((Path(__file__).resolve().parents[2] / "tools/grafana/offload.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    variables = [v["query"]["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    exprs += variables
    assert exprs
    for expr in exprs:
        for name in re.findall(r"\boffload_[a-z_]+", expr):
            base = re.sub(r"_(total|bucket|count|sum)$", "", name)
            assert base in exported, f"{name} in {expr!r} is not a daemon metric"
