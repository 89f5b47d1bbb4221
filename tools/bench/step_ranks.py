"""bench_step's ranks row: 2 ranks with offload_optimizer nvme through one node daemon, against the
same 2 ranks with embedded stores, in the same run.

The driver (this module's ``ranks_row``, called by ``bench_step.py --daemon-ranks N`` or run
alone) starts a real daemon (``offload daemon``, its swap file beside the embedded ones), then
``torchrun --standalone`` with N ranks of this script (gloo). Each rank builds the same GPT twice
(same seed): one engine on an embedded ``TierStore``, one through the daemon, with the same
config (ZeRO stage 1, offload_optimizer nvme, ``buffer_count``, CRC-32C on both sides or off on
both). In every round each contender runs ``steps_per_round`` steps on the same batches, in an
order that alternates from round to round; the first step of each is not measured. By default each
side sizes its state window itself (embedded: from the free memory; daemon: from its pool, which
is sized as a node would size it, so that half of it holds every rank's whole state);
``--window buffer_count`` fixes both at ``buffer_count`` (through ``offload.host_memory_bytes``). A step's time
is the slowest rank's. Reported: the median step, optimizer step and I/O wait per contender, and
the median over rounds of the paired ratio daemon / embedded. Both contenders must give the same
losses at every step (they train the same model on the same data).

Alone: python tools/bench/step_ranks.py [--ranks 2] [--rounds 5] [--buffer-count 4] [--window default|buffer_count]
       [--nocrc] [--out FILE]
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
from machine import cpu_description as _cpu_model  # noqa: E402
from step_common import GPT, _fmt, _load, engine_config, publish  # noqa: E402

JOB_ID = "bench-step-ranks"
MODEL_DEFAULTS = {"batch": 2, "seq": 128, "vocab": 16384, "dim": 768, "layers": 12, "heads": 12}
"""bench_step's model and batch (a ~100M GPT, batch 2 x 128 per rank)."""


# -- one rank (under torchrun) ----------------------------------------------------------------

