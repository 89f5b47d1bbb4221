"""What keeping state for a successor costs (issue 42): the daemon's journal on the hot path.

Pairs of daemons on one config, one keeping its state in a player of systemd's fd store
(``[server] keep_state = "fd_store"``: every region change journaled) and one not (``"off"``), each
serving one ``TierClient`` in this process. A round is what a stage 2 step on NVMe asks of the daemon per
sub-group: MARK_DIRTY, EVICT and its wait, PREFETCH and its wait, over ``--regions`` regions of
``--region-bytes``; rounds alternate between the two daemons of a pair. Two daemons differ by more than
the journal (here the one started first was the slower, by up to 1.6x either way), so ``--pairs`` pairs
are started, in alternating order, and the figure is the median over every pair's rounds of the
per-round ratio (journaled / not), with each pair's median beside it. The journal's own time comes from
the daemon (``offload_journal_seconds_total``), as a share of the journaled rounds' time. Also
printed: MARK_DIRTY's round trip alone on each (p50), and the time a SIGTERM restart takes (stop to
serving) with the state kept.

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
from tests.daemon.prom import scrape  # noqa: E402
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


def _pair(args, names: list[str], first_kept: bool) -> tuple:
    """One pair of daemons: per-round ratios, MARK_DIRTY p50 by kind, restart seconds, fds in the store, and
    from the journaled daemon's metrics: the journal's share of its rounds' time, records a round, seconds a
    record."""
    tables = {"pool": {"capacity_bytes": 128 << 20, "segment_bytes": 16 << 20},
              "sessions": {"default_quota_bytes": 48 << 20}}
    made = []
    try:
        for kept in (first_kept, not first_kept):
            made.append(RestartableDaemon(fd_store=kept, **tables).start())
        daemons = {"journaled" if d.store.names() else "plain": d for d in made}
        clients = {}
        for label, d in daemons.items():
            c = TierClient(TierClientConfig(socket_path=d.socket_path, job_id=f"bench-{label}"))
            for n in names:
                c.allocate(n, args.region_bytes)
                c.host_view(n)[:] = os.urandom(args.region_bytes)
            _round(c, names)  # first writes allocate the extents: not timed
            clients[label] = c
        ratios, journaled_seconds = [], 0.0
        port = daemons["journaled"].metrics_port
        before = scrape(port)
        for i in range(args.rounds):
            order = ("journaled", "plain") if i % 2 == 0 else ("plain", "journaled")
            t = {label: _round(clients[label], names) for label in order}
            ratios.append(t["journaled"] / t["plain"])
            journaled_seconds += t["journaled"]
        after = scrape(port)
        journal = {k: after[(f"offload_journal_{k}_total", ())] - before[(f"offload_journal_{k}_total", ())]
                   for k in ("records", "seconds")}
        dirty = {label: _mark_dirty_p50(c, names[0]) for label, c in clients.items()}
        kept = daemons["journaled"]
        fds = len(kept.store.names())
        t0 = time.monotonic()
        kept.term()
        kept.start()
        restart = time.monotonic() - t0
        clients["journaled"].ping()  # reattached
        for c in clients.values():
            c.close()
        return ratios, dirty, restart, fds, journal["seconds"] / journaled_seconds, journal["records"] / args.rounds, \
            journal["seconds"] / max(1, journal["records"])
    finally:
        for d in made:
            d.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--regions", type=int, default=16)
    ap.add_argument("--region-bytes", type=int, default=1 << 20)
    args = ap.parse_args(argv)
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
    names = [f"r{i}" for i in range(args.regions)]
    ratios, medians, dirty_ratios, restarts, shares, per_round, per_record = [], [], [], [], [], [], []
    for p in range(args.pairs):
        r, dirty, restart, fds, share, records, seconds = _pair(args, names, first_kept=p % 2 == 0)
        shares.append(share)
        per_round.append(records)
        per_record.append(seconds)
        ratios += r
        medians.append(statistics.median(r))
        dirty_ratios.append(dirty["journaled"] / dirty["plain"])
        restarts.append(restart)
    print(f"machine: {cpu_description()}")
    print(f"round ({args.regions} regions of {args.region_bytes >> 10} KiB: mark_dirty, evict+wait, prefetch+wait), "
          f"journaled / plain over {args.pairs} pairs x {args.rounds} rounds: median {statistics.median(ratios):.3f} "
          f"(p10 {sorted(ratios)[len(ratios) // 10]:.3f}, p90 {sorted(ratios)[len(ratios) * 9 // 10]:.3f}); "
          f"pairs' medians {', '.join(f'{m:.2f}' for m in medians)}")
    print(f"the journal itself (the daemon's offload_journal_seconds_total over its rounds' time): median "
          f"{statistics.median(shares) * 100:.2f}% of a round ({', '.join(f'{x * 100:.2f}' for x in shares)}); "
          f"{statistics.median(per_round):.0f} records a round, {statistics.median(per_record) * 1e6:.1f} us each")
    print(f"MARK_DIRTY round trip p50, journaled / plain: median {statistics.median(dirty_ratios):.3f} "
          f"({', '.join(f'{m:.2f}' for m in dirty_ratios)})")
    print(f"SIGTERM restart with {args.regions} regions kept ({fds} fds in the store), stop to serving: median "
          f"{statistics.median(restarts):.2f} s ({', '.join(f'{t:.2f}' for t in restarts)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
