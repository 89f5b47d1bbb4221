"""What keeping state for a successor costs (issue 42): the daemon's journal on the hot path.

Two daemons on one config, one keeping its state in a player of systemd's fd store
(``[server] keep_state = "fd_store"``: every region change journaled) and one not (``"off"``), each
serving one ``TierClient`` in this process. A round is what a stage 2 step on NVMe asks of the daemon per
sub-group: MARK_DIRTY, EVICT and its wait, PREFETCH and its wait, over ``--regions`` regions of
``--region-bytes``; rounds alternate between the two daemons, and the figure is the median over
``--rounds`` of the per-pair ratio (journaled / not). Also printed: MARK_DIRTY's round trip alone on each
(p50), and the time a SIGTERM restart takes (stop to serving) with the state kept.

    flock /tmp/ofl-bench.lock .venv/bin/python tools/bench/bench_journal.py [--rounds 30]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from daemon.client import TierClient, TierClientConfig  # noqa: E402
from tests.daemon.restarts import RestartableDaemon  # noqa: E402
from tools.bench.machine import cpu_description  # noqa: E402


def _round(c: TierClient, names: list[str]) -> float:
    t0 = time.perf_counter()
    for n in names:
        c.mark_dirty(n)
    c.wait_for_evict(c.evict(names))
    c.wait_for_prefetch(c.prefetch(names))
    return time.perf_counter() - t0


def _mark_dirty_p50(c: TierClient, name: str, n: int = 2000) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        c.mark_dirty(name)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--regions", type=int, default=16)
    ap.add_argument("--region-bytes", type=int, default=1 << 20)
    args = ap.parse_args(argv)
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
    tables = {"pool": {"capacity_bytes": 128 << 20, "segment_bytes": 16 << 20},
              "sessions": {"default_quota_bytes": 48 << 20}}
    kept, plain = RestartableDaemon(fd_store=True, **tables).start(), RestartableDaemon(fd_store=False, **tables).start()
    names = [f"r{i}" for i in range(args.regions)]
    try:
        clients = {}
        for label, d in (("journaled", kept), ("plain", plain)):
            c = TierClient(TierClientConfig(socket_path=d.socket_path, job_id=f"bench-{label}"))
            for n in names:
                c.allocate(n, args.region_bytes)
                c.host_view(n)[:] = os.urandom(args.region_bytes)
            _round(c, names)  # first writes allocate the extents: not timed
            clients[label] = c
        ratios, times = [], {"journaled": [], "plain": []}
        for i in range(args.rounds):
            order = ("journaled", "plain") if i % 2 == 0 else ("plain", "journaled")
            t = {label: _round(clients[label], names) for label in order}
            for label in t:
                times[label].append(t[label])
            ratios.append(t["journaled"] / t["plain"])
        dirty = {label: _mark_dirty_p50(c, names[0]) for label, c in clients.items()}
        records = kept.store.names()
        t0 = time.monotonic()
        kept.term()
        kept.start()
        restart = time.monotonic() - t0
        clients["journaled"].ping()  # reattached
        print(f"machine: {cpu_description()}")
        print(f"round ({args.regions} regions of {args.region_bytes >> 10} KiB: mark_dirty, evict+wait, prefetch+wait), "
              f"median of {args.rounds}: journaled {statistics.median(times['journaled']) * 1e3:.2f} ms, "
              f"plain {statistics.median(times['plain']) * 1e3:.2f} ms, ratio {statistics.median(ratios):.3f} "
              f"(p10 {sorted(ratios)[len(ratios) // 10]:.3f}, p90 {sorted(ratios)[len(ratios) * 9 // 10]:.3f})")
        print(f"MARK_DIRTY round trip p50: journaled {dirty['journaled'] * 1e6:.1f} us, plain {dirty['plain'] * 1e6:.1f} "
              f"us, ratio {dirty['journaled'] / dirty['plain']:.3f}")
        print(f"fd store held {len(records)} fds; SIGTERM restart with {args.regions} regions kept: "
              f"{restart:.2f} s stop to serving")
        for c in clients.values():
            c.close()
    finally:
        kept.close()
        plain.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
