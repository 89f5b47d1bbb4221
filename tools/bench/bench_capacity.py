"""Capacity: train a GPT whose fp32 master weights and Adam moments alone exceed this machine's memory.

The model (offload.models.gpt.GPT on the shipped corpus's characters) is built under
``offload.init_context``: on the meta device, then put straight into its stage-3 partition
on NVMe one module at a time, so no process ever holds it whole. The optimizer state is on
NVMe too. It trains --steps steps on consecutive windows of the corpus.

Recorded: the model's size and the bytes its fp32 master + Adam moments need, set-up time,
per step its time, loss, time waiting on parameter fetches, the bytes the two tiers moved
(NVMe -> host and host -> NVMe), the process's resident memory (VmRSS now, VmHWM the peak,
from /proc/self/status) after set-up and after every step; then ``offload estimate``'s
prediction for the same model and config, against the measured peak.

Usage: python tools/bench/bench_capacity.py [--n-layer 30] [--n-embd 2560] [--n-head 20]
       [--seq 32] [--batch 1] [--steps 4] [--nvme-path /tmp] [--state-dtype int8] [--master-dtype bf16] [--bf16]
       [--gradient-tier auto|host|nvme] [--grad-accum-dtype fp32|bf16] [--json FILE] [--out FILE]
       python tools/bench/bench_capacity.py --report-from FILE.json --out FILE.md
       python tools/bench/bench_capacity.py --compare BASE.json NEW.json [--out FILE.md]
Run under `flock /tmp/ofl-bench.lock`; it takes minutes and tens of GB of swap under --nvme-path.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from offload import init_context, initialize  # noqa: E402
from offload.models.gpt import GPT, GPTConfig, init_module  # noqa: E402
from offload.models.text import CharTokenizer, load_corpus  # noqa: E402

GIB = 1 << 30


def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssShmem of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024
    return out


class GPT2Init:
    """GPT-2's init for a module's own params (the context's param_init_fn): N(0, 0.02) weights, the two
    projections into the residual stream N(0, 0.02 / sqrt(2 n_layer)), zero biases, unit norms. ``names``
    (module -> name) is filled once the model is built: the function is given before it exists."""

    def __init__(self, n_layer: int) -> None:
        self.residual_std = 0.02 / (2 * n_layer) ** 0.5
        self.names: dict[int, str] = {}

    def __call__(self, module: nn.Module) -> None:
        std = self.residual_std if self.names.get(id(module), "").endswith(".proj") else 0.02
        init_module(module, std)


def engine_config(args, nvme_path: str) -> dict:
    where = {"device": "nvme", "nvme_path": nvme_path}
    out = {
        "train_batch_size": args.batch, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "offload_optimizer": dict(where, buffer_count=4),
                              "offload_param": dict(where, buffer_count=5),
                              "stage3_max_live_parameters": args.max_live,
                              "stage3_max_reuse_distance": args.max_live,
                              "stage3_prefetch_bucket_size": args.prefetch}}
    if args.state_dtype != "fp32":
        out.setdefault("offload", {})["state_dtype"] = args.state_dtype
    if args.master_dtype != "fp32":
        out.setdefault("offload", {})["master_dtype"] = args.master_dtype
    if args.gradient_tier != "auto":
        out.setdefault("offload", {})["gradient_tier"] = args.gradient_tier
    if args.bf16:
        out["bf16"] = {"enabled": True}
    if args.grad_accum_dtype != "fp32":
        out["data_types"] = {"grad_accum_dtype": args.grad_accum_dtype}
    if args.huge_pages != "auto":
        out.setdefault("offload", {})["huge_pages"] = args.huge_pages
    return out


def _io(engine) -> tuple[int, int]:
    read = written = 0
    for tier in (engine.tier, engine.stage3.param_tier):
        if tier is not None:
            s = tier.store.stats()
            read, written = read + s.bytes_read_total, written + s.bytes_written_total
    return read, written


def run(args) -> dict:
    tok = CharTokenizer(load_corpus())
    ids = tok.encode(load_corpus())
    gcfg = GPTConfig(vocab_size=tok.vocab_size, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                     n_embd=args.n_embd, bias=True, tied_head=True)
    config = engine_config(args, args.nvme_path)
    base = proc_status()
    t0 = time.perf_counter()
    init = GPT2Init(args.n_layer)
    with init_context(config, param_init_fn=init):
        model = GPT(gcfg)
    init.names.update((id(m), name) for name, m in model.named_modules())
    n = sum(p.numel() for p in model.parameters())
    print(f"model: {n / 1e9:.3f} B params; fp32 master + Adam moments {12 * n / GIB:.1f} GiB", flush=True)
    engine, _, _, _ = initialize(model=model, config=config)
    setup_s = time.perf_counter() - t0
    after_setup = proc_status()
    grad_tier = "nvme" if engine.adam.storage.grads_tier is not None else "host"
    print(f"set-up {setup_s:.0f} s; VmHWM {after_setup['VmHWM'] / GIB:.2f} GiB; gradient accumulators: {grad_tier}",
          flush=True)
    steps = []
    span = args.batch * (args.seq + 1)
    try:
        for i in range(args.steps):
            at = 0 if args.same_batch else i * span
            chunk = ids[at:at + span].view(args.batch, args.seq + 1)
            r0, w0 = _io(engine)
            f0 = engine.stage3.coordinator.fetch_wait_seconds
            o0 = engine.offload_stats().io_wait_seconds_total
            t = time.perf_counter()
            loss = engine(chunk[:, :-1], chunk[:, 1:])
            engine.backward(loss)
            engine.step()
            dt = time.perf_counter() - t
            r1, w1 = _io(engine)
            status = proc_status()
            steps.append({"step": i + 1, "seconds": dt, "loss": loss.item(),
                          "fetch_wait_seconds": engine.stage3.coordinator.fetch_wait_seconds - f0,
                          "optimizer_io_wait_seconds": engine.offload_stats().io_wait_seconds_total - o0,
                          "bytes_read": r1 - r0, "bytes_written": w1 - w0, **status})
            print(f"step {i + 1}: loss {loss.item():.4f}, {dt:.1f} s, read {(r1 - r0) / 1e9:.1f} GB, "
                  f"written {(w1 - w0) / 1e9:.1f} GB, VmHWM {status['VmHWM'] / GIB:.2f} GiB", flush=True)
    finally:
        engine.close()
    return {"argv": sys.argv[1:], "when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "params": n, "same_batch": args.same_batch, "gpt": {"vocab_size": gcfg.vocab_size, "n_layer": gcfg.n_layer, "n_embd": gcfg.n_embd,
                                 "n_head": gcfg.n_head, "seq": args.seq, "batch": args.batch},
            "config": config, "gradient_tier": grad_tier, "setup_seconds": setup_s, "baseline": base, "after_setup": after_setup,
            "steps": steps, "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "baseline_rss_bytes": base["VmRSS"]}


def report(result: dict) -> str:
    from offload.plan.estimate import EstimateInput, estimate, gpt_shapes

    g = result["gpt"]
    shapes = gpt_shapes(vocab_size=g["vocab_size"], n_layer=g["n_layer"], n_embd=g["n_embd"], seq=g["seq"],
                        batch=g["batch"], tied_head=True)
    est = estimate(EstimateInput.from_config(result["config"], shapes, world_size=1,
                                             baseline_bytes=result["baseline_rss_bytes"]))
    row = est.row(stage=3, optimizer="nvme", param="nvme")
    peak = max(s["VmHWM"] for s in result["steps"]) if result["steps"] else result["after_setup"]["VmHWM"]
    n = result["params"]
    lines = [f"# Capacity: a {n / 1e9:.2f} B-parameter GPT trained with parameters and optimizer on NVMe "
             f"({platform.node() or 'vm'}, {os.cpu_count()} CPUs), {result['when']}", "",
             f"- command: `flock /tmp/ofl-bench.lock .venv/bin/python tools/bench/bench_capacity.py "
             f"{' '.join(result['argv'])}`",
             f"- model: GPT, {g['n_layer']} layers, width {g['n_embd']}, {g['n_head']} heads, vocabulary "
             f"{g['vocab_size']} (the corpus's characters), tied head; {n:,} parameters; built under "
             "`offload.init_context` (meta, then materialized module by module into NVMe shards)",
             f"- fp32 master + Adam moments: {12 * n / GIB:.1f} GiB; with the fp32 gradients and the fp32 "
             f"compute copy: {20 * n / GIB:.1f} GiB; machine memory: "
             f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GIB:.1f} GiB",
             f"- batch {g['batch']} x {g['seq']} tokens ("
             f"{'the same window every step' if result['same_batch'] else 'consecutive windows of the corpus'}), "
             f"{'bf16' if result['config'].get('bf16', {}).get('enabled') else 'fp32'} compute and param shards, "
             f"optimizer states {result['config'].get('offload', {}).get('state_dtype', 'fp32')} with a "
             f"{result['config'].get('offload', {}).get('master_dtype', 'fp32')} master, "
             f"AdamW lr {result['config']['optimizer']['params']['lr']}, gradient clipping 1.0",
             f"- gradient accumulators (offload.gradient_tier "
             f"{result['config'].get('offload', {}).get('gradient_tier', 'auto')}): {result.get('gradient_tier', 'host')}",
             f"- set-up (materialize + first NVMe writes): {result['setup_seconds']:.0f} s; "
             f"VmHWM after set-up {result['after_setup']['VmHWM'] / GIB:.2f} GiB", "",
             "| step | loss | step s | fetch wait s | optimizer I/O wait s | read GB | written GB | VmRSS GiB | VmHWM GiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in result["steps"]:
        lines.append(f"| {s['step']} | {s['loss']:.4f} | {s['seconds']:.1f} | {s['fetch_wait_seconds']:.1f} | "
                     f"{s['optimizer_io_wait_seconds']:.1f} | {s['bytes_read'] / 1e9:.1f} | "
                     f"{s['bytes_written'] / 1e9:.1f} | {s['VmRSS'] / GIB:.2f} | {s['VmHWM'] / GIB:.2f} |")
    predicted = row.device_bytes + row.host_bytes
    lines += ["", f"Peak resident memory (VmHWM): {peak / GIB:.2f} GiB; getrusage ru_maxrss "
                  f"{result['ru_maxrss_bytes'] / GIB:.2f} GiB; limit 16 GiB: "
                  f"{'met' if peak < 16 * GIB else 'NOT met'}.",
              f"Loss {'falls' if len(result['steps']) > 1 and result['steps'][-1]['loss'] < result['steps'][0]['loss'] else 'does not fall'}"
              f" over the steps.", "",
              f"`offload estimate` for the same model and config (stage 3, offload_param nvme, offload_optimizer nvme;"
              f" the device is the CPU here, so device + host is the process): device {row.device_bytes / GIB:.2f} GiB, "
              f"host {row.host_bytes / GIB:.2f} GiB, NVMe {row.nvme_bytes / GIB:.2f} GiB; predicted peak "
              f"{predicted / GIB:.2f} GiB against the measured {peak / GIB:.2f} GiB: "
              f"{100 * (predicted - peak) / peak:+.1f}%."]
    return "\n".join(lines) + "\n"


def _label(result: dict) -> str:
    c = result["config"]
    return (f"{'bf16' if c.get('bf16', {}).get('enabled') else 'fp32'} shards, "
            f"{c.get('offload', {}).get('state_dtype', 'fp32')} states, "
            f"{c.get('offload', {}).get('master_dtype', 'fp32')} master, "
            f"{c.get('data_types', {}).get('grad_accum_dtype', 'fp32')} gradients on "
            f"{result.get('gradient_tier', 'host')}, huge_pages {c.get('offload', {}).get('huge_pages', 'auto')}")


def compare(base: dict, new: dict) -> str:
    """Two runs of the same model (say fp32 states and shards, then int8 states and bf16 shards): the median
    step time after the first (which also records the fetch order) and the bytes each moved, as ratios."""
    def med(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2

    rows = []
    for r in (base, new):
        later = r["steps"][1:] or r["steps"]
        rows.append((_label(r), med([s["seconds"] for s in later]), med([s["bytes_read"] for s in later]),
                     med([s["bytes_written"] for s in later]), max(s["VmHWM"] for s in r["steps"]), r["when"],
                     r["setup_seconds"], r["steps"][0]["seconds"]))
    lines = [f"## {new['params'] / 1e9:.2f} B params: {rows[1][0]} against {rows[0][0]}", "",
             "| run | set-up s | step 1 s | step s (median of steps 2..) | read GB / step | written GB / step | "
             "VmHWM GiB | when |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {lab} | {su:.1f} | {s1:.1f} | {t:.1f} | {rd / 1e9:.1f} | {wr / 1e9:.1f} | {hwm / GIB:.2f} | {when} |"
              for lab, t, rd, wr, hwm, when, su, s1 in rows]
    (_, t0, r0, w0, _, _, su0, s10), (_, t1, r1, w1, _, _, su1, s11) = rows
    lines += ["", f"Step time {t1 / t0:.2f}x the first run's (step 1 {s11 / s10:.2f}x, set-up {su1 / su0:.2f}x); "
                  f"bytes read {r1 / r0:.2f}x, written {w1 / w0:.2f}x."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-layer", type=int, default=30)
    ap.add_argument("--n-embd", type=int, default=2560)
    ap.add_argument("--n-head", type=int, default=20)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--same-batch", action="store_true", help="every step on the corpus's first window (else the next ones)")
    ap.add_argument("--max-live", type=int, default=100_000_000, help="stage3_max_live_parameters and reuse distance")
    ap.add_argument("--prefetch", type=int, default=50_000_000, help="stage3_prefetch_bucket_size")
    ap.add_argument("--nvme-path", default="/tmp")
    ap.add_argument("--state-dtype", default="fp32", choices=("fp32", "bf16", "int8"), help="offload.state_dtype")
    ap.add_argument("--master-dtype", default="fp32", choices=("fp32", "bf16"), help="offload.master_dtype")
    ap.add_argument("--bf16", action="store_true", help="compute (and stage 3 param shards) in bf16")
    ap.add_argument("--gradient-tier", default="auto", choices=("auto", "host", "nvme"), help="offload.gradient_tier")
    ap.add_argument("--grad-accum-dtype", default="fp32", choices=("fp32", "bf16"), help="data_types.grad_accum_dtype")
    ap.add_argument("--huge-pages", default="auto", choices=("auto", "off"), help="offload.huge_pages")
    ap.add_argument("--json", help="write the measurements here")
    ap.add_argument("--report-from", help="only write the report, from a JSON this script wrote")
    ap.add_argument("--out", help="the Markdown report")
    ap.add_argument("--compare", nargs=2, metavar=("BASE.json", "NEW.json"),
                    help="only compare two runs this script wrote (step time and bytes per step, as ratios)")
    args = ap.parse_args(argv)
    if args.compare:
        text = compare(*(json.loads(Path(f).read_text()) for f in args.compare))
        print(text)
        if args.out:
            Path(args.out).write_text(text)
        return 0
    if args.report_from:
        result = json.loads(Path(args.report_from).read_text())
    else:
        torch.manual_seed(0)
        result = run(args)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    text = report(result)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
