"""The delayed parameter update's effect on the loss curve: the demo GPT trained twice from the
same seed and data, ordinary steps against ``offload.delayed_update`` after a warm-up.

    .venv/bin/python tools/bench/bench_dpu_loss.py [--steps 200] [--warmup 20] [--device cpu] [--every 20] [--lr 3e-3]

Prints, every ``--every`` steps, the mean training loss of the last ``--every`` steps for both
runs and their difference, the held-out loss at the end of each, and the step rate of each
(on a CPU-only machine the model also computes on the CPU, so the overlap gains little here:
the step and forward/backward share the same cores).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import io  # noqa: E402

from rich.console import Console  # noqa: E402

from offload.cli.demo import DemoConfig, run_demo  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--device", default="cpu", choices=("cpu", "nvme"))
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--lr", type=float, default=DemoConfig().lr, help="peak learning rate (the demo's 3e-3)")
    args = ap.parse_args(argv)
    runs = {}
    for name, warmup in (("ordinary", None), ("delayed", args.warmup)):
        config = DemoConfig(steps=args.steps, offload_device=args.device, show_progress=False, lr=args.lr,
                            delayed_update_warmup_steps=warmup)
        runs[name] = run_demo(config, console=Console(file=io.StringIO()))  # no summary
    a, b = runs["ordinary"], runs["delayed"]
    print(f"demo GPT, {args.steps} steps, lr {args.lr:g}, offload_optimizer {args.device}; "
          f"delayed update after {args.warmup} steps\n")
    print(f"| steps | loss, ordinary | loss, delayed (warm-up {args.warmup}) | delayed - ordinary |")
    print("|---:|---:|---:|---:|")
    for end in range(args.every, args.steps + 1, args.every):
        x = sum(a.losses[end - args.every:end]) / args.every
        y = sum(b.losses[end - args.every:end]) / args.every
        print(f"| {end - args.every + 1}-{end} | {x:.4f} | {y:.4f} | {y - x:+.4f} |")
    print(f"| held-out, end | {a.val_loss_after:.4f} | {b.val_loss_after:.4f} | "
          f"{b.val_loss_after - a.val_loss_after:+.4f} |")
    print(f"| steps/s | {args.steps / a.train_seconds:.2f} | {args.steps / b.train_seconds:.2f} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
