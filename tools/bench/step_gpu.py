"""GPU rows of the training step bench: a bf16 GPT of ~1B params (or the largest that fits), no offload
against the optimizer and the params offloaded, with achieved TFLOP/s and the share of the step the
GPU waits.

Contenders (``--contenders``, the names of ``step_gpu_plan.CONTENDERS``; the same model, seed and
batches; one rank):
  torch          plain torch: fp32 params, ``torch.autocast`` bf16, ``torch.optim.AdamW(fused=True)``
  none           the engine, bf16, ZeRO stage 1, optimizer state on the GPU
  opt-cpu        offload_optimizer cpu (fp32 master + moments in host memory, CPU Adam; sub-groups
                 stepped while backward runs: offload.overlap_step's default on a GPU)
  opt-cpu-serial opt-cpu with offload.overlap_step false (every sub-group stepped after backward)
  opt-cpu-fwd    opt-cpu with offload.step_under_forward: the sub-groups left after backward stepped under
                 the next forward, each of its modules waiting for its own params only
  opt-cpu-half   opt-cpu-fwd with offload_optimizer.ratio 0.5: the half of the state the next forward needs
                 first on the GPU, stepped there by torch's fused AdamW
  opt-nvme       offload_optimizer nvme (swap file under --nvme-path)
  opt-cpu-dpu    opt-cpu with offload.delayed_update after one ordinary step (the CPU step of step t
                 overlaps forward and backward of step t+1)
  opt-cpu-int8   opt-cpu with offload.state_dtype "int8" (blockwise 8-bit Adam moments in host memory)
  opt-cpu-lean   opt-cpu-int8 with data_types.grad_accum_dtype "bf16" (2-byte host gradient accumulators)
  s3-param-cpu   ZeRO stage 3, offload_param cpu, offload_optimizer cpu
  s3-param-cpu-live25  s3-param-cpu with the GPU's gathered params held to a quarter of the model
                 (stage3_max_live_parameters and stage3_max_reuse_distance at 1/4 of the params) and the
                 overlapped step (offload.overlap_step true: "auto" leaves it off at stage 3)
  s3-param-nvme  ZeRO stage 3, offload_param nvme, offload_optimizer nvme (ZeRO-Infinity)
  ds-z2-opt-cpu  DeepSpeed's engine, ZeRO stage 2, offload_optimizer cpu, at its best ([Note: DeepSpeed
                 at its best] in step_deepspeed.py), held against opt-cpu
  ds-z3-param-cpu  DeepSpeed's engine, ZeRO stage 3, offload_param and offload_optimizer cpu, held
                 against s3-param-cpu
The default is every row but DeepSpeed's, which run where ``import deepspeed`` works (its wheels carried
to a GPU machine by tools/gpu_wheels.sh; ``DS_ACCELERATOR=cpu`` on a CPU) and are skipped, saying why,
elsewhere.

A step is --accum micro-batches of --batch x --seq tokens (forward, backward), then the optimizer
step; its time runs until the GPU has finished (``torch.cuda.synchronize``). Interleaved (the
default): every contender is built first, then each round runs --steps-per-round steps of each in
an order that rotates; the first step of each contender in a round is not measured. With
``--sequential`` (and always with ``--largest``) one contender at a time is built, measured for the
same number of steps, and closed: at the largest size no two fit at once.

Reported per contender: the median step time, tokens/s, achieved TFLOP/s ([Note: model FLOPs] in
step_gpu_plan.py: 6 N + 12 L d T per token), the GPU wait share ([Note: GPU wait share]: 1 - busy
kernel time of one profiled step / median step time), the step rate against torch's and against
the engine's none (interleaved: the median over rounds of the paired ratios; sequential: ratio of
medians), and the loss of the last step; below the table, each row's losses against torch's step by
step (every contender steps the same batches in the same order) and ours against DeepSpeed's rate. The issue's bar: opt-cpu >= 0.70 of the no-offload rate.

``--largest``: the most layers at --dim that ``offload estimate`` says fit this GPU's memory, the
host's available memory and --nvme-path's free space (85% of each) for at least one contender;
contenders that do not fit at that size are listed as skipped, with why.

On a machine without a GPU, ``--device cpu --tiny`` runs a tiny model through the same code (the
wait share is then n/a): the tests' smoke run.

    flock /tmp/ofl-bench.lock python3 tools/bench/step_gpu.py [--rounds 3] [--steps-per-round 3] [--out FILE]
    python3 tools/bench/step_gpu.py --largest --contenders s3-param-cpu s3-param-nvme opt-cpu --out FILE
    python tools/bench/bench_step.py --gpu ...   (the same)
"""
from __future__ import annotations

