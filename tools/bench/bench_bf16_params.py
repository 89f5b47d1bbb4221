"""A bfloat16 model's optimizer: CPUAdamW over bf16 params (stochastic rounding) against torch's AdamW.

A model held in bfloat16 and stepped by torch.optim.AdamW keeps its moments in bfloat16 too and
rounds every update to nearest, so updates under half a last place are lost (lr 1e-4 at 1.0 is
1/78th of bf16's spacing there). CPUAdamW over the same params ([Note: bfloat16 params] in
cpu_adam/optimizer.py) widens each param, steps it in float32 and stores it back by stochastic
rounding, with float32, bf16 or int8 moments (10, 6 or about 4 bytes a param with the param).

Two parts, both on the same params, grads and data:
- quality: a small regression (the test's), 300 steps at lr 1e-3, and the mean move of 8192 params
  at 1.0 under a constant gradient at lr 1e-4 for 100 steps (Adam's move is lr a step): float32
  with torch's AdamW as the reference, then bfloat16 with torch's AdamW (fused) and with ours;
- speed: one step over N params in T tensors, contenders interleaved in shuffled rounds
  (``bench_adam.measure``): ours with int8, bf16 and float32 moments, torch's AdamW fused and
  foreach over the same bf16 params and bf16 grads.

Usage: python tools/bench/bench_bf16_params.py [--shapes 1e7x1 1e6x10] [--rounds 20] [--out FILE]
Run under `flock /tmp/ofl-bench.lock` when other benchmarks share the machine.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402

from cpu_adam import CPUAdamW, default_num_threads  # noqa: E402
from offload.runtime.omp_wait import quiet_omp_waits  # noqa: E402
from tools.bench.bench_adam import _pct, _shape, _split, cpu_description, measure  # noqa: E402

# bytes a param of the optimizer's memory: the param and its moments (and int8's block scales)
STATE_BYTES = {"ours_int8": 2 + 2 + 8 / 256, "ours_bf16": 2 + 4, "ours_fp32": 2 + 8, "torch_fused": 2 + 4,
               "torch_foreach": 2 + 4}


def _optimizers(dtype: torch.dtype, sizes: list[int], make: Callable) -> Callable[[], None]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(k, generator=gen).to(dtype)) for k in sizes]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(dtype)
    opt = make(params)
    return opt.step


def contenders(n: int, tensors: int) -> dict[str, Callable[[], None]]:
    sizes = _split(n, tensors)
    bf16 = torch.bfloat16
    return {
        "ours_int8": _optimizers(bf16, sizes, lambda ps: CPUAdamW(ps, lr=1e-3, state_dtype="int8")),
        "ours_bf16": _optimizers(bf16, sizes, lambda ps: CPUAdamW(ps, lr=1e-3, state_dtype="bf16")),
        "ours_fp32": _optimizers(bf16, sizes, lambda ps: CPUAdamW(ps, lr=1e-3)),
        "torch_fused": _optimizers(bf16, sizes, lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)),
        "torch_foreach": _optimizers(bf16, sizes, lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True)),
    }


def regression_loss(dtype: torch.dtype, make: Callable) -> float:
    """The final loss of tests/cpu_adam/test_optimizer_bf16.py's regression, 300 steps."""
    gen = torch.Generator().manual_seed(0)
    x, w_true = torch.randn(512, 64, generator=gen), torch.randn(64, 32, generator=gen)
    y = torch.tanh(x @ w_true) + 0.05 * torch.randn(512, 32, generator=gen)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 32)).to(dtype)
    opt = make(model.parameters())
    for _ in range(300):
        loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


def small_update_move(dtype: torch.dtype, make: Callable, steps: int = 100) -> float:
    """How far the mean of 8192 params at 1.0 moves under a constant gradient at lr 1e-4."""
    p = torch.nn.Parameter(torch.ones(8192, dtype=dtype))
    opt = make([p], 1e-4)
    for _ in range(steps):
        p.grad = torch.ones_like(p)
        opt.step()
    return 1.0 - p.detach().float().mean().item()


