"""Kill one rank of two at random moments of training and check that every run ends as if never killed.

Issue 18's acceptance run, reproducible here: a real daemon (``offload daemon``), two ranks under
``torchrun --max-restarts 1`` (``tests/offload/resume_worker.py``: stage 2 and NVMe by default, fp32,
30 steps), one rank SIGKILLed at a moment drawn uniformly over the training (after its second loss
line, ``--span`` seconds at most), once per run. Each run passes when torchrun exits 0, no rank reads
a torn state, and both ranks' losses and final params equal the uninterrupted run's bit for bit
(two ranks on embedded stores, run once first; a second uninterrupted run through the daemon must
equal it too, and times the training: --span defaults to half of it, as runs after it step faster).
Prints one line per run (where the kill landed: the step each rank resumed at, or none when it came
after the end) and the count that failed.

``--victim daemon`` (issue 42) kills the node daemon instead, at the same kind of moment, and starts it
again at once through a player of systemd's fd store (``tests/daemon/restarts.py``): torchrun gets no
restarts, so each run passes only when the same trainer processes went on, bit-equal.

Usage: python tools/crash_soak.py [--runs 20] [--stage 2] [--device nvme] [--width 60000]
       [--sub-group 200000] [--span S] [--seed 1] [--victim rank|daemon] [--param-device cpu]
       [--keep fd_store|state_dir]
The run's stderr is kept in a directory per run under --workdir (default: a new one in /tmp).
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests import child_pythonpath  # noqa: E402
from tests.daemon.conftest import start_daemon  # noqa: E402
from tests.offload.test_resume import STEPS, _final, _same as same  # noqa: E402

WORKER = ROOT / "tests" / "offload" / "resume_worker.py"


def _launch(args, workdir: str, socket: str | None, restarts: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=child_pythonpath(str(ROOT)), OMP_NUM_THREADS="1", STAGE=str(args.stage),
               WIDTH=str(args.width), SUB_GROUP=str(args.sub_group))
    env.pop("OFFLOAD_DAEMON_SOCKET", None)
    if args.param_device:
        env["PARAM_DEVICE"] = args.param_device
    if socket:
        env["OFFLOAD_DAEMON_SOCKET"] = socket
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts", str(restarts),
           "--monitor-interval", "0.5", "--standalone", str(WORKER), args.device, workdir, str(STEPS)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _lines(workdir: str, rank: int) -> int:
    try:
        with open(os.path.join(workdir, f"losses-rank{rank}.txt")) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def _rank_pid(agent: int, local_rank: int) -> int | None:
    """The pid of torchrun's worker ``local_rank`` (a child of its agent, ``agent``)."""
    children = subprocess.run(["pgrep", "-P", str(agent)], capture_output=True, text=True).stdout.split()
    for pid in map(int, children):
        try:
            if f"LOCAL_RANK={local_rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
        except OSError:
            continue
    return None


def _same(ref: str, run: str) -> bool:
    """Both ranks' losses and final params as the uninterrupted run's (the resume tests' own check)."""
    try:
        same(ref, run, ranks=2)
    except AssertionError:
        return False
    return True