import argparse
import collections
import datetime
import gc
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_common import _load, publish  # noqa: E402
from step_deepspeed import DeepSpeedRow, available  # noqa: E402
from step_gpu_rows import EngineRow, build  # noqa: E402
from step_gpu_plan import CONTENDERS, PEERS, Contender, fits, gpu_busy_seconds, largest_layers, model_flops_per_step  # noqa: E402

from offload.models.gpt import GPT, GPTConfig  # noqa: E402

ONE_B = {"vocab": 50304, "dim": 2048, "layers": 18, "heads": 16, "seq": 1024, "batch": 8, "accum": 4}
"""~1.01B params (18 x 12 d^2 + the tied 50304 x 2048 embedding); 32k tokens per optimizer step."""
TINY = {"vocab": 256, "dim": 64, "layers": 2, "heads": 4, "seq": 32, "batch": 2, "accum": 2}
BY_NAME = {c.name: c for c in CONTENDERS}
DEFAULT = [c.name for c in CONTENDERS if not c.deepspeed]


def _count(n: int) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def profiled_busy(row, micro, device: torch.device) -> float | None:
    """Busy kernel seconds of one step ([Note: GPU wait share]); None without a GPU."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            row.step(micro)
        return gpu_busy_seconds(prof)
    except Exception as exc:  # a profiler that cannot start here costs the column, not the run
        print(f"{row.name}: profiling failed ({type(exc).__name__}: {exc}); wait share n/a", flush=True)
        return None


def _memory(device: torch.device, nvme_path: str) -> tuple[int, int, int]:
    """(device, host available, free disk) bytes: what --largest sizes the model for."""
    host = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                host = int(line.split()[1]) * 1024
    dev = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else host
    return dev, host, shutil.disk_usage(nvme_path).free


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny GPT (the CPU smoke run)")
    ap.add_argument("--largest", action="store_true", help="the most layers at --dim that fit (implies --sequential)")
    ap.add_argument("--sequential", action="store_true", help="one contender in memory at a time")
    ap.add_argument("--contenders", nargs="+", choices=list(BY_NAME), default=DEFAULT,
                    help="default: every row but DeepSpeed's (" + ", ".join(DEFAULT) + ")")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps-per-round", type=int, default=3, help="the first of them is not measured")
    for key in ("vocab", "dim", "layers", "heads", "seq", "batch", "accum"):
        ap.add_argument(f"--{key}", type=int, default=None, help=f"default {ONE_B[key]} ({TINY[key]} with --tiny)")
    ap.add_argument("--headroom", type=float, default=0.85, help="--largest: share of each memory to plan for")
    ap.add_argument("--max-layers", type=int, default=1024, help="--largest: search up to this many layers")
    ap.add_argument("--nvme-path", default=None, help="directory for the swap files (default: a temporary one)")
    ap.add_argument("--budget-seconds", type=float, default=None,
                    help="stop measuring when this much time has passed (the report covers what was measured)")
    ap.add_argument("--out", default=None, help="write the markdown report here too")
    args = ap.parse_args(argv)
    shape = TINY if args.tiny else ONE_B
    for key, value in shape.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.steps_per_round < 2:
        ap.error("--steps-per-round must be >= 2 (the first step of each is not measured)")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA GPU here: run with --device cpu --tiny for the smoke run")
    if args.device == "cpu" and torch.cuda.is_available():
        ap.error("--device cpu with a GPU present: the engine takes the GPU; hide it (CUDA_VISIBLE_DEVICES=)")
    args.sequential = args.sequential or args.largest
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    device = torch.device(args.device)
    tmp = tempfile.TemporaryDirectory(prefix="bench-step-gpu-", dir=args.nvme_path)
    wanted = [BY_NAME[n] for n in args.contenders]
    notes, skipped = [], []
    peers = [c for c in wanted if c.deepspeed]
    why = (peers and args.largest and "--largest builds stage 3 under offload.init_context, ours only") or \
        (peers and available())
    if why:
        print(f"DeepSpeed's rows skipped: {why}", flush=True)
        skipped += [f"{c.name} ({why})" for c in peers]
        wanted = [c for c in wanted if not c.deepspeed]
    if args.largest:
        dev_b, host_b, disk_b = _memory(device, tmp.name)
        dims = dict(n_embd=args.dim, n_head=args.heads, vocab=args.vocab, seq=args.seq, batch=args.batch)
        args.layers = largest_layers(wanted, **dims, device_bytes=dev_b, host_bytes=host_b, nvme_bytes=disk_b,
                                     headroom=args.headroom, most=args.max_layers)
        if args.layers == 0:
            print("--largest: not even one layer fits", flush=True)
            return 1
        for c in list(wanted):
            ok, why = fits(c, n_layer=args.layers, **dims, device_bytes=dev_b, host_bytes=host_b, nvme_bytes=disk_b,
                           headroom=args.headroom)
            if not ok:
                wanted.remove(c)
                skipped.append(f"{c.name} ({why})")
        notes.append(f"--largest: {args.layers} layers at dim {args.dim} (device {dev_b / 2**30:.1f} GiB free, host "
                     f"{host_b / 2**30:.1f} GiB available, {disk_b / 2**30:.0f} GiB free disk; {args.headroom:.0%} "
                     "of each planned)")
    gcfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                     n_embd=args.dim, tied_head=True)
    with torch.device("meta"):
        n_params = GPT(gcfg).num_parameters()
    tokens = args.batch * args.seq * args.accum
    flops = model_flops_per_step(params=n_params, n_layer=args.layers, n_embd=args.dim, seq=args.seq, tokens=tokens)
    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(device) for _ in range(4)]
    micro = [[(data[(i + j) % len(data)][:, :-1], data[(i + j) % len(data)][:, 1:]) for j in range(args.accum)]
             for i in range(len(data))]
    print(f"{_count(n_params)} params, {tokens} tokens/step; contenders: {', '.join(c.name for c in wanted)}"
          + (f"; skipped: {', '.join(skipped)}" if skipped else ""), flush=True)

    run = Run(args, device, gcfg, micro, tmp.name, notes, time.perf_counter())
    if args.sequential:
        run.sequential(wanted)
    else:
        run.interleaved(wanted)
    tmp.cleanup()
    notes.append("set-up seconds (model copy and initialize): " + ", ".join(f"{n} {t:.1f}" for n, t in run.setup.items()))
    if run.rounds_done < args.rounds:
        notes.append(f"the time budget (--budget-seconds {args.budget_seconds:.0f}) ended the run after "
                     f"{run.rounds_done} of {args.rounds} rounds")
        args.rounds = run.rounds_done
    measured = [c for c in wanted if run.steps[c.name]]
    skipped += [f"{c.name} (not measured: out of time)" for c in wanted if not run.steps[c.name]]
    lines = report(args, argv, device, measured, skipped, notes, n_params, tokens, flops, run.steps, run.per_round,
                   run.losses, run.busy)
    publish(lines + against_peers(args, measured, run), args.out)
    return 0


class Run:
    """The measured steps of every contender, interleaved or one at a time, within ``--budget-seconds``."""

    def __init__(self, args, device: torch.device, gcfg: GPTConfig, micro, nvme_path: str, notes: list[str],
                 t0: float) -> None:
        self.args, self.device, self.gcfg, self.micro, self.notes, self.t0 = args, device, gcfg, micro, notes, t0
        self.kw = dict(batch=args.batch, accum=args.accum, nvme_path=nvme_path, meta=args.largest)
        self.steps: dict[str, list[float]] = collections.defaultdict(list)
        self.per_round: dict[str, list[float]] = collections.defaultdict(list)
        self.losses: dict[str, float] = {}
        self.trace: dict[str, dict[tuple[int, int], float]] = collections.defaultdict(dict)  # (round, step): loss
        self.busy: dict[str, float | None] = {}
        self.setup: dict[str, float] = {}
        self.rounds_done = 0

    def left(self) -> float:
        """Seconds left of the budget (infinite without one)."""
        if self.args.budget_seconds is None:
            return float("inf")
        return self.args.budget_seconds - (time.perf_counter() - self.t0)

    def build(self, c: Contender, base: GPT | None = None):
        t0 = time.perf_counter()
        row = build(c, self.gcfg, self.device, base=base, **self.kw)
        self.setup[c.name] = time.perf_counter() - t0
        if isinstance(row, DeepSpeedRow):
            self.notes.append(f"{c.name}: {row.settings()}")
        return row

    def measure(self, row, r: int) -> None:
        for s in range(self.args.steps_per_round):
            dt, loss = row.step(self.micro[(r * self.args.steps_per_round + s) % len(self.micro)])
            self.losses[row.name] = loss
            self.trace[row.name][r, s] = loss
            if s:
                self.steps[row.name].append(dt)
                self.per_round[f"{row.name}@{r}"].append(dt)
        if isinstance(row, EngineRow):
            row.engine.settle()  # a step's tail under the next forward ends with its round, not in the next row's

    def profile(self, row) -> None:
        """The wait share's profiled step, when the budget has room for it (three steps' time)."""
        if self.left() > 3 * statistics.median(self.steps[row.name]) + 5:
            self.busy[row.name] = profiled_busy(row, self.micro[0], self.device)
            if isinstance(row, EngineRow):
                row.engine.settle()

    def sequential(self, wanted: list[Contender]) -> None:
        for c in wanted:
            if self.left() < 60:  # not enough to build and step a model of this size
                break
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            row = self.build(c)
            try:
                row.step(self.micro[0])  # warm-up: allocations, the first NVMe reads, stage 3's fetch order
                for r in range(self.args.rounds):
                    if r and self.left() < 1.5 * sum(self.per_round[f"{c.name}@{r - 1}"]) + 10:
                        break
                    self.measure(row, r)
                    self.rounds_done = max(self.rounds_done, r + 1)
                self.profile(row)
                if self.device.type == "cuda":
                    self.notes.append(f"{c.name}: peak GPU memory "
                                      f"{torch.cuda.max_memory_allocated(self.device) / 2**30:.1f} GiB")
                if isinstance(row, EngineRow) and row.breakdown():
                    self.notes.append(f"{c.name}, per step: {row.breakdown()}")
            finally:
                row.close()
                del row
                gc.collect()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            print(f"{c.name}: {statistics.median(self.steps[c.name]):.3f} s/step", flush=True)

    def interleaved(self, wanted: list[Contender]) -> None:
        base = GPT(self.gcfg, seed=0)  # built once (seconds at 1B), copied for each contender
        rows = []
        try:
            for c in wanted:
                rows.append(self.build(c, base))
            del base
            gc.collect()
            for row in rows:
                row.step(self.micro[0])
            last = 0.0
            for r in range(self.args.rounds):
                if r and self.left() < 1.5 * last + 10:
                    break
                t0 = time.perf_counter()
                for row in rows[r % len(rows):] + rows[:r % len(rows)]:
                    self.measure(row, r)
                last = time.perf_counter() - t0
                self.rounds_done = r + 1
                print(f"round {r + 1}/{self.args.rounds}: " + ", ".join(
                    f"{row.name} {statistics.median(self.per_round[f'{row.name}@{r}']):.3f}s" for row in rows),
                    flush=True)
            for row in rows:
                if self.steps[row.name]:
                    self.profile(row)
        finally:
            for row in rows:
                if isinstance(row, EngineRow) and row.breakdown():
                    self.notes.append(f"{row.name}, per step: {row.breakdown()}")
                row.close()


def against_peers(args, measured: list[Contender], run: "Run") -> list[str]:
    """Each row's losses against torch's, step by step, and ours against DeepSpeed's step rate."""
    names = [c.name for c in measured]
    lines = []
    if "torch" in names:
        ref = run.trace["torch"]
        lines += ["", "Losses against torch's, step by step (the same batches in the same order; bf16):", ""]
        for name in names[names.index("torch") + 1:] + names[:names.index("torch")]:
            common = sorted(set(ref) & set(run.trace[name]))
            if common:
                worst = max(abs(run.trace[name][k] - ref[k]) for k in common)
                lines.append(f"- {name}: largest |loss - torch's| {worst:.4f} over {len(common)} steps")
    pairs = [(ours, peer) for peer, ours in PEERS.items() if peer in names and ours in names]
    if pairs:
        lines += ["", "Ours against DeepSpeed (the same offload, config keys, batches and weights):", ""]
    for ours, peer in pairs:
        common = sorted(set(run.trace[ours]) & set(run.trace[peer]))
        worst = max(abs(run.trace[ours][k] - run.trace[peer][k]) for k in common)
        lines.append(f"- {ours} / {peer}: step rate {_ratio(ours, peer, args, run.steps, run.per_round)} (issue 39: "
                     f">= 2x); largest |loss - DeepSpeed's| {worst:.4f} over {len(common)} steps")
    return lines


