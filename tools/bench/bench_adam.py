"""CPU Adam: ours against torch.optim.AdamW(fused=True) and the memory roofline.

Every case is measured in rounds; each round runs every contender once (a block of
steps), in an order shuffled from round to round, so bandwidth drift and the other
work on a shared machine hit all of them alike. Reported per contender: the median over
rounds of Mparams/s and the effective GB/s at Adam's bytes a param; per pair: the median
of the per-round ratios with their 10th-90th percentile and min-max spread.

The roofline is measured in the same rounds: an in-place streaming pass (C, same threads,
same thread pool) over four float32 arrays of the same total size that moves exactly
Adam's 28 bytes a param, on the same kind of pages as ours (CPUAdam's moments are on
huge pages, the functional step's buffers in the bf16 case are torch's). Where the arrays fit in the last-level cache it is a cache
figure, not a memory one, and ours / roofline there is not an efficiency.

Cases (a shape is "N params x T tensors", the params split evenly):
  fp32  CPUAdam.step() against AdamW(fused=True) (and with --foreach AdamW(foreach=True)),
        all through the optimizer API.
  bf16  the offload step: bf16 grads in, scaled, fp32 master and moments updated, a bf16
        copy of the new params out. Ours is one cpu_adam.adam_step call; torch's is the
        fastest of two equivalent sequences (convert grads, fused AdamW with or without its
        own grad_scale, copy params to bf16), each timed whole.

  states  the int8-state step (cpu_adam.quant: uint8 codes + block scales, fused dequantize /
        update / requantize) against the fp32-state and the bf16-state step, one functional
        adam_step each over the same fp32 params and grads; its memory share is its bytes a param
        (16.06: param 8, grad 4, moments 2 x 2, scales) at its rate over the streaming pass's GB/s.
        int8_undo and bf16_undo are the int8 and bf16 steps after the undo copy of a state block as
        large as theirs, as a recorded step through the daemon does it ([Note: block undo] in
        offload.zero.block_undo); "ours / int8_undo" is the copied step's time over the plain one's.
        int8_m16 is the int8 step with a bfloat16 master (offload.master_dtype "bf16": widened, stepped,
        rounded back stochastically), 12.06 bytes a param.

The summary checks the issue's targets per case: ours >= 1.0x torch fused (fp32) or
>= 1.3x torch's fastest sequence (bf16), and >= 0.9 of the roofline where the four
arrays (16 B a param) exceed the last-level cache. The load average (1 minute) at the
end of each case is in the summary: other work on the machine moves every figure.

--interleaved: CPUAdam as a user's loop runs it, one torch fused step then one of ours, paired, on our
threads from torch's OpenMP team and from our own pool (tools/bench/adam_interleaved.py); --load busyN adds
N busy loops for the whole run. --pool adds ``ours_pool`` (the kernels' own threads) to the fp32 cases.

torch's OpenMP workers wait in the bench as they do in a process that called offload.initialize
([Note: OpenMP waits] in offload.runtime.omp_wait), for torch's steps and ours alike: --omp-waits auto (the default)
spins as libgomp does until the CPUs are contended, then briefly; sleep always briefly (cheaper for our pool
after a torch op, dearer for torch's small ops); spin never changes libgomp's default.

Usage: python tools/bench/bench_adam.py [--shapes 1e6x1 1e7x10 ...] [--bf16 1e6 1e7 1e8] [--states 1e7 1e8]
       [--rounds R] [--omp-waits auto|sleep|spin] [--pool] [--interleaved] [--load quiet|busyN] [--out FILE]
Run under `flock /tmp/ofl-bench.lock` when other benchmarks share the machine.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from cpu_adam import AdamConfig, CPUAdam, adam_step, default_num_threads, resolve_isa, set_thread_source  # noqa: E402
from cpu_adam.kernels import stream_inplace  # noqa: E402
from cpu_adam.state_memory import zeros_state_like  # noqa: E402
from offload.runtime.omp_wait import quiet_omp_waits  # noqa: E402
import adam_interleaved as interleaved  # noqa: E402  (a sibling module: the script's directory is on the path)
from machine import cpu_description, llc_bytes  # noqa: E402
from bench_contention import start_load, stop_load  # noqa: E402

BYTES_PER_PARAM = 28
LR, WD, SCALE = 1e-4, 0.01, 1.0 / 1024.0
SAMPLE_SECONDS = 0.01  # one sample of a contender times a block of steps this long
# 1e5x1000 is read as the table reads it (total params x tensors): 100-element
# tensors, where the per-call cost is all there is; 1e8x1000 is 1,000 tensors of 1e5.
DEFAULT_SHAPES = ["1e5x1000", "1e6x1", "1e6x100", "1e6x1000", "1e7x1", "1e7x10", "1e7x100",
                  "1e7x1000", "1e8x1", "1e8x100", "1e8x1000"]
DEFAULT_BF16 = ["1e6", "1e7", "1e8"]
DEFAULT_STATES = ["1e7", "1e8"]
STATE_BYTES = {"fp32_states": 28.0, "bf16_states": 20.0, "ours": 16.0 + 16 / 256,  # a param moved, grads fp32
               "int8_m16": 12.0 + 16 / 256,
               "int8_undo": 16.0 + 16 / 256 + 2 * (6.0 + 8 / 256), "bf16_undo": 20.0 + 2 * 8.0}  # + the copy
TARGET_INT8_VS_FP32 = 1.6
TARGET_VS_TORCH = {"fp32": 1.0, "bf16": 1.3}  # ours / torch fused (bf16: its fastest sequence)
TARGET_VS_ROOFLINE = 0.9  # where the arrays exceed the last-level cache
ROOFLINE_BYTES_PER_PARAM = 16  # the four float32 arrays that must not fit in the LLC


def _split(n: int, parts: int) -> list[int]:
    base = n // parts
    return [base + (1 if i < n % parts else 0) for i in range(parts)]


def _params_with_grads(sizes: list[int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for n in sizes:
        p = torch.randn(n, generator=gen)
        p.grad = torch.randn(n, generator=gen)
        params.append(p)
    return params


def _rounds_for(n: int, requested: int | None) -> int:
    """Rounds per case: 200 where a step is short, 40 where it is a tenth of a second."""
    if requested:
        return requested
    return max(40, min(200, int(4e9 // n)))


def _timed(fn: Callable[[], None], reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def _roofline(n: int, threads: int, huge_moments: bool) -> Callable[[], None]:
    """The streaming pass over arrays placed as ours are: a and b (the param and gradient
    streams) from torch's allocator; c and d (the moments) too, or, with ``huge_moments``,
    as CPUAdam allocates its state: on huge pages where they are large
    ([Note: huge pages for the moments] in cpu_adam.state_memory)."""
    a, b = (torch.full((n,), 1e-3) for _ in range(2))
    if huge_moments:
        c, d = (zeros_state_like(a).fill_(1e-3) for _ in range(2))
    else:
        c, d = (torch.full((n,), 1e-3) for _ in range(2))
    return lambda: stream_inplace(a, b, c, d, num_threads=threads)


def _on(source: str, step: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        set_thread_source(source)
        step()
    return run


def fp32_contenders(n: int, tensors: int, threads: int, foreach: bool, pool: bool = False
                    ) -> dict[str, Callable[[], None]]:
    sizes = _split(n, tensors)
    ours = _params_with_grads(sizes, 0)
    fused = _params_with_grads(sizes, 0)
    opt_ours = CPUAdam(ours, lr=LR, weight_decay=WD, num_threads=threads)
    opt_fused = torch.optim.AdamW(fused, lr=LR, weight_decay=WD, fused=True)
    contenders = {"ours": _on("team", opt_ours.step), "torch_fused": _on("team", opt_fused.step)}
    if pool:  # the kernels' own threads ([Note: one thread team] in csrc/ofl_parallel.h)
        opt_pool = CPUAdam(_params_with_grads(sizes, 0), lr=LR, weight_decay=WD, num_threads=threads)
        contenders["ours_pool"] = _on("pool", opt_pool.step)
    if foreach:
        opt_foreach = torch.optim.AdamW(_params_with_grads(sizes, 0), lr=LR, weight_decay=WD, foreach=True)
        contenders["torch_foreach"] = opt_foreach.step
    contenders["roofline"] = _on("team", _roofline(n, threads, huge_moments=True))
    return contenders


def bf16_contenders(n: int, threads: int) -> dict[str, Callable[[], None]]:
    gen = torch.Generator().manual_seed(1)
    grad_bf16 = torch.randn(n, generator=gen).to(torch.bfloat16)

    p, m, v = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
    out, step = torch.empty(n, dtype=torch.bfloat16), torch.zeros(())
    cfg = AdamConfig(lr=LR, weight_decay=WD, num_threads=threads)

    def ours() -> None:
        adam_step([p], [grad_bf16], [m], [v], [step], config=cfg, grad_scale=SCALE, params_out=[out])

    def torch_sequence(own_scale: bool) -> Callable[[], None]:
        tp = torch.randn(n, generator=gen)
        g32 = torch.empty(n)
        tp.grad = g32
        tout = torch.empty(n, dtype=torch.bfloat16)
        opt = torch.optim.AdamW([tp], lr=LR, weight_decay=WD, fused=True)
        if own_scale:  # the fused kernel divides by grad_scale itself (GradScaler's path)
            opt.grad_scale = torch.tensor(1.0 / SCALE)
            opt.found_inf = torch.tensor(0.0)

        def run() -> None:
            g32.copy_(grad_bf16)
            if not own_scale:
                g32.mul_(SCALE)
            opt.step()
            tout.copy_(tp)

        return run

    return {
        "ours": ours,
        "torch_convert_mul_fused_copy": torch_sequence(own_scale=False),
        "torch_convert_fused_scale_copy": torch_sequence(own_scale=True),
        "roofline": _roofline(n, threads, huge_moments=False),  # ours' buffers here are torch's
    }


def state_contenders(n: int, threads: int) -> dict[str, Callable[[], None]]:
    """One adam_step over n params with fp32 grads, its moments fp32 (on huge pages, as CPUAdam's),
    bf16, or int8 ("ours"); and the streaming pass."""
    from cpu_adam.quant import zeros_moments

    gen = torch.Generator().manual_seed(2)
    grad = torch.randn(n, generator=gen)
    cfg = AdamConfig(lr=LR, weight_decay=WD, num_threads=threads)
    out = {}
    for name, sd in (("fp32_states", "fp32"), ("bf16_states", "bf16"), ("ours", "int8")):
        p, step = torch.randn(n, generator=gen), torch.zeros(())
        mo = zeros_moments((n,), sd)
        if sd == "fp32":
            mo = mo._replace(exp_avg=zeros_state_like(p), exp_avg_sq=zeros_state_like(p))
        scales = ([mo.exp_avg_scale], [mo.exp_avg_sq_scale]) if sd == "int8" else (None, None)
        out[name] = (lambda p=p, mo=mo, step=step, scales=scales: adam_step(
            [p], [grad], [mo.exp_avg], [mo.exp_avg_sq], [step], config=cfg,
            exp_avg_scales=scales[0], exp_avg_sq_scales=scales[1]))
    p16, step16, mo16 = torch.randn(n, generator=gen).to(torch.bfloat16), torch.zeros(()), zeros_moments((n,), "int8")
    out["int8_m16"] = lambda: adam_step([p16], [grad], [mo16.exp_avg], [mo16.exp_avg_sq], [step16], config=cfg,
                                        exp_avg_scales=[mo16.exp_avg_scale], exp_avg_sq_scales=[mo16.exp_avg_sq_scale],
                                        master_seeds=[0])
    from offload.zero.block_undo import BlockUndo, block_undo_bytes

    blocks = (("int8_undo", "ours", 6 * n + 8 * -(-n // 256)), ("bf16_undo", "bf16_states", 8 * n))
    for name, plain, block_bytes in blocks:
        block = torch.zeros(block_bytes, dtype=torch.uint8)
        undo = BlockUndo(bytearray(block_undo_bytes(block_bytes)), fresh=True)

        def logged(undo=undo, block=block, step=out[plain]):
            undo.begin()
            undo.save(0, block)
            step()
        out[name] = logged
    out["roofline"] = _roofline(n, threads, huge_moments=True)
    return out


def state_rows(case: str, n: int, samples: dict[str, list[float]], summary: dict[str, dict[str, str]]) -> list[str]:
    """The int8 state step against the fp32 and bf16 ones, and its share of the stream's bytes."""
    rows = []
    for name, values in samples.items():
        mps = [n / s / 1e6 for s in values]
        med = statistics.median(mps)
        per = STATE_BYTES.get(name, BYTES_PER_PARAM)
        rows.append(f"| {case} | {name} | {med:,.0f} ({_pct(mps, 0.1):,.0f}-{_pct(mps, 0.9):,.0f}) "
                    f"| {med * per / 1e3:.1f} at {per:.2f} B | |")
    for a, b in (("ours", "fp32_states"), ("ours", "bf16_states"), ("bf16_states", "fp32_states"),
                 ("ours", "int8_undo"), ("bf16_states", "bf16_undo"), ("int8_m16", "fp32_states"),
                 ("int8_m16", "ours")):
        ratios = [sb / sa for sa, sb in zip(samples[a], samples[b])]
        text = f"{statistics.median(ratios):.2f}x ({_pct(ratios, 0.1):.2f}-{_pct(ratios, 0.9):.2f})"
        summary.setdefault(case, {})[f"{a}/{b}"] = text
        rows.append(f"| {case} | {a} / {b} | | | **{text}** (min-max {min(ratios):.2f}-{max(ratios):.2f}) |")
    for name in ("ours", "fp32_states", "int8_m16"):
        shares = [(STATE_BYTES[name] / s) / (BYTES_PER_PARAM / r) for s, r in zip(samples[name], samples["roofline"])]
        text = f"{statistics.median(shares):.2f} ({_pct(shares, 0.1):.2f}-{_pct(shares, 0.9):.2f})"
        summary[case][f"{name} roofline"] = text
        rows.append(f"| {case} | {name} GB/s / stream GB/s | | | {text} |")
    got = _median_ratio(summary[case]["ours/fp32_states"])
    summary[case]["targets"] = (f"int8 / fp32 states >= {TARGET_INT8_VS_FP32}x: "
                                f"{'met' if got >= TARGET_INT8_VS_FP32 else '**not met**'}")
    summary[case]["load"] = f"{os.getloadavg()[0]:.2f}"
    return rows


def _reps_for(fn: Callable[[], None]) -> int:
    """Steps per sample: enough for about SAMPLE_SECONDS, so that fast cases are not timer noise."""
    fn()  # warm up: state allocation, first touch
    single = statistics.median(_timed(fn, 1) for _ in range(3))
    return max(1, round(SAMPLE_SECONDS / single))


def measure(contenders: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    """Seconds per step of each contender, one sample (a block of steps) a round.

    The order is shuffled every round (seeded): a rotation would keep who runs after whom
    fixed, and the one that follows torch always meets its OpenMP workers still spinning,
    the one that follows a streaming pass always writes back its dirty cache lines.
    """
    names = list(contenders)
    reps = {name: _reps_for(fn) for name, fn in contenders.items()}
    samples: dict[str, list[float]] = {k: [] for k in names}
    order = list(names)
    shuffler = random.Random(0)
    for _ in range(rounds):
        shuffler.shuffle(order)
        for name in order:
            samples[name].append(_timed(contenders[name], reps[name]))
    return samples


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(case: str, n: int, samples: dict[str, list[float]], peers: list[str],
              summary: dict[str, dict[str, str]]) -> list[str]:
    """Rows of the full table; the ratio of ours to each peer also goes into ``summary``."""
    rows = []
    mps = {k: [n / s / 1e6 for s in v] for k, v in samples.items()}
    for name, values in mps.items():
        med = statistics.median(values)
        rows.append(f"| {case} | {name} | {med:,.0f} ({_pct(values, 0.1):,.0f}-{_pct(values, 0.9):,.0f}) "
                    f"| {med * BYTES_PER_PARAM / 1e3:.1f} | |")
    for peer in peers:
        ratios = [o / p for o, p in zip(mps["ours"], mps[peer])]
        text = f"{statistics.median(ratios):.2f}x ({_pct(ratios, 0.1):.2f}-{_pct(ratios, 0.9):.2f})"
        summary.setdefault(case, {})[peer] = text
        rows.append(f"| {case} | ours / {peer} | | | **{text}** (min-max {min(ratios):.2f}-{max(ratios):.2f}) |")
    return rows


def summary_table(summary: dict[str, dict[str, str]]) -> list[str]:
    """One line per case: ours against torch and the roofline, the targets, the load at its end."""
    rows = ["", "| case | ours / torch fused (or fastest) | ours / roofline | targets | load |",
            "| --- | --- | --- | --- | --- |"]
    for case, ratios in summary.items():
        torch_ratio = ratios.get("torch_fused", ratios.get("torch_fastest", ""))
        roof = ratios.get("roofline", "")
        if "ours/fp32_states" in ratios:  # a state-dtype case: against the fp32-state step
            torch_ratio = f"int8 / fp32 states {ratios['ours/fp32_states']}; int8 / bf16 {ratios['ours/bf16_states']}"
            roof = f"int8 {ratios['ours roofline']}, fp32 states {ratios['fp32_states roofline']} (bytes)"
        rows.append(f"| {case} | {torch_ratio} | {roof} | {ratios.get('targets', '')} "
                    f"| {ratios.get('load', '')} |")
    return rows


def _median_ratio(text: str) -> float:
    return float(text.split("x", 1)[0])


def judge(case: str, kind: str, n: int, llc: int | None, summary: dict[str, dict[str, str]]) -> None:
    """Add the issue's targets, met or not, and the load average to ``summary[case]``."""
    ratios = summary[case]
    peer = "torch_fused" if kind == "fp32" else "torch_fastest"
    verdicts = []
    want = TARGET_VS_TORCH[kind]
    got = _median_ratio(ratios[peer])
    verdicts.append(f"torch >= {want:.1f}x: {'met' if got >= want else '**not met**'}")
    if llc is not None and n * ROOFLINE_BYTES_PER_PARAM > llc:
        got = _median_ratio(ratios["roofline"])
        verdicts.append(f"roofline >= {TARGET_VS_ROOFLINE}: {'met' if got >= TARGET_VS_ROOFLINE else '**not met**'}")
    else:
        verdicts.append("roofline: in cache, no target")
    ratios["targets"] = "; ".join(verdicts)
    ratios["load"] = f"{os.getloadavg()[0]:.2f}"


def _best_torch(samples: dict[str, list[float]]) -> dict[str, list[float]]:
    """Fold torch's bf16 sequences into one contender: the faster one in each round."""
    torch_keys = [k for k in samples if k.startswith("torch_")]
    best = [min(vals) for vals in zip(*(samples[k] for k in torch_keys))]
    return {**samples, "torch_fastest": best}


def _shape(text: str) -> tuple[int, int]:
    n, _, t = text.lower().partition("x")
    return int(float(n)), int(t or 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=DEFAULT_SHAPES, help="fp32 cases, N params x T tensors")
    ap.add_argument("--bf16", nargs="*", default=DEFAULT_BF16, help="sizes of the bf16 offload step")
    ap.add_argument("--states", nargs="*", default=DEFAULT_STATES, help="sizes of the state-dtype cases")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per case; default by size (40-200)")
    ap.add_argument("--threads", type=int, default=default_num_threads())
    ap.add_argument("--foreach", action="store_true", help="also time AdamW(foreach=True)")
    ap.add_argument("--omp-waits", choices=("auto", "sleep", "spin"), default=None,
                    help="torch's OpenMP waits as offload.initialize sets them (OFL_OMP_WAIT, [Note: OpenMP waits]): "
                         "auto, a short spin only while the CPUs are contended; sleep, always; spin, libgomp's default "
                         "(default: auto, and spin with --interleaved: a user's loop calls no offload.initialize)")
    ap.add_argument("--pool", action="store_true", help="fp32 cases: also ours on the kernels' own threads")
    ap.add_argument("--interleaved", action="store_true",
                    help="one torch fused step then one of ours, paired, team and pool (the fp32 shapes only)")
    ap.add_argument("--load", default="quiet", help="quiet, or busyN: N busy loops for the whole run")
    ap.add_argument("--out", type=Path, help="also write the report (markdown) here")
    args = ap.parse_args(argv)
    if args.interleaved:
        args.bf16, args.states = [], []
    args.omp_waits = args.omp_waits or ("spin" if args.interleaved else "auto")
    torch.set_num_threads(args.threads)
    team = quiet_omp_waits(mode=args.omp_waits)
    load = start_load(args.load)
    try:
        return _run(args, team)
    finally:
        stop_load(load)


def _run(args: argparse.Namespace, team: int) -> int:

    header = [
        f"# CPU Adam benchmark, {datetime.date.today():%Y-%m-%d}",
        "",
        f"- CPU: {cpu_description()}",
        f"- {args.threads} threads (torch and ours); torch {torch.__version__}; "
        f"our ISA path: {resolve_isa(None).name.lower()}",
        f"- torch's OpenMP waits: {args.omp_waits}" + (f" (helper team of {team})" if team else ""),
        f"- command: `{' '.join(['python tools/bench/bench_adam.py', *sys.argv[1:]])}`",
        f"- added load: {args.load}; load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
    ]
    if args.interleaved:
        header += ["- interleaved: one torch fused AdamW step, then at once one of ours, each timed alone "
                   "(tools/bench/adam_interleaved.py); Mparams/s: median (p10-p90) over pairs"]
        print("\n".join(header), flush=True)
        rows = interleaved.run([_shape(t) for t in args.shapes],
                               lambda n, tensors: lambda: _params_with_grads(_split(n, tensors), 0),
                               lambda n: _rounds_for(n, args.rounds), LR, WD, args.threads, _emit)
        footer = ["", f"- load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}"]
        print("\n".join(footer), flush=True)
        if args.out:
            args.out.write_text("\n".join(header + rows + footer) + "\n")
        return 0
    header += [
        "- contenders interleaved within each round, order shuffled; Mparams/s: median (p10-p90) "
        "over rounds; GB/s at 28 B/param; ratios: median of per-round ratios (p10-p90; min-max)",
        "",
        "| case | contender | Mparams/s | GB/s | ratio |",
        "| --- | --- | --- | --- | --- |",
    ]
    print("\n".join(header), flush=True)
    rows: list[str] = []
    summary: dict[str, dict[str, str]] = {}
    llc = llc_bytes()
    for text in args.shapes:
        n, tensors = _shape(text)
        rounds = _rounds_for(n, args.rounds)
        samples = measure(fp32_contenders(n, tensors, args.threads, args.foreach, args.pool), rounds)
        peers = [k for k in samples if k != "ours"]
        case = f"fp32 {n:.0e} x {tensors} ({rounds} rounds)"
        rows += _emit(summarize(case, n, samples, peers, summary))
        judge(case, "fp32", n, llc, summary)
        del samples
        gc.collect()
    for text in args.bf16:
        n = int(float(text))
        rounds = _rounds_for(n, args.rounds)
        samples = _best_torch(measure(bf16_contenders(n, args.threads), rounds))
        case = f"bf16 offload step {n:.0e} ({rounds} rounds)"
        rows += _emit(summarize(case, n, samples, ["torch_fastest", "roofline"], summary))
        judge(case, "bf16", n, llc, summary)
        gc.collect()
    for text in args.states:
        n = int(float(text))
        rounds = _rounds_for(n, args.rounds)
        samples = measure(state_contenders(n, args.threads), rounds)
        rows += _emit(state_rows(f"states {n:.0e} ({rounds} rounds)", n, samples, summary))
        del samples
        gc.collect()
    footer = summary_table(summary) + ["", f"- load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}"]
    print("\n".join(footer), flush=True)
    if args.out:
        args.out.write_text("\n".join(header + rows + footer) + "\n")
    return 0


def _emit(rows: list[str]) -> list[str]:
    print("\n".join(rows), flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
