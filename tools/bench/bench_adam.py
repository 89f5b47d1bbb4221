"""CPU Adam: ours against torch.optim.AdamW (fused and foreach) and the memory roofline.

Every case is measured in rounds; each round runs every contender once, in an order that
rotates from round to round, so bandwidth drift hits all of them alike. Reported: the
median over rounds of params/s, the effective GB/s at Adam's 28 bytes a param (p, g, m, v
read; p, m, v written), and the median of the per-round ratios.

The roofline is measured in the same run: an in-place streaming pass (C, same threads)
over four float32 arrays of the same total size that moves exactly Adam's 28 bytes a param.

Cases:
  fp32  N params as 1 tensor and as 100 tensors: CPUAdam.step() against AdamW(fused=True)
        and AdamW(foreach=True), all through the optimizer API.
  bf16  the offload step: bf16 grads in, scaled, fp32 master and moments updated, a bf16
        copy of the new params out. Ours is one cpu_adam.adam_step call; torch's is the
        fastest of two equivalent sequences (convert grads, fused AdamW with or without its
        own grad_scale, copy params to bf16), each timed whole.

Usage: python tools/bench/bench_adam.py [--sizes 1e6 1e7 1e8] [--rounds 7] [--out FILE]
Run under `flock /tmp/ofl-bench.lock` when other benchmarks share the machine.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from cpu_adam import AdamConfig, CPUAdam, adam_step, default_num_threads, resolve_isa  # noqa: E402
from cpu_adam.kernels import stream_inplace  # noqa: E402

BYTES_PER_PARAM = 28
LR, WD, SCALE = 1e-4, 0.01, 1.0 / 1024.0


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


def _reps_for(n: int) -> int:
    """Steps per timing, so that small cases are not all timer noise."""
    return max(1, int(3e7 // n))


def _timed(fn: Callable[[], None], reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def _roofline(n: int, threads: int) -> Callable[[], None]:
    a, b, c, d = (torch.full((n,), 1e-3) for _ in range(4))
    return lambda: stream_inplace(a, b, c, d, num_threads=threads)


def fp32_contenders(n: int, tensors: int, threads: int) -> dict[str, Callable[[], None]]:
    sizes = _split(n, tensors)
    ours = _params_with_grads(sizes, 0)
    fused = _params_with_grads(sizes, 0)
    foreach = _params_with_grads(sizes, 0)
    opt_ours = CPUAdam(ours, lr=LR, weight_decay=WD, num_threads=threads)
    opt_fused = torch.optim.AdamW(fused, lr=LR, weight_decay=WD, fused=True)
    opt_foreach = torch.optim.AdamW(foreach, lr=LR, weight_decay=WD, foreach=True)
    return {
        "ours": opt_ours.step,
        "torch_fused": opt_fused.step,
        "torch_foreach": opt_foreach.step,
        "roofline": _roofline(n, threads),
    }


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
        "roofline": _roofline(n, threads),
    }


def measure(contenders: dict[str, Callable[[], None]], n: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per step of each contender, one sample a round, order rotating."""
    reps = _reps_for(n)
    names = list(contenders)
    for fn in contenders.values():  # warm up: state allocation, first touch
        fn()
    samples: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            samples[name].append(_timed(contenders[name], reps))
    return samples


def summarize(case: str, n: int, samples: dict[str, list[float]], peers: list[str]) -> list[str]:
    rows = []
    mps = {k: [n / s / 1e6 for s in v] for k, v in samples.items()}
    for name, values in mps.items():
        med = statistics.median(values)
        rows.append(f"| {case} | {name} | {med:,.0f} ({min(values):,.0f}-{max(values):,.0f}) "
                    f"| {med * BYTES_PER_PARAM / 1e3:.1f} | |")
    for peer in peers:
        ratios = [o / p for o, p in zip(mps["ours"], mps[peer])]
        rows.append(f"| {case} | ours / {peer} | | | **{statistics.median(ratios):.2f}x** "
                    f"({min(ratios):.2f}-{max(ratios):.2f}) |")
    return rows


def _best_torch(samples: dict[str, list[float]]) -> dict[str, list[float]]:
    """Fold torch's bf16 sequences into one contender: the faster one in each round."""
    torch_keys = [k for k in samples if k.startswith("torch_")]
    best = [min(vals) for vals in zip(*(samples[k] for k in torch_keys))]
    return {**samples, "torch_fastest": best}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", type=float, default=[1e6, 1e7, 1e8])
    ap.add_argument("--tensors", nargs="+", type=int, default=[1, 100])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=default_num_threads())
    ap.add_argument("--out", type=Path, help="also write the report (markdown) here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    header = [
        f"# CPU Adam benchmark, {datetime.date.today():%Y-%m-%d}",
        "",
        f"- machine: {platform.processor() or platform.machine()}, {_cpu_model()}, "
        f"{args.threads} threads (torch and ours)",
        f"- torch {torch.__version__}; our ISA path: {resolve_isa(None).name.lower()}",
        f"- command: `python tools/bench/bench_adam.py {' '.join(sys.argv[1:])}`".rstrip(),
        f"- {args.rounds} rounds, contenders interleaved with a rotating order; "
        "medians (min-max) of Mparams/s; GB/s at 28 B/param; ratios are medians of per-round ratios",
        "",
        "| case | contender | Mparams/s | GB/s | ratio |",
        "| --- | --- | --- | --- | --- |",
    ]
    print("\n".join(header), flush=True)
    rows: list[str] = []
    for size in args.sizes:
        n = int(size)
        for tensors in args.tensors:
            samples = measure(fp32_contenders(n, tensors, args.threads), n, args.rounds)
            case = f"fp32 {n:.0e} x {tensors}"
            new = summarize(case, n, samples, ["torch_fused", "torch_foreach", "roofline"])
            print("\n".join(new), flush=True)
            rows += new
            gc.collect()
        samples = _best_torch(measure(bf16_contenders(n, args.threads), n, args.rounds))
        new = summarize(f"bf16 offload step {n:.0e}", n, samples, ["torch_fastest", "roofline"])
        print("\n".join(new), flush=True)
        rows += new
        gc.collect()
    if args.out:
        args.out.write_text("\n".join(header + rows) + "\n")
    return 0


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
