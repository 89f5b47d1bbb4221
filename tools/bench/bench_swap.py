"""Swap bench: our I/O engines against fio on the same file, and TierStore against the raw engine.

Run it under the shared bench lock (the machine is shared; bandwidth is noisy):

    flock /tmp/ofl-bench.lock .venv/bin/python tools/bench/bench_swap.py --out tools/bench/results/swap_<hw>_<yyyymm>.md

What it measures, each point in every round, the peers interleaved in a rotating order:
- read and write GB/s of one ``--measure-mib`` transfer with O_DIRECT, for every block
  size x queue depth (1 submitting thread), then for 1-4 submitting threads at one
  block size and depth: fio (libaio; io_uring too with --fio-io-uring), our Linux AIO
  engine, our thread-pool engine. fio runs ``numjobs`` = threads, each job on its own
  slice of the same file, so every peer moves the same bytes of the same file.
- the TierStore pipeline (evict of dirty regions, then prefetch, checksums on and off)
  against the raw engine moving the same bytes with the same engine config.
Figures are medians over ``--rounds`` rounds; ratios are ours / fio's at the same point.
Page cache needs no dropping: every transfer is O_DIRECT.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from swap import (HostPool, HostPoolConfig, IoEngineConfig, SwapSpace, SwapSpaceConfig,  # noqa: E402
                  TierStore, TierStoreConfig, open_engine)
from swap import aio  # noqa: E402

logger = logging.getLogger(__name__)

KIB, MIB = 1 << 10, 1 << 20


def parse_sizes(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        mult = MIB if part.endswith("m") else KIB if part.endswith("k") else 1
        out.append(int(part.rstrip("mk")) * mult)
    return out


def size_label(n: int) -> str:
    return f"{n // MIB}M" if n % MIB == 0 else f"{n // KIB}K"


def fio_gbps(path: str, rw: str, bs: int, qd: int, threads: int, nbytes: int, engine: str,
             shared_memory: bool = False) -> float:
    """fio's bandwidth (GB/s, 1e9) for the same bytes of the same file, O_DIRECT."""
    share = nbytes // threads
    cmd = ["fio", "--name=peer", f"--filename={path}", f"--rw={rw}", f"--bs={bs}", f"--iodepth={qd}",
           f"--numjobs={threads}", f"--size={share}", f"--offset_increment={share}", "--offset=0",
           "--direct=1", f"--ioengine={engine}", "--group_reporting", "--output-format=json"]
    if engine == "io_uring":
        cmd.append("--fixedbufs")  # fio's best io_uring: buffers registered once, as ours are
    if shared_memory:
        cmd.append("--iomem=mmapshared")  # shared memory, as our pool is (fio's default is malloc)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    job = json.loads(proc.stdout[proc.stdout.index("{"):])["jobs"][0]
    return job["read" if rw == "read" else "write"]["bw_bytes"] / 1e9