def _daemon_killed_run(args, ref: str, run: str, i: int, delay: float) -> bool:
    """One run whose daemon is SIGKILLed ``delay`` s after rank 0's second loss line and started again."""
    from tests.daemon.restarts import RestartableDaemon

    daemon = RestartableDaemon(keep=args.keep, pool={"capacity_bytes": 256 << 20, "segment_bytes": 16 << 20},
                               sessions={"default_quota_bytes": 64 << 20, "reattach_grace_seconds": 60.0}).start()
    try:
        proc = _launch(args, run, daemon.socket_path, 0)
        while _lines(run, 0) < 2 and proc.poll() is None:
            time.sleep(0.002)
        time.sleep(delay)
        at = _lines(run, 0)
        t0 = time.monotonic()
        daemon.kill()
        daemon.start()
        restart = time.monotonic() - t0
        _, err = proc.communicate(timeout=600)
    finally:
        Path(run, "daemon.log").write_text(daemon.log())
        daemon.close()
    Path(run, "stderr.txt").write_text(err)
    pauses = [float(line.rsplit(" after ", 1)[1].split()[0]) for line in err.splitlines()
              if "without the daemon" in line and "reattached session" in line]
    ok = proc.returncode == 0 and _same(ref, run) and all(_final(run, r)["resumed_step"] is None for r in range(2))
    print(f"run {i}: daemon killed {delay * 1000:.0f} ms after the second loss line (rank 0 had logged {at} steps), "
          f"serving again in {restart:.2f} s; ranks without it {', '.join(f'{p:.2f}' for p in pauses) or '-'} s: "
          f"{'ok' if ok else 'FAILED'}", flush=True)
    if not ok:
        print("\n".join(line for line in err.splitlines() if "Error" in line)[:2000])
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    ap.add_argument("--device", default="nvme", choices=("cpu", "nvme"))
    ap.add_argument("--width", type=int, default=60000, help="the worker model's width (its step's length)")
    ap.add_argument("--sub-group", type=int, default=200000)
    ap.add_argument("--span", type=float, default=None,
                    help="latest kill, seconds after the second loss line (default: half an uninterrupted run's)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--victim", default="rank", choices=("rank", "daemon"))
    ap.add_argument("--param-device", default=None, choices=("cpu", "nvme"), help="stage 3: offload_param too")
    ap.add_argument("--keep", default="fd_store", choices=("fd_store", "state_dir"),
                    help="--victim daemon: [server] keep_state (state_dir: the trainers hand their memory back)")
    args = ap.parse_args(argv)
    base = args.workdir or tempfile.mkdtemp(prefix="crash-soak-")
    ref = os.path.join(base, "reference")
    os.makedirs(ref, exist_ok=True)
    _, err = _launch(args, ref, None, 0).communicate()
    daemon = start_daemon(pool={"capacity_bytes": 256 << 20, "segment_bytes": 16 << 20},
                          sessions={"default_quota_bytes": 64 << 20, "reattach_grace_seconds": 60.0})
    timed = os.path.join(base, "uninterrupted")
    os.makedirs(timed, exist_ok=True)
    try:  # the same run through a daemon, uninterrupted: the span of its training, and a check of its own
        proc = _launch(args, timed, daemon.socket_path, 0)
        while _lines(timed, 0) < 2 and proc.poll() is None:
            time.sleep(0.002)
        t0 = time.monotonic()
        _, err2 = proc.communicate()
        # A run with a rank killed steps faster after its restart; one with the daemon killed goes on as it was.
        span = args.span if args.span is not None else (0.5 if args.victim == "rank" else 0.8) * (time.monotonic() - t0)
    finally:
        daemon.stop()
    Path(ref, "stderr.txt").write_text(err)
    Path(timed, "stderr.txt").write_text(err2)
    if not (os.path.exists(os.path.join(ref, "final-rank1.pt")) and proc.returncode == 0 and _same(ref, timed)):
        print(f"crash soak: the uninterrupted runs failed or differ (their stderr: {ref}/stderr.txt, "
              f"{timed}/stderr.txt)", file=sys.stderr)
        return 2
    print(f"crash soak: stage {args.stage}, {args.device}, width {args.width}; kills within {span:.2f} s after the "
          f"second loss line; runs in {base}", flush=True)
    rng = random.Random(args.seed)
    failed = 0
    for i in range(args.runs):
        run = os.path.join(base, f"run{i}")
        os.makedirs(run, exist_ok=True)
        if args.victim == "daemon":
            failed += not _daemon_killed_run(args, ref, run, i, rng.uniform(0, span))
            continue
        daemon = start_daemon(pool={"capacity_bytes": 256 << 20, "segment_bytes": 16 << 20},
                              sessions={"default_quota_bytes": 64 << 20, "reattach_grace_seconds": 60.0})
        delay, victim = rng.uniform(0, span), rng.randrange(2)
        try:
            proc = _launch(args, run, daemon.socket_path, 1)
            while _lines(run, victim) < 2 and proc.poll() is None:
                time.sleep(0.002)
            time.sleep(delay)
            pid = _rank_pid(proc.pid, victim)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
            _, err = proc.communicate(timeout=600)
        finally:
            daemon.stop()
        Path(run, "stderr.txt").write_text(err)
        ok = proc.returncode == 0 and "TORN" not in err and _same(ref, run)
        resumed = [_final(run, r)["resumed_step"] for r in range(2)] if proc.returncode == 0 else None
        print(f"run {i}: rank {victim} killed {delay * 1000:.0f} ms after its second loss line"
              f"{'' if pid else ' (it had exited)'}: resumed at {resumed}: {'ok' if ok else 'FAILED'}", flush=True)
        if not ok:
            failed += 1
            print("\n".join(line for line in err.splitlines() if "TORN" in line or "Error" in line)[:2000])
    print(f"crash soak: {failed} of {args.runs} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
