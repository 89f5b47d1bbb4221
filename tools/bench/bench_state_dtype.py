"""Quality of compressed Adam states: a GPT trained with offload.state_dtype fp32, bf16, int8 (and a bf16 master).

Each run is ``offload demo``'s model and data (offload.cli.demo.run_demo: the char-level GPT on the
shipped corpus, AdamW with warm-up and clipping, 300 steps by default) with the optimizer state
offloaded to the tier (``--device cpu`` or nvme), the same seed for all; only
``offload.state_dtype`` differs. Reported: the final held-out loss of each and its ratio to
fp32's, against the issue's targets (int8 within 1%, bf16 within 0.5%), and the training-loss
curves (text plots, and the per-step losses of each in the results file).

``--model 100m`` trains a ~100M-parameter GPT instead (12 layers, width 768, 12 heads, context 128,
2 windows a step, peak LR 6e-4 after 50 warm-up steps), on the same corpus: issue 21's second
quality run, 500 steps or more.

The runs are sequential, in the order given, each after the same warm-up; the load average is
printed beside each. Usage:
  python tools/bench/bench_state_dtype.py [--steps 300] [--model demo|100m] [--device cpu]
      [--dtypes fp32 bf16 int8 fp32/bf16 int8/bf16] [--out FILE]
("X/bf16": state dtype X with bf16 gradient accumulators, data_types.grad_accum_dtype; "X/A/bf16": state
dtype X, accumulators A and a bf16 master, offload.master_dtype; each's target is X's.)
Run under `flock /tmp/ofl-bench.lock` when other benchmarks share the machine.
"""
from __future__ import annotations

import argparse
import datetime
import io
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from rich.console import Console  # noqa: E402

from offload.cli.demo import DemoConfig, run_demo  # noqa: E402
from offload.cli.termplot import plot_lines  # noqa: E402

TARGETS = {"bf16": 0.005, "int8": 0.01}
MODELS = {
    "demo": {},  # offload demo's own
    "100m": {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 128, "micro_batch": 2, "lr": 6e-4,
             "warmup_steps": 50},
}


def run(state_dtype: str, steps: int, device: str, seed: int, model: str = "demo") -> dict:
    """``state_dtype``: offload.state_dtype, "<it>/<accumulators>" with data_types.grad_accum_dtype, and
    "<it>/<accumulators>/<master>" with offload.master_dtype too."""
    t0 = time.perf_counter()
    quiet = Console(file=io.StringIO())
    states, accum, master = (state_dtype.split("/") + ["fp32", "fp32"])[:3]
    result = run_demo(DemoConfig(steps=steps, offload_device=device, state_dtype=states, seed=seed,
                                 grad_accum_dtype=accum, master_dtype=master, show_progress=False,
                                 **MODELS[model]),
                      console=quiet)
    return {"losses": result.losses, "val": result.val_loss_after, "val_before": result.val_loss_before,
            "seconds": time.perf_counter() - t0, "load": os.getloadavg()[0], "params": result.num_parameters}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--model", choices=tuple(MODELS), default="demo")
    ap.add_argument("--device", choices=("cpu", "nvme"), default="cpu")
    ap.add_argument("--dtypes", nargs="*", default=["fp32", "bf16", "int8"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    lines = [f"# Adam state dtypes: {args.model} GPT quality, {datetime.date.today():%Y-%m-%d}", "",
             f"- command: `{' '.join(['python tools/bench/bench_state_dtype.py', *sys.argv[1:]])}`",
             f"- load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", ""]
    print("\n".join(lines), flush=True)
    results = {}
    for sd in args.dtypes:
        results[sd] = r = run(sd, args.steps, args.device, args.seed, args.model)
        print(f"{sd}: held-out loss {r['val']:.4f} (before {r['val_before']:.4f}), {r['seconds']:.0f} s, "
              f"load {r['load']:.2f}", flush=True)
    base = results.get("fp32")
    table = ["| state dtype | held-out loss | vs fp32 | target | last train loss | seconds | load |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for sd, r in results.items():
        rel = (r["val"] / base["val"] - 1.0) if base else float("nan")
        want = TARGETS.get(sd.partition("/")[0])
        verdict = "" if want is None else f"within {want:.1%}: {'met' if abs(rel) <= want else '**not met**'}"
        table.append(f"| {sd} | {r['val']:.4f} | {rel:+.2%} | {verdict} | {r['losses'][-1]:.4f} | "
                     f"{r['seconds']:.0f} | {r['load']:.2f} |")
    plots = []
    for sd, r in results.items():
        plots += ["", f"{sd} training loss, {len(r['losses'])} steps:", "```",
                  *plot_lines(r["losses"], width=60, height=5), "```"]
    curves = ["", "Per-step training losses (every 10th):", ""]
    for sd, r in results.items():
        curves.append(f"- {sd}: " + " ".join(f"{x:.3f}" for x in r["losses"][::10]))
    shape = ", ".join(f"{k} {v}" for k, v in MODELS[args.model].items()) or "offload demo's defaults"
    tail = [f"", f"- model: {next(iter(results.values()))['params']:,} parameters ({shape}); optimizer state on "
            f"{args.device}",
            f"- load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}"]
    report = table + plots + curves + tail
    print("\n".join(report), flush=True)
    if args.out:
        args.out.write_text("\n".join(lines + report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