def _ratio(name: str, ref: str, args, steps, per_round) -> str:
    """Step rate of ``name`` over ``ref``'s (= ref's step time / name's)."""
    if ref not in steps or not steps[ref] or not steps[name]:
        return ""
    if args.sequential:
        return f"{statistics.median(steps[ref]) / statistics.median(steps[name]):.2f}"
    paired = [statistics.median(per_round[f"{ref}@{r}"]) / statistics.median(per_round[f"{name}@{r}"])
              for r in range(args.rounds)]
    return f"{statistics.median(paired):.2f} ({min(paired):.2f}-{max(paired):.2f})"


def report(args, argv, device, wanted, skipped, notes, n_params, tokens, flops, steps, per_round, losses, busy) -> list[str]:
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU only ({os.cpu_count()} CPUs)"
    lines = [
        f"# Training step bench, GPU rows: {_count(n_params)} GPT, bf16, {datetime.date.today().isoformat()}", "",
        f"- machine: {where}; torch {torch.__version__} (CUDA {torch.version.cuda}); Python "
        f"{platform.python_version()}; load average at the end {_load()}",
        f"- command: `{' '.join(['python3 tools/bench/step_gpu.py'] + argv)}`",
        f"- model: offload.models.gpt.GPT, {_count(n_params)} params (vocab {args.vocab}, dim {args.dim}, "
        f"{args.layers} layers, {args.heads} heads, tied head); a step = {args.accum} micro-batches of {args.batch} x "
        f"{args.seq} tokens ({tokens} tokens) + the optimizer step; one rank",
        f"- {'sequential: one contender built, measured and closed at a time' if args.sequential else 'interleaved, rotating order'}; "
        f"{args.rounds} rounds x {args.steps_per_round} steps (first of each not measured); medians (min-max)",
        f"- TFLOP/s: (6 N + 12 L d T) x tokens / step = {flops / 1e12:.2f} TFLOP per step / step seconds; GPU wait: "
        "1 - (union of CUDA kernel intervals in one profiled step) / median step; rate / X: X's step time over "
        f"this row's ({'ratio of medians' if args.sequential else 'median over rounds of the paired ratios'})",
        *[f"- {n}" for n in notes], "",
        "| contender | step s | tokens/s | TFLOP/s | GPU wait | rate / torch | rate / none | last loss |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in wanted:
        st = steps[c.name]
        med = statistics.median(st)
        wait = "n/a" if busy.get(c.name) is None else f"{max(0.0, 1 - busy[c.name] / med):.1%}"
        lines.append(f"| {c.name} | {med:.3f} ({min(st):.3f}-{max(st):.3f}) | {tokens / med:,.0f} | "
                     f"{flops / med / 1e12:.1f} | {wait} | {_ratio(c.name, 'torch', args, steps, per_round)} | "
                     f"{_ratio(c.name, 'none', args, steps, per_round)} | {losses[c.name]:.4f} |")
    if skipped:
        lines += ["", "Skipped: " + "; ".join(skipped)]
    for ref in ("torch", "none"):
        if "opt-cpu" in steps and ref in steps:
            rate = statistics.median(steps[ref]) / statistics.median(steps["opt-cpu"])
            lines += ["", f"Bar: opt-cpu at {rate:.2f} of {ref}'s step rate (issue 12: >= 0.70): "
                      f"{'met' if rate >= 0.70 else 'not met'}"]
            break
    return lines


if __name__ == "__main__":
    sys.exit(main())