def _rank_main(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from offload.builder import init_distributed, initialize

    torch.set_num_threads(1)  # N ranks share the cores
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = GPT(args.vocab, args.seq, args.dim, args.layers, args.heads)
    gen = torch.Generator().manual_seed(1 + rank)  # each rank its own data, as data parallelism has it
    data = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen) for _ in range(8)]
    contenders = {}
    host_memory = _buffer_count_budget(base, args.buffer_count, world, rank) if args.window == "buffer_count" else None
    for name in ("embedded", "daemon"):
        config = engine_config("nvme", args.batch, args.nvme_path, args.buffer_count, checksum=not args.nocrc)
        if host_memory is not None:
            config["offload"]["host_memory_bytes"] = host_memory
        if name == "daemon":
            config["offload"].update(daemon_socket=args.socket, job_id=JOB_ID)
        contenders[name], _, _, _ = initialize(model=copy.deepcopy(base), config=config)
    windows = {n: e.adam.storage.window for n, e in contenders.items()}
    if args.window == "buffer_count" and set(windows.values()) != {args.buffer_count}:
        raise RuntimeError(f"rank {rank}: windows {windows}, not buffer_count {args.buffer_count} on both")
    del base
    names = list(contenders)
    times = {n: {"step": [], "opt": [], "wait": []} for n in names}
    losses: dict[str, list[float]] = {n: [] for n in names}
    rounds: list[dict[str, float]] = []

    def step(name: str, batch: torch.Tensor) -> tuple[float, float, float]:
        engine = contenders[name]
        wait0 = engine.adam.storage.io_wait_seconds
        dist.barrier()
        t0 = time.perf_counter()
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        t1 = time.perf_counter()
        engine.step()
        t2 = time.perf_counter()
        losses[name].append(loss.item())
        slowest = torch.tensor([t2 - t0, t2 - t1, engine.adam.storage.io_wait_seconds - wait0], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return tuple(slowest.tolist())

    for name in names:  # warm-up: the first step allocates and reads every state block once
        step(name, data[0])
    cursor = 0
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        medians = {}
        for name in order:
            steps = []
            for s in range(args.steps_per_round):
                total, opt, wait = step(name, data[(cursor + s) % len(data)])
                if s == 0:
                    continue
                steps.append(total)
                times[name]["step"].append(total)
                times[name]["opt"].append(opt)
                times[name]["wait"].append(wait)
            medians[name] = statistics.median(steps)
        cursor += args.steps_per_round
        rounds.append(medians)
        if rank == 0:
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {v:.2f}s" for n, v in medians.items()), flush=True)
    tiers = {n: e.offload_stats().tier for n, e in contenders.items()}
    for engine in contenders.values():
        engine.close()
    if rank == 0:
        Path(args.result).write_text(json.dumps({"times": times, "rounds": rounds, "losses": losses, "tiers": tiers,
                                                 "windows": windows, "sub_groups": len(contenders["daemon"].layout.sub_groups),
                                                 "world": world, "n_params": sum(p.numel() for p in
                                                                                 contenders["embedded"].module.parameters())}))
    dist.destroy_process_group()
    return 0


def _buffer_count_budget(model: torch.nn.Module, buffer_count: int, world: int, rank: int) -> int:
    """offload.host_memory_bytes that holds this rank's grads and ``buffer_count`` state blocks, not one more."""
    from offload.builder import OFFLOAD_SUB_GROUP_CAP
    from offload.plan.tier_plan import plan_bytes
    from offload.zero.layout import FlatLayout

    layout = FlatLayout([(n, tuple(p.shape), 0) for n, p in model.named_parameters()], world_size=world, rank=rank,
                        bucket_numel=50_000_000, sub_group_numel=OFFLOAD_SUB_GROUP_CAP)
    plan = plan_bytes([sg.numel for sg in layout.sub_groups], window=buffer_count, nvme=True, nvme_path=None)
    return plan.resident_bytes + 4096


# -- the driver --------------------------------------------------------------------------------

SEGMENT_BYTES = 256 << 20
"""The daemon's pool segments (its default): a region must fit in one (a state block is up to 48 MiB),
and with segments of 64 MiB the grads and blocks of a 100M model's quota no longer pack into them."""


def _start_daemon(workdir: str, pool_bytes: int, swap_bytes: int, checksum: bool,
                  inflight: int) -> tuple[subprocess.Popen, str]:
    sock = os.path.join(workdir, "d.sock")
    swap_dir = os.path.join(workdir, "daemon-swap")
    os.makedirs(swap_dir)
    Path(workdir, "node.toml").write_text(
        f'[server]\nsocket_path = "{sock}"\n[pool]\ncapacity_bytes = {pool_bytes}\nsegment_bytes = {SEGMENT_BYTES}\n'
        f'[sessions]\ndefault_quota_bytes = {SEGMENT_BYTES}\nmax_quota_bytes = {pool_bytes}\n'
        f'[swap]\npaths = ["{swap_dir}"]\ncapacity_bytes = {swap_bytes}\n'
        f'[store]\nchecksum = "{"crc32c" if checksum else "none"}"\n[metrics]\naddress = ""\n'
        + (f'[scheduler]\nmax_inflight_jobs_per_session = {inflight}\nmax_inflight_jobs = {4 * inflight}\n'
           if inflight else ""))
    log = open(os.path.join(workdir, "daemon.log"), "wb")
    proc = subprocess.Popen([sys.executable, "-m", "offload.cli", "daemon", "--config", os.path.join(workdir, "node.toml")],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 120
    while not os.path.exists(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the daemon did not start:\n" + Path(workdir, "daemon.log").read_text()[-3000:])
        time.sleep(0.1)
    return proc, sock


def ranks_row(*, ranks: int, rounds: int, steps_per_round: int, batch: int, seq: int, vocab: int, dim: int,
              layers: int, heads: int, buffer_count: int, nocrc: bool, nvme_path: str | None,
              inflight: int = 0, window: str = "default") -> list[str]:
    """Run the ranks row and return its markdown lines."""
    from offload.plan.daemon_pool import POOL_SHARE
    from offload.plan.tier_plan import packed_quota_bytes

    load_before = _load()
    workdir = tempfile.mkdtemp(prefix="bench-ranks-", dir=nvme_path)
    n_params = sum(p.numel() for p in GPT(vocab, seq, dim, layers, heads).parameters())
    # Per rank in host memory at most: its fp32 grads, all of its state (sub-groups of at most 4 Mi
    # elements when offloaded: 48 MiB blocks) and the commit region, packed in whole segments. The
    # pool is POOL_SHARE times that for every rank: the daemon's window rule gives each rank its
    # whole state, as a node's daemon sized for its jobs would (the embedded side takes its window
    # from the free memory). With --window buffer_count both sides hold buffer_count blocks.
    per_rank = packed_quota_bytes(16 * n_params // ranks + (16 << 20), 12 * (4 << 20), SEGMENT_BYTES)
    daemon, sock = _start_daemon(workdir, pool_bytes=POOL_SHARE * ranks * per_rank + SEGMENT_BYTES,
                                 swap_bytes=2 * 12 * n_params, checksum=not nocrc, inflight=inflight)
    result = os.path.join(workdir, "result.json")
    worker = [str(Path(__file__).resolve()), "--worker", "--socket", sock, "--result", result, "--nvme-path", workdir,
              "--rounds", str(rounds), "--steps-per-round", str(steps_per_round), "--batch", str(batch),
              "--seq", str(seq), "--vocab", str(vocab), "--dim", str(dim), "--layers", str(layers),
              "--heads", str(heads), "--buffer-count", str(buffer_count), "--window", window] + (["--nocrc"] if nocrc else [])
    env = {k: v for k, v in os.environ.items() if k != "OFFLOAD_DAEMON_SOCKET"}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    try:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
                        *worker], cwd=ROOT, env=env, check=True)
        out = json.loads(Path(result).read_text())
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            daemon.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    times, per_round = out["times"], out["rounds"]
    ratios = [r["daemon"] / r["embedded"] for r in per_round]
    same = out["losses"]["daemon"] == out["losses"]["embedded"]
    crc = "off" if nocrc else "CRC-32C"
    lines = [
        f"## {ranks} ranks, offload_optimizer nvme: one daemon against embedded stores",
        "",
        f"- {ranks} ranks under `torchrun --standalone` (gloo, 1 torch thread each), ZeRO stage 1, GPT "
        f"{out['n_params'] / 1e6:.1f}M params, batch {batch} x seq {seq} per rank, buffer_count {buffer_count}, "
        f"state windows (rank 0, of {out['sub_groups']} sub-groups): "
        + ", ".join(f"{n} {w}" for n, w in out["windows"].items())
        + f" ({'fixed at buffer_count' if window == 'buffer_count' else 'each side its default'}); "
        f"daemon pool {(POOL_SHARE * ranks * per_rank + SEGMENT_BYTES) / 2**30:.2f} GiB, "
        f"checksums {crc} on both sides; daemon [scheduler] "
        f"{f'max_inflight_jobs_per_session {inflight}' if inflight else 'defaults'}; {rounds} rounds x 2 contenders x {steps_per_round} steps (first not "
        "measured), order alternating; a step's time is the slowest rank's",
        "- tiers: " + "; ".join(f"{n}: {t}" for n, t in out["tiers"].items()),
        "",
        "| contender | step s | opt s | I/O wait s | step / embedded |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in ("embedded", "daemon"):
        t = times[name]
        ratio = f"**{_fmt(ratios)}x**" if name == "daemon" else ""
        lines.append(f"| {name} | {_fmt(t['step'])} | {_fmt(t['opt'], digits=3)} | {_fmt(t['wait'], digits=3)} | {ratio} |")
    lines += ["", f"Same losses on both at every step (rank 0): {'yes' if same else 'NO'}; "
              f"load average at the start {load_before}, at the end {_load()}", ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps-per-round", type=int, default=3)
    for name, default in MODEL_DEFAULTS.items():
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--buffer-count", type=int, default=4)
    ap.add_argument("--window", choices=("default", "buffer_count"), default="default",
                    help="state windows: each side's default, or buffer_count on both (offload.host_memory_bytes)")
    ap.add_argument("--nocrc", action="store_true", help="no checksums (on both sides)")
    ap.add_argument("--daemon-inflight", type=int, default=0,
                    help="the daemon's [scheduler] max_inflight_jobs_per_session (and 4x it in all); 0: its default")
    ap.add_argument("--nvme-path", default=None, help="directory for the swap files (default: a temporary one)")
    ap.add_argument("--out", default=None, help="write the markdown report here too")
    args = ap.parse_args(argv)
    if args.worker:
        return _rank_main(args)
    lines = [f"# Training step bench, ranks row: daemon against embedded stores, {datetime.date.today().isoformat()}",
             "", f"- machine: {_cpu_model()}; torch "
             f"{torch.__version__}; Python {platform.python_version()}",
             f"- command: `{' '.join(['python', 'tools/bench/step_ranks.py'] + (argv if argv is not None else sys.argv[1:]))}`",
             ""]
    lines += ranks_row(ranks=args.ranks, rounds=args.rounds, steps_per_round=args.steps_per_round, batch=args.batch,
                       seq=args.seq, vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads,
                       buffer_count=args.buffer_count, nocrc=args.nocrc, nvme_path=args.nvme_path,
                       inflight=args.daemon_inflight, window=args.window)
    publish(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