def quality_rows() -> list[str]:
    runs = {
        "float32, torch AdamW": (torch.float32, lambda ps, lr=1e-3: torch.optim.AdamW(ps, lr=lr, weight_decay=0.01)),
        "bfloat16, torch AdamW (fused)": (torch.bfloat16, lambda ps, lr=1e-3: torch.optim.AdamW(
            ps, lr=lr, weight_decay=0.01, fused=True)),
        "bfloat16, ours int8": (torch.bfloat16, lambda ps, lr=1e-3: CPUAdamW(ps, lr=lr, weight_decay=0.01,
                                                                             state_dtype="int8")),
        "bfloat16, ours bf16": (torch.bfloat16, lambda ps, lr=1e-3: CPUAdamW(ps, lr=lr, weight_decay=0.01,
                                                                             state_dtype="bf16")),
        "bfloat16, ours fp32 moments": (torch.bfloat16, lambda ps, lr=1e-3: CPUAdamW(ps, lr=lr, weight_decay=0.01)),
    }
    rows = ["", "| run | regression loss, 300 steps | vs float32 | mean move at lr 1e-4, 100 steps (Adam: 0.0100) |",
            "| --- | --- | --- | --- |"]
    ref = None  # the first run's loss: the float32 model's
    for name, (dtype, make) in runs.items():
        loss = regression_loss(dtype, make)
        vs = "" if ref is None else f"{(loss / ref - 1) * 100:+.1f}%"
        ref = loss if ref is None else ref
        rows.append(f"| {name} | {loss:.4f} | {vs} | {small_update_move(dtype, make):.4f} |")
    return rows


def speed_rows(n: int, tensors: int, rounds: int) -> list[str]:
    samples = measure(contenders(n, tensors), rounds)
    case = f"{n:.0e} x {tensors} ({rounds} rounds)"
    rows = []
    for name, secs in samples.items():
        mps = [n / s / 1e6 for s in secs]
        rows.append(f"| {case} | {name} | {statistics.median(mps):,.0f} ({_pct(mps, 0.1):,.0f}-{_pct(mps, 0.9):,.0f}) "
                    f"| {STATE_BYTES[name]:.2f} | |")
    for ours in ("ours_int8", "ours_bf16", "ours_fp32"):
        for peer in ("torch_fused", "torch_foreach"):
            ratios = [p / o for o, p in zip(samples[ours], samples[peer])]  # speed: their time over ours
            rows.append(f"| {case} | {ours} / {peer} | | | **{statistics.median(ratios):.2f}x** "
                        f"({_pct(ratios, 0.1):.2f}-{_pct(ratios, 0.9):.2f}) |")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=["1e7x1", "1e6x10"], help="N params x T tensors")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=default_num_threads())
    ap.add_argument("--omp-waits", choices=("auto", "sleep", "spin"), default="auto",
                    help="torch's OpenMP waits, as in bench_adam.py: its workers spin after each op (libgomp's "
                         "default) on the cores our step needs next unless held asleep")
    ap.add_argument("--out", type=Path, help="also write the report (markdown) here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    team = quiet_omp_waits(mode=args.omp_waits)
    lines = [f"# bfloat16 params: CPUAdamW against torch's AdamW, {datetime.date.today():%Y-%m-%d}", "",
             f"- CPU: {cpu_description()}", f"- {args.threads} threads; torch {torch.__version__}",
             f"- torch's OpenMP waits: {args.omp_waits}" + (f" (helper team of {team})" if team else ""),
             f"- command: `{' '.join(['python tools/bench/bench_bf16_params.py', *sys.argv[1:]])}`",
             f"- load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}"]
    print("\n".join(lines), flush=True)
    part = quality_rows()
    print("\n".join(part), flush=True)
    lines += part
    part = ["", "Speed: Mparams/s median (p10-p90) over rounds; ratios are speed, the peer's time over ours, "
            "median (p10-p90) of the per-round ratios.", "",
            "| case | contender | Mparams/s | state bytes a param (param + moments) | ratio |",
            "| --- | --- | --- | --- | --- |"]
    for text in args.shapes:
        n, tensors = _shape(text)
        part += speed_rows(n, tensors, args.rounds)
    part += ["", f"- load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}"]
    print("\n".join(part), flush=True)
    lines += part
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