class RawPeer:
    """One of our engines moving one transfer between a pool segment and the file."""

    def __init__(self, kind: str, fd: int, pool: HostPool, nbytes: int) -> None:
        self.kind, self.fd, self.pool, self.nbytes = kind, fd, pool, nbytes
        self.engine = None
        self.key = None
        self.slot = None

    def gbps(self, rw: str, bs: int, qd: int, threads: int) -> float:
        key = (bs, qd, threads)
        if key != self.key:
            if self.engine is not None:
                self.engine.close()
            self.engine = open_engine(IoEngineConfig(kind=self.kind, block_size_bytes=bs, queue_depth=qd,
                                                     num_threads=threads))
            seg = self.pool.segments[0]
            self.slot = self.engine.register_buffer(seg.address, seg.nbytes)  # as TierStore does
            self.key = key
        op = aio.OP_READ if rw == "read" else aio.OP_WRITE
        t0 = time.perf_counter()
        self.engine.submit(op, self.fd, self.pool.segments[0].address, self.nbytes, 0).check()
        return self.nbytes / (time.perf_counter() - t0) / 1e9

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def physical_segments(address: int, nbytes: int, pages_per_request: int = 254) -> float | None:
    """Mean count of physically contiguous runs per ``pages_per_request`` pages of a mapped buffer,
    from /proc/self/pagemap (page frame numbers need CAP_SYS_ADMIN; None without them).

    Why it matters: a virtio-blk device without indirect descriptors spends one ring descriptor
    per physically contiguous run of a request, so with a 256-entry ring a request of 254
    scattered 4 KiB pages fills the ring alone and the device sees one request at a time, while
    the same request over contiguous pages takes a few descriptors and many fit. Our reads and
    fio's then differ by the layout of the memory they read into, not by the engine."""
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(address // 4096 * 8)
            data = f.read(nbytes // 4096 * 8)
    except OSError:
        return None
    pfns = [e & ((1 << 55) - 1) for e in memoryview(data).cast("Q")]
    if not pfns or not all(pfns):
        return None  # not mapped, or frame numbers hidden (no CAP_SYS_ADMIN)
    counts = []
    for i in range(0, len(pfns), pages_per_request):
        chunk = pfns[i:i + pages_per_request]
        counts.append(1 + sum(1 for a, b in zip(chunk, chunk[1:]) if b != a + 1))
    return statistics.mean(counts)


def prepare_file(path: str, nbytes: int, pool: HostPool) -> int:
    """Create the test file and write every byte once (reads of unwritten extents touch no disk)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    os.posix_fallocate(fd, 0, nbytes)
    view = pool.segments[0].view(0, pool.segments[0].nbytes)
    view[:] = os.urandom(len(view))
    del view
    with open_engine(IoEngineConfig(kind="auto", queue_depth=16)) as e:
        for off in range(0, nbytes, pool.segments[0].nbytes):
            n = min(pool.segments[0].nbytes, nbytes - off)
            e.submit(aio.OP_WRITE, fd, pool.segments[0].address, n, off).check()
    os.fsync(fd)
    return fd


def run_grid(points, peers, rounds, log) -> dict:
    """{(point, peer): [GB/s per round]} with the peers' order rotating every point and round."""
    results: dict = {}
    names = list(peers)
    for rnd in range(rounds):
        t0 = time.monotonic()
        for i, point in enumerate(points):
            order = names[(i + rnd) % len(names):] + names[:(i + rnd) % len(names)]
            for name in order:
                results.setdefault((point, name), []).append(peers[name](*point))
        log(f"round {rnd + 1}/{rounds}: {len(points)} points in {time.monotonic() - t0:.0f} s")
    return results


def pipeline(args, engine_config: IoEngineConfig, path_dir: str, raw_pool: HostPool,
             log) -> tuple[list[list[str]], str]:
    """TierStore evict/prefetch of dirty regions vs the raw engine moving as many bytes in the same
    swap file (its second half, which the store's regions never use)."""
    region = args.region_mib * MIB
    total = args.measure_mib * MIB
    names = [f"r{i}" for i in range(total // region)]
    samples: dict[str, list[float]] = {}

    def timed(label: str, fn) -> None:
        t0 = time.perf_counter()
        fn()
        samples.setdefault(label, []).append(total / (time.perf_counter() - t0) / 1e9)

    engine = open_engine(engine_config)
    name = engine.name
    engine.register_buffer(raw_pool.segments[0].address, raw_pool.segments[0].nbytes)  # the store registers its pool
    space = SwapSpace(SwapSpaceConfig(paths=[path_dir], capacity_bytes=2 * total), engine=engine)
    raw_fd = space.files[0].fd
    pool = HostPool(HostPoolConfig(capacity_bytes=total + region, huge_pages=args.huge_pages))
    try:
        for c in ("crc32c", "none"):  # one store at a time: each fills the swap space
            store = TierStore(TierStoreConfig(checksum=c, chunk_bytes=args.chunk_mib * MIB), pool=pool,
                              space=space, engine=engine)
            for n in names:
                store.allocate(n, region)
                store.host_view(n)[:] = os.urandom(region)
            store.wait_for_evict(store.evict(names))
            address = raw_pool.segments[0].address
            engine.submit(aio.OP_WRITE, raw_fd, address, total, total).check()  # written data, as the regions

            def store_evict() -> None:
                for n in names:
                    store.mark_dirty(n)
                store.wait_for_evict(store.evict(names))

            for rnd in range(args.rounds):  # the pairs run adjacent, in an order that alternates
                pairs = [
                    [(f"store {c} prefetch", lambda: store.wait_for_prefetch(store.prefetch(names))),
                     (f"raw read {c}", lambda: engine.submit(aio.OP_READ, raw_fd, address, total, total).check())],
                    [(f"store {c} evict", store_evict),
                     (f"raw write {c}", lambda: engine.submit(aio.OP_WRITE, raw_fd, address, total, total).check())],
                ]
                for pair in pairs:
                    for label, fn in (pair if rnd % 2 == 0 else pair[::-1]):
                        timed(label, fn)
            log(f"pipeline (checksum {c}): done")
            store.close()
    finally:
        space.close()
        pool.close()
        engine.close()
    med = {k: statistics.median(v) for k, v in samples.items()}
    rows = []
    for c in ("crc32c", "none"):
        for verb, raw in (("prefetch", f"raw read {c}"), ("evict", f"raw write {c}")):
            label = f"store {c} {verb}"
            ratio = statistics.median(a / b for a, b in zip(samples[label], samples[raw]))
            rows.append([f"TierStore {verb}, checksum {c}", f"{med[label]:.2f}", f"{med[raw]:.2f}",
                         f"{ratio:.2f}", spread(samples[label])])
    return rows, name


def paired(results: dict, point, ours: str, peer: str) -> float:
    """Median over rounds of ours / peer measured in the same round (adjacent in time)."""
    return statistics.median(a / b for a, b in zip(results[(point, ours)], results[(point, peer)]))


def checksums(pool: HostPool, rounds: int) -> list[list[str]]:
    """GB/s of each checksum candidate over the pool's (pre-touched) first segment, one core."""
    seg = pool.segments[0]
    view = seg.view(0, seg.nbytes)
    candidates = {"crc32c (ours, C" + (", SSE4.2)" if aio.crc32c_hardware() else ", table)"):
                  lambda: aio.crc32c(seg.address, seg.nbytes),
                  "zlib.crc32 (CRC-32, not C)": lambda: zlib.crc32(view)}
    try:
        import xxhash
        candidates["xxhash.xxh3_64"] = lambda: xxhash.xxh3_64_intdigest(view)
    except ImportError:
        candidates["xxhash"] = None
    rows = []
    for name, fn in candidates.items():
        if fn is None:
            rows.append([name, "not installed", ""])
            continue
        v = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            fn()
            v.append(seg.nbytes / (time.perf_counter() - t0) / 1e9)
        rows.append([name, f"{statistics.median(v):.2f}", spread(v)])
    del view
    return rows


def spread(v: list[float]) -> str:
    return f"{min(v):.2f}-{max(v):.2f}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the file system under test")
    ap.add_argument("--measure-mib", type=int, default=256, help="bytes per measurement (and file size)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block-sizes", default="128k,1m,8m")
    ap.add_argument("--queue-depths", default="1,4,16,64")
    ap.add_argument("--threads", default="1,2,4", help="submitting threads for the thread sweep")
    ap.add_argument("--thread-sweep-point", default="1m,16", help="block size,queue depth of the thread sweep")
    ap.add_argument("--region-mib", type=int, default=64, help="TierStore region size")
    ap.add_argument("--chunk-mib", type=int, default=8, help="TierStore chunk_bytes")
    ap.add_argument("--pipeline-engine", default="1m,32,1", help="block size,queue depth,threads of the pipeline")
    ap.add_argument("--no-fio-io-uring", action="store_true", help="run fio with libaio only")
    ap.add_argument("--fio-shared-memory", action="store_true",
                    help="also run fio io_uring --fixedbufs into shared memory (--iomem=mmapshared), like our pool")
    ap.add_argument("--points", help="only these rw:block:QD:threads points, e.g. read:8m:64:1,write:1m:16:1")
    ap.add_argument("--huge-pages", default="off", choices=["off", "auto", "hugetlb", "thp"],
                    help="page size of our pools (swap.HostPoolConfig.huge_pages); hugetlb needs vm.nr_hugepages")
    ap.add_argument("--out", help="also write the markdown report here")
    ap.add_argument("--append", action="store_true", help="append to --out instead of replacing it")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    log = lambda msg: print(f"[bench_swap] {msg}", file=sys.stderr, flush=True)  # noqa: E731

    nbytes = args.measure_mib * MIB
    work = tempfile.mkdtemp(prefix="ofl-bench-swap-", dir=args.dir)
    path = os.path.join(work, "data.bin")
    pool = HostPool(HostPoolConfig(capacity_bytes=nbytes, huge_pages=args.huge_pages))
    pages = pool.segments[0].huge  # what huge_pages resolved to here
    fio = shutil.which("fio")
    kinds = [k for k, refused in (("io_uring", aio.io_uring_errno()), ("linux_aio", aio.linux_aio_errno()),
                                   ("threads", 0)) if not refused]
    started = datetime.datetime.now(datetime.timezone.utc)
    fd = prepare_file(path, nbytes, pool)
    pool_segments = physical_segments(pool.segments[0].address, pool.segments[0].nbytes)
    raw = {k: RawPeer(k, fd, pool, nbytes) for k in kinds}
    try:
        peers = {}
        if fio:
            peers["fio libaio"] = lambda rw, bs, qd, t: fio_gbps(path, rw, bs, qd, t, nbytes, "libaio")
            if not args.no_fio_io_uring:
                peers["fio io_uring fixedbufs"] = lambda rw, bs, qd, t: fio_gbps(path, rw, bs, qd, t, nbytes,
                                                                                 "io_uring")
            if args.fio_shared_memory:
                peers["fio io_uring fixedbufs shm"] = lambda rw, bs, qd, t: fio_gbps(path, rw, bs, qd, t, nbytes,
                                                                                     "io_uring", True)
        for k, peer in raw.items():
            peers[f"ours {k}"] = peer.gbps
        grid = [(rw, bs, qd, 1) for bs in parse_sizes(args.block_sizes)
                for qd in [int(q) for q in args.queue_depths.split(",")] for rw in ("read", "write")]
        sbs, sqd = args.thread_sweep_point.split(",")
        sweep = [(rw, parse_sizes(sbs)[0], int(sqd), int(t)) for t in args.threads.split(",") for rw in ("read", "write")]
        points = grid + [p for p in sweep if p not in grid]
        if args.points:
            points = []
            for spec in args.points.split(","):
                rw, bs, qd, t = spec.split(":")
                points.append((rw, parse_sizes(bs)[0], int(qd), int(t)))
        log(f"{len(points)} points x {len(peers)} peers x {args.rounds} rounds on {path}")
        results = run_grid(points, peers, args.rounds, log)
        fios = [p for p in peers if p.startswith("fio")]
        if fios:  # fio's best engine at each point, round by round
            for point in points:
                results[(point, "fio best")] = [max(v) for v in zip(*(results[(point, f)] for f in fios))]
        med = {k: statistics.median(v) for k, v in results.items()}

        pbs, pqd, pt = args.pipeline_engine.split(",")
        pipe_cfg = IoEngineConfig(kind="auto", block_size_bytes=parse_sizes(pbs)[0], queue_depth=int(pqd),
                                  num_threads=int(pt))
        pipe_rows, pipe_engine = pipeline(args, pipe_cfg, work, pool, log)
        crc_rows = checksums(pool, args.rounds)
    finally:
        for peer in raw.values():
            peer.close()
        os.close(fd)
        pool.close()
        shutil.rmtree(work, ignore_errors=True)

    ours = [p for p in peers if p.startswith("ours")]
    head = ["rw", "block", "QD", "threads"] + [f"{p} GB/s" for p in peers]
    head += [f"{o.split()[1]} / fio best" for o in ours] if fio else []
    rows = []
    for point in points:
        rw, bs, qd, t = point
        row = [rw, size_label(bs), str(qd), str(t)]
        row += [f"{med[(point, p)]:.2f} ({spread(results[(point, p)])})" for p in peers]
        if fio:
            row += [f"{paired(results, point, o, 'fio best'):.2f}" for o in ours]
        rows.append(row)

    summary = []
    for rw in ("read", "write"):
        pts = [p for p in points if p[0] == rw]
        if not pts:  # --points may name reads only or writes only
            continue
        for name in ours + fios:
            best = max(pts, key=lambda p: med[(p, name)])
            line = [rw, name, f"{med[(best, name)]:.2f}", f"{size_label(best[1])} QD{best[2]} T{best[3]}"]
            if fio:
                fio_best = max(med[(p, "fio best")] for p in pts)
                line += [f"{paired(results, best, name, 'fio best'):.2f}", f"{med[(best, name)] / fio_best:.2f}"]
            summary.append(line)
    geo = []
    if fio:  # robust to one lucky point: the geometric mean of the per-point ratios
        for rw in ("read", "write"):
            pts = [p for p in points if p[0] == rw]
            if not pts:
                continue
            for name in ours:
                ratios = [paired(results, p, name, "fio best") for p in pts]
                geo.append([rw, name, f"{statistics.geometric_mean(ratios):.2f}", f"{min(ratios):.2f}",
                            f"{max(ratios):.2f}", str(sum(r >= 0.95 for r in ratios)), str(len(ratios))])

    fio_line = (f"fio: {subprocess.run(['fio', '--version'], capture_output=True, text=True).stdout.strip()}, "
                f"run in this same bench run on the same file" if fio else
                "fio: NOT FOUND on PATH; no peer figures (install fio: apt-get install fio)")
    fs = subprocess.run(["df", "-T", args.dir], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    report = "\n".join([
        f"# Swap bench: {platform.node()} ({os.cpu_count()} CPUs), {started:%Y-%m-%d %H:%M} UTC",
        "",
        f"- command: `{' '.join(sys.argv)}`",
        f"- kernel {platform.release()}; file system under test: `{fs}`",
        f"- {fio_line}; engines: {', '.join(kinds)}; crc32c in hardware: {aio.crc32c_hardware()}",
        f"- each measurement moves {args.measure_mib} MiB with O_DIRECT; medians of {args.rounds} rounds "
        f"(min-max in brackets); GB/s = 1e9 bytes/s; peers interleaved in a rotating order",
        "- fio best = the faster of fio libaio and fio io_uring --fixedbufs in each round; a ratio is the "
        "median over rounds of ours / fio best measured in the same round (paired, adjacent in time), which "
        "cancels the drift of a shared disk better than a ratio of medians",
        "- ours io_uring registers its buffer (as TierStore registers its pool); all our buffers are memfd "
        "shared memory, fio's are its own malloc'd memory",
        f"- our pools' pages: huge_pages={args.huge_pages!r} -> {pages}",
        "- physical layout of our pool: " + (f"{pool_segments:.1f} contiguous runs per 254 pages (1 = contiguous, "
        "254 = every page apart); see physical_segments() for why it bounds reads on virtio-blk"
        if pool_segments is not None else "unknown (no page frame numbers without CAP_SYS_ADMIN)"),
        "",
        "## Best of each engine (ratio to fio's best engine at the same block size / QD / threads, paired "
        "by round; and to the best median fio reached anywhere)",
        "",
        table(["rw", "engine", "best GB/s", "at", "/ fio same point", "/ fio best"] if fio else
              ["rw", "engine", "best GB/s", "at"], summary),
        "",
        "## Ours / fio best over every point (geometric mean of the per-point paired ratios)",
        "",
        table(["rw", "engine", "geomean", "min", "max", "points >= 0.95", "points"], geo) if fio else "(no fio)",
        "",
        "## TierStore pipeline against the raw engine on the same swap file "
        f"({args.region_mib} MiB regions, chunk {args.chunk_mib} MiB, engine {pipe_engine} (auto's choice) {args.pipeline_engine})",
        "",
        table(["pipeline", "GB/s", "raw engine GB/s", "paired ratio", "min-max"], pipe_rows),
        "",
        f"## Checksum candidates (GB/s on one core over {args.measure_mib} MiB, median of {args.rounds})",
        "",
        table(["checksum", "GB/s", "min-max"], crc_rows),
        "",
        "## Every point",
        "",
        table(head, rows),
        "",
    ])
    print(report)
    if args.out:
        with open(args.out, "a" if args.append else "w") as f:
            f.write(("\n" if args.append else "") + report)
        log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
