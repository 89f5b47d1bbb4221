"""Daemon bench: round trip against a bare socket echo, prefetch bandwidth, fairness.

Run under the shared lock (the machine is shared):

    flock /tmp/ofl-bench.lock .venv/bin/python tools/bench/bench_daemon.py [--rounds 5]

Three parts, each a median over ``--rounds`` rounds, each printed with its peer from
the same run as a ratio:

1. Small-request round trip, p50 and p99: a bare Unix-socket echo between two
   processes (a blocking server that sends back the 16-byte frame it got; the client
   once with plain sendall/recv, once with TierClient's connection code), a minimal
   asyncio echo (the floor any asyncio server pays), and the daemon answering PING and
   MARK_DIRTY (a store verb) to a ``TierClient`` in another process.
2. Prefetch bandwidth through the daemon with 1, 2 and 4 client processes (each
   prefetching batches round robin, one batch queued ahead, evicting each after use),
   against the swap engine alone reading the same bytes from one file with two batches
   in flight (the raw figure), and the same loop on an embedded ``TierStore``.
3. Fairness: per-client bytes in the 4-client run, max/min.

The daemon serves the real swap layer when it is installed. Without it, part 1 runs
over the tests' TEST DOUBLE store (the round trip does not touch the store) and parts
2-3 are skipped, unless ``--store test-double`` asks for them: then the figures say so,
and they are buffered reads of the test double, not NVMe figures.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from csrc.errors import DaemonNotRunningError  # noqa: E402
from daemon.client import TierClient, TierClientConfig, daemon_status  # noqa: E402
from daemon.protocol import HEADER, Flag, Kind, encode_frame  # noqa: E402

MiB = 1 << 20


def _have_swap() -> bool:
    try:
        import swap
        return hasattr(swap, "TierStore")
    except ImportError:
        return False


# -- part 1: round trips -------------------------------------------------------------------
def _blocking_echo(path: str) -> None:
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(1)
    conn, _ = srv.accept()
    while True:
        data = conn.recv(4096)
        if not data:
            break
        n, kind, _, rid = HEADER.unpack_from(data)
        conn.sendall(HEADER.pack(0, kind, Flag.REPLY, rid))
    os._exit(0)


def _asyncio_echo(path: str) -> None:
    import asyncio

    class Echo(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport

        def data_received(self, data):
            n, kind, _, rid = HEADER.unpack_from(data)
            self.transport.write(HEADER.pack(0, kind, Flag.REPLY, rid))

        def connection_lost(self, exc):
            loop.stop()

    loop = asyncio.new_event_loop()
    loop.run_until_complete(loop.create_unix_server(Echo, path))
    loop.run_forever()
    os._exit(0)


def _percentiles(lat: list[float]) -> tuple[float, float]:
    lat.sort()
    return lat[len(lat) // 2] * 1e6, lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6


def _echo_round(server, requests: int, workdir: str, raw: bool = False) -> tuple[float, float]:
    from daemon.client import DaemonConnection

    path = os.path.join(workdir, "echo.sock")
    if os.path.exists(path):
        os.unlink(path)
    pid = os.fork()
    if pid == 0:
        server(path)
    deadline = time.monotonic() + 10
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.05)
    lat = []
    if raw:  # plain sendall/recv: the floor
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(path)
        frame = encode_frame(Kind.PING, 1)
        for _ in range(requests):
            t = time.perf_counter()
            sock.sendall(frame)
            sock.recv(4096)
            lat.append(time.perf_counter() - t)
        sock.close()
    else:
        conn = DaemonConnection(path, 10.0, TierClientConfig().spin_seconds)  # TierClient's code and settings
        for _ in range(requests):
            t = time.perf_counter()
            conn.request(Kind.PING)
            lat.append(time.perf_counter() - t)
        conn.close()
    os.waitpid(pid, 0)
    return _percentiles(lat)


def _daemon_round(socket_path: str, requests: int, kind: str) -> tuple[float, float]:
    c = TierClient(TierClientConfig(socket_path=socket_path, job_id="bench-rt", rank=0, quota_bytes=4 * MiB))
    try:
        c.allocate("x", 4096)
        call = c.ping if kind == "PING" else (lambda: c.mark_dirty("x"))
        lat = []
        for _ in range(requests):
            t = time.perf_counter()
            call()
            lat.append(time.perf_counter() - t)
        return _percentiles(lat)
    finally:
        c.close()


# -- daemon process ----------------------------------------------------------------------
class Daemon:
    def __init__(self, workdir: str, store: str, pool_bytes: int, swap_bytes: int, segment_bytes: int) -> None:
        self.socket_path = os.path.join(workdir, "d.sock")
        swap_dir = os.path.join(workdir, "swap")
        os.makedirs(swap_dir, exist_ok=True)
        config = os.path.join(workdir, "node.toml")
        Path(config).write_text(
            f'[server]\nsocket_path = "{self.socket_path}"\n[pool]\ncapacity_bytes = {pool_bytes}\n'
            f"segment_bytes = {segment_bytes}\n[sessions]\nreattach_grace_seconds = 0.0\n"
            f'[swap]\npaths = ["{swap_dir}"]\ncapacity_bytes = {swap_bytes}\n[metrics]\naddress = "127.0.0.1:0"\n'
        )
        if store == "swap":
            cmd = [sys.executable, "-m", "offload.cli", "daemon", "--config", config, "--log-level", "WARNING"]
        else:
            cmd = [sys.executable, str(REPO / "tests/daemon/daemon_proc.py"), "--config", config, "--swap-dir", swap_dir,
                   "--swap-capacity-bytes", str(swap_bytes)]
        self.log = open(os.path.join(workdir, "daemon.log"), "wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                self.status = daemon_status(self.socket_path)
                break
            except (DaemonNotRunningError, OSError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(Path(workdir, "daemon.log").read_text())
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


# -- parts 2 and 3: prefetch bandwidth and fairness ----------------------------------------
def _prefetch_loop(store, names: list[str], batch: int, region_bytes: int, seconds: float) -> tuple[int, float]:
    """Prefetch batches round robin (one queued ahead), evicting each after use."""
    groups = [names[i:i + batch] for i in range(0, len(names), batch)]
    moved, g = 0, 0
    t0 = time.perf_counter()
    current = store.prefetch(groups[0])
    pending_evict = None
    while True:
        nxt = store.prefetch(groups[(g + 1) % len(groups)])
        store.wait_for_prefetch(current)
        moved += len(groups[g % len(groups)]) * region_bytes
        if pending_evict is not None:
            store.wait_for_evict(pending_evict)
        pending_evict = store.evict(groups[g % len(groups)])
        g += 1
        current = nxt
        if time.perf_counter() - t0 >= seconds:
            break
    elapsed = time.perf_counter() - t0
    store.wait_for_prefetch(current)
    store.wait_for_evict(pending_evict)
    return moved, elapsed


def _fill(store, names: list[str], batch: int, region_bytes: int) -> None:
    for i in range(0, len(names), batch):
        group = names[i:i + batch]
        payload = bytes([i % 251]) * region_bytes
        for n in group:
            store.allocate(n, region_bytes)
            store.host_view(n)[:] = payload
            store.mark_dirty(n)
        store.wait_for_evict(store.evict(group))


def _client_worker(socket_path, rank, args, barrier, results) -> None:
    quota = 3 * args.batch * args.region_mib * MiB
    c = TierClient(TierClientConfig(socket_path=socket_path, job_id="bench-bw", rank=rank, quota_bytes=quota))
    names = [f"r{i}" for i in range(args.regions)]
    _fill(c, names, args.batch, args.region_mib * MiB)
    barrier.wait(120)
    moved, elapsed = _prefetch_loop(c, names, args.batch, args.region_mib * MiB, args.seconds)
    results.put((rank, moved, elapsed))
    c.close()


def _through_daemon(socket_path: str, clients: int, args) -> tuple[float, list[float]]:
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(clients), ctx.Queue()
    procs = [ctx.Process(target=_client_worker, args=(socket_path, r, args, barrier, results)) for r in range(clients)]
    for p in procs:
        p.start()
    got = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
    per_client = [moved / elapsed for _, moved, elapsed in got]
    total = sum(moved for _, moved, _ in got) / max(elapsed for _, _, elapsed in got)
    return total, per_client


def _raw_embedded(workdir: str, args) -> float:
    import swap

    space_dir = os.path.join(workdir, "raw")
    os.makedirs(space_dir, exist_ok=True)
    engine = swap.open_engine(swap.IoEngineConfig(probe_paths=[space_dir]))  # as the daemon opens it
    space = swap.SwapSpace(swap.SwapSpaceConfig(paths=[space_dir], capacity_bytes=args.regions * args.region_mib * MiB * 2),
                           engine=engine)
    batch_bytes = args.batch * args.region_mib * MiB
    pool = swap.HostPool(swap.HostPoolConfig(capacity_bytes=3 * batch_bytes, segment_bytes=batch_bytes))
    store = swap.TierStore(swap.TierStoreConfig(), pool=pool, space=space, engine=engine)
    names = [f"r{i}" for i in range(args.regions)]
    _fill(store, names, args.batch, args.region_mib * MiB)
    moved, elapsed = _prefetch_loop(store, names, args.batch, args.region_mib * MiB, args.seconds)
    store.close()
    for obj in (space, engine):
        getattr(obj, "close", lambda: None)()
    return moved / elapsed


def _raw_engine(workdir: str, args) -> float:
    """The swap engine alone: the same bytes, read batch by batch from one O_DIRECT file, two batches in flight."""
    import mmap

    import swap

    path = os.path.join(workdir, "raw-engine.bin")
    batch_bytes = args.batch * args.region_mib * MiB
    total = args.regions * args.region_mib * MiB
    engine = swap.open_engine(swap.IoEngineConfig(probe_paths=[workdir]))
    buffers = [mmap.mmap(-1, batch_bytes) for _ in range(2)]
    direct, _ = swap.direct_io_supported(workdir)  # as the swap space opens its files
    flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    try:
        for off in range(0, total, batch_bytes):
            engine.write(fd, buffers[0], off).check()
        os.fsync(fd)
        moved, i = 0, 0
        t0 = time.perf_counter()
        pending = engine.read(fd, buffers[0], 0)
        while True:
            nxt = engine.read(fd, buffers[(i + 1) % 2], ((i + 1) * batch_bytes) % total)
            moved += pending.check()
            pending, i = nxt, i + 1
            if time.perf_counter() - t0 >= args.seconds:
                break
        elapsed = time.perf_counter() - t0
        pending.check()
        return moved / elapsed
    finally:
        os.close(fd)
        os.unlink(path)
        engine.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=5000, help="round trips per round")
    parser.add_argument("--store", choices=["auto", "swap", "test-double"], default="auto")
    parser.add_argument("--region-mib", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4, help="regions per prefetch request")
    parser.add_argument("--regions", type=int, default=32, help="regions per client (on disk)")
    parser.add_argument("--seconds", type=float, default=4.0, help="length of one bandwidth round")
    parser.add_argument("--workdir", default=str(REPO / "build" / "bench-daemon"), help="swap files go here")
    parser.add_argument("--skip-bandwidth", action="store_true")
    args = parser.parse_args()
    store = args.store if args.store != "auto" else ("swap" if _have_swap() else "test-double")
    os.makedirs(args.workdir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="ofl-bench-", dir=args.workdir)
    print(f"# bench_daemon: store={store}, rounds={args.rounds}, {os.cpu_count()} cpus, {time.strftime('%Y-%m-%d %H:%M')}")
    per_client = 3 * args.batch * args.region_mib * MiB
    batch_bytes = args.batch * args.region_mib * MiB
    daemon = Daemon(workdir, store, pool_bytes=5 * per_client + 2 * batch_bytes,
                    swap_bytes=5 * args.regions * args.region_mib * MiB, segment_bytes=batch_bytes)
    try:
        print(f"daemon engine: {daemon.status['engine']}")
        rows = {"bare echo": [], "bare echo, TierClient's socket code": [], "asyncio echo": [], "daemon PING": [],
                "daemon MARK_DIRTY": []}
        for _ in range(args.rounds):  # interleaved, so machine noise hits every line alike
            rows["bare echo"].append(_echo_round(_blocking_echo, args.requests, workdir, raw=True))
            rows["bare echo, TierClient's socket code"].append(_echo_round(_blocking_echo, args.requests, workdir))
            rows["asyncio echo"].append(_echo_round(_asyncio_echo, args.requests, workdir))
            rows["daemon PING"].append(_daemon_round(daemon.socket_path, args.requests, "PING"))
            rows["daemon MARK_DIRTY"].append(_daemon_round(daemon.socket_path, args.requests, "MARK_DIRTY"))
        bare = statistics.median(p50 for p50, _ in rows["bare echo"])
        print("\n## Round trip, 16-byte request (us; median over rounds of each round's p50 / p99)\n")
        print("| path | p50 | p99 | p50 / bare echo p50 |\n|---|---|---|---|")
        for name, vals in rows.items():
            p50 = statistics.median(v[0] for v in vals)
            p99 = statistics.median(v[1] for v in vals)
            print(f"| {name} | {p50:.1f} | {p99:.1f} | {p50 / bare:.2f}x |")
        print(f"(TierClient polls up to {TierClientConfig().spin_seconds * 1e6:.0f} us for a small reply before "
              "sleeping; the bare and asyncio echo rows' plain client does not; the second row is the bare echo "
              "with TierClient's code and polling)")
        print("per-round p50s: " + "; ".join(f"{k}: " + ", ".join(f"{v[0]:.0f}" for v in vals) for k, vals in rows.items()))

        if args.skip_bandwidth or (store == "test-double" and args.store != "test-double"):
            print("\n(bandwidth and fairness skipped: " + ("--skip-bandwidth" if args.skip_bandwidth else
                  "the swap layer is not installed; --store test-double runs them over the test double") + ")")
            return 0
        label = "" if store == "swap" else " [TEST DOUBLE store: buffered reads, not NVMe]"
        raw: list[float] = []
        embedded: list[float] = []
        bw: dict[int, list[float]] = {n: [] for n in (1, 2, 4)}
        fairness = []
        for _ in range(args.rounds):  # interleaved: raw engine, embedded store, 1, 2 and 4 clients
            if store == "swap":
                raw.append(_raw_engine(workdir, args))
                embedded.append(_raw_embedded(workdir, args))
            for n in (1, 2, 4):
                total, per = _through_daemon(daemon.socket_path, n, args)
                bw[n].append(total)
                if n == 4:
                    fairness.append(max(per) / min(per))
        print(f"\n## Prefetch bandwidth{label} (GB/s, median of {args.rounds}; {args.batch} x {args.region_mib} MiB per request)\n")
        raw_med = statistics.median(raw) if raw else None
        emb_med = statistics.median(embedded) if embedded else None
        print("| path | GB/s | / raw engine | / embedded TierStore | rounds |\n|---|---|---|---|---|")
        rows_bw = ([("raw swap engine (one file, 2 batches in flight)", raw), ("embedded TierStore, same loop", embedded)]
                   if raw else []) + [(f"daemon, {n} client{'s' if n > 1 else ''} (aggregate)", v) for n, v in bw.items()]
        for name, vals in rows_bw:
            med = statistics.median(vals)
            r1 = f"{med / raw_med:.2f}x" if raw_med else "n/a"
            r2 = f"{med / emb_med:.2f}x" if emb_med else "n/a"
            print(f"| {name} | {med / 1e9:.2f} | {r1} | {r2} | " + ", ".join(f"{v / 1e9:.2f}" for v in vals) + " |")
        print(f"\n## Fairness{label}: 4 equal clients, max/min per-client throughput: median "
              f"{statistics.median(fairness):.3f}; rounds " + ", ".join(f"{f:.3f}" for f in fairness))
        return 0
    finally:
        daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
