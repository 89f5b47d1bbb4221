"""A real Prometheus (Debian's /usr/bin/prometheus) scrapes the daemon; its query API returns our bytes."""
from __future__ import annotations

import json
from pathlib import Path

from daemon.client import TierClient, TierClientConfig
from tests.daemon.prom import needs_prometheus, prometheus


@needs_prometheus
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
    try:
        with prometheus(d.metrics_port) as prom:
            result = prom.wait_for('offload_swap_bytes_total{job="offload-daemon",tier="nvme"}', lambda r: len(r) == 2)
            got = {r["metric"]["direction"]: float(r["value"][1]) for r in result}
            assert got == {"read": moved["read"], "write": moved["write"]}, prom.log()
            steps = prom.query("offload_optimizer_step_seconds_count")
            assert float(steps[0]["value"][1]) == 1.0
            assert prom.query('offload_pinned_pool_bytes{state="used"}')[0]["value"][1] == str(c.quota_bytes)
            # honor_labels: the session's series keep the training job's id as `job`
            held = prom.query('offload_session_host_bytes{job="scraped"}')
            assert [r["metric"]["rank"] for r in held] == ["0"], prom.log()
    finally:
        c.close()


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
