"""HF rows of the step bench: Llama-shaped models at the sizes people offload (~8B, ~14B; the largest that
fits with --largest), as they bring them: bf16 safetensors (written here, tensor by tensor: no download),
loaded with ``from_pretrained`` (inside ``offload.init_context`` at stage 3), trained with gradient
checkpointing on sequences of --seq tokens, --micro-batch sequences a micro-batch, --accum micro-batches a
step; ours with the config ``offload estimate`` picks for this machine ([Note: the estimate's pick] in
step_hf_plan.py), against DeepSpeed's engine on the same checkpoint, batches and keys, configured to fit
the same machine ([Note: DeepSpeed's bytes]; its rows need ``import deepspeed``: skipped, saying why,
elsewhere).

Each contender runs in a child process of its own, one after the other (two models of these sizes do not
fit the host at once; a fresh process also gives each its own peak memory): it loads the checkpoint,
takes one warm-up step, then --steps measured steps (the same batches in the same order for both), and one
profiled step for the GPU's wait share when --budget-seconds leaves room. Reported per contender: the
median step time, tokens/s, achieved TFLOP/s (6 N + 12 L d T per token, N less the input embedding:
``model_flops_per_token``), the GPU wait share ([Note: GPU wait share] in step_gpu_plan.py), the peak host
memory (the child's VmHWM: pinned and pageable alike) and GPU memory (``max_memory_allocated``), the
load and set-up seconds, and each step's loss beside the other contender's.

    python3 tools/bench/step_hf.py --model 8b [--contenders ours ds] [--steps 3] [--out FILE]
    python3 tools/bench/step_hf.py --model 14b --contenders ours
    python3 tools/bench/step_hf.py --largest --steps 3          # the most layers at the 30b widths that fit
    python3 tools/bench/step_hf.py --largest --model tiny --max-layers 4 --device cpu   # its smoke run
    python3 tools/bench/step_hf.py --model tiny --device cpu    # the CPU smoke run (the tests')
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_hf_plan import CHOICES, SHAPES, choose, deepspeed_choice, engine_config, hf_config, model_flops_per_token  # noqa: E402
from step_hf_plan import params_of  # noqa: E402

GIB = 1 << 30
BY_CHOICE = {c.name: c for c in CHOICES}


# -- the child: one contender ------------------------------------------------------------------------

def _batches(a) -> list[list]:
    import torch

    g = torch.Generator().manual_seed(1)
    return [[torch.randint(0, a.vocab, (a.micro_batch, a.seq), generator=g) for _ in range(a.accum)]
            for _ in range(a.steps + 1)]


def _load_ours(a, device):
    import torch
    from transformers import AutoModelForCausalLM

    from offload import init_context, initialize

    config = engine_config(BY_CHOICE[a.choice], micro_batch=a.micro_batch, accum=a.accum, nvme_path=a.nvme_path)
    if a.from_config:  # --largest: no weights on disk, drawn as the engine partitions them
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(a.checkpoint, local_files_only=True)
        if config["zero_optimization"]["stage"] == 3:
            with init_context(config):
                model = AutoModelForCausalLM.from_config(hf)
        else:
            model = AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16)
    elif config["zero_optimization"]["stage"] == 3:
        with init_context(config):
            model = AutoModelForCausalLM.from_pretrained(a.checkpoint, local_files_only=True)
    else:
        model = AutoModelForCausalLM.from_pretrained(a.checkpoint, local_files_only=True, dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, _, _, _ = initialize(model=model, config=config)
    return engine, f"ours, {a.choice}: " + json.dumps(config["zero_optimization"]) + \
        "".join(f", {k} {json.dumps(config[k])}" for k in ("offload", "data_types") if k in config)


def _load_deepspeed(a, device):
    import torch
    from transformers import AutoModelForCausalLM

    from step_deepspeed import DeepSpeedRow, ds_config, one_rank_env

    base = engine_config(BY_CHOICE["z1-opt-cpu"], micro_batch=a.micro_batch, accum=a.accum, nvme_path=a.nvme_path)
    zero = json.loads(a.ds_zero)
    base["zero_optimization"] = {**base["zero_optimization"], **zero}
    base["zero_optimization"].pop("offload_param", None)
    ratio = zero["offload_optimizer"].get("ratio")
    cfg = ds_config(base, ratio=ratio)
    keep = None
    one_rank_env()  # zero.Init below joins the group of one
    if zero["stage"] == 3:  # from_pretrained builds under deepspeed.zero.Init while this object lives
        from transformers.integrations import HfDeepSpeedConfig

        keep = HfDeepSpeedConfig(cfg)
    model = AutoModelForCausalLM.from_pretrained(a.checkpoint, local_files_only=True, dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    row = DeepSpeedRow("ds", model, device, cfg)
    row.hf_config_ref = keep
    return row.engine, row.settings()


def child(a) -> dict:
    import torch

    from step_gpu_rows import sync_device

    from offload.runtime.host_heap import peak_resident_bytes

    torch.manual_seed(0)
    device = torch.device(a.device)
    t0 = time.perf_counter()
    engine, settings = (_load_deepspeed if a.contender == "ds" else _load_ours)(a, device)
    setup_s = time.perf_counter() - t0
    batches = _batches(a)

    def step(micro) -> tuple[float, float]:
        t = time.perf_counter()
        for ids in micro:
            ids = ids.to(device)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        sync_device(device)
        return time.perf_counter() - t, loss.item()

    started = time.perf_counter()
    times, losses = [], []
    warm_s, first = step(batches[0])
    for micro in batches[1:]:
        if a.budget_seconds and time.perf_counter() - started > a.budget_seconds - 2 * warm_s and times:
            break
        dt, loss = step(micro)
        times.append(dt)
        losses.append(loss)
    busy = None
    if device.type == "cuda" and (not a.budget_seconds or
                                  time.perf_counter() - started + 3 * statistics.median(times) < a.budget_seconds):
        from torch.profiler import ProfilerActivity, profile

        from step_gpu_plan import gpu_busy_seconds

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(batches[1])
        busy = gpu_busy_seconds(prof)
    out = {"contender": a.contender, "settings": settings, "setup_s": setup_s, "warm_s": warm_s, "first_loss": first,
           "times": times, "losses": losses, "busy": busy, "host_peak": peak_resident_bytes(),
           "gpu_peak": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
    close = getattr(engine, "close", None) or getattr(engine, "destroy", None)
    if close is not None:
        close()
    return out


# -- the driver ---------------------------------------------------------------------------------------

def _machine(a):
    from offload.plan.fit import machine_here

    return machine_here(host_gib=None, gpu_gib=None, nvme_gib=None, nvme_path=a.nvme_path, gpu=a.device == "cuda")


def _largest(a, machine) -> tuple[int, list[str]]:
    """The most layers (up to --max-layers) at --model's widths with which some choice fits, and the estimate's
    lines for one layer more: a binary search, since more layers need more of every memory."""
    base = SHAPES[a.model]

    def fit(n: int) -> tuple[bool, list[str]]:
        choice, tried = choose(dataclasses.replace(base, layers=n), micro_batch=a.micro_batch, seq=a.seq,
                               machine=machine, nvme_path=a.nvme_path, headroom=a.headroom)
        return choice is not None, tried

    if fit(a.max_layers)[0]:
        return a.max_layers, []
    lo, hi = 0, a.max_layers
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fit(mid)[0] else (lo, mid)
    return lo, fit(lo + 1)[1]


def _run_child(a, contender: str, extra: list[str], checkpoint: str, vocab: int, seconds: float | None) -> dict:
    """One contender in a child process; ``seconds``: its share of the budget (measuring stops early enough,
    and a child still running past it with a minute's grace is stopped and reported as out of time)."""
    argv = [sys.executable, __file__, "--child", contender, "--checkpoint", checkpoint, "--device", a.device,
            "--seq", str(a.seq), "--micro-batch", str(a.micro_batch), "--accum", str(a.accum),
            "--steps", str(a.steps), "--nvme-path", a.nvme_path, "--vocab", str(vocab), *extra]
    if seconds is not None:
        argv += ["--budget-seconds", str(seconds)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=None if seconds is None else seconds + 60)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return {"contender": contender, "failed": f"out of time after {seconds + 60:.0f} s: ...{out[-1000:]}"}
    tail = (proc.stdout + proc.stderr)[-3000:]
    if proc.returncode != 0:
        return {"contender": contender, "failed": f"exit {proc.returncode}: ...{tail}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def driver(a) -> int:
    t0 = time.perf_counter()
    machine = _machine(a)
    notes = [f"machine: {machine.describe()}"]
    if a.largest:  # no checkpoint: the model is built from its config (under init_context at stage 3)
        layers, tried = _largest(a, machine)
        if layers == 0:
            print(f"--largest: not even one layer at the {a.model} widths fits", flush=True)
            return 1
        notes.append(f"--largest: {layers} layers at the {a.model} widths fit, " + (
            "; ".join(["one more does not"] + tried) if tried else "the search's cap (--max-layers)"))
        SHAPES["largest"] = dataclasses.replace(SHAPES[a.model], layers=layers)
        a.model = "largest"
    shape = SHAPES[a.model]
    total, _ = params_of(shape)
    if not a.largest:  # the checkpoint takes its bf16 bytes of the disk the swap files would use
        machine = dataclasses.replace(machine, nvme_bytes=max(0, machine.nvme_bytes - 2 * total))
    choice, tried = choose(shape, micro_batch=a.micro_batch, seq=a.seq, machine=machine, nvme_path=a.nvme_path,
                           headroom=a.headroom)
    notes.append(f"offload estimate, {a.headroom:.0%} of each memory{'' if a.largest else ' (the disk less the checkpoint)'}"
                 ": " + "; ".join(tried))
    if a.choice:
        choice = BY_CHOICE[a.choice]
        notes.append(f"ours runs {a.choice}: --choice, not the estimate's pick")
    ds_zero, ds_why = deepspeed_choice(shape, micro_batch=a.micro_batch, seq=a.seq, machine=machine,
                                       headroom=a.headroom)
    if a.ds_zero:
        ds_zero, ds_why = json.loads(a.ds_zero), f"--ds-zero {a.ds_zero}, not the bench's pick"
    tokens = a.micro_batch * a.seq * a.accum
    flops = model_flops_per_token(shape, seq=a.seq) * tokens
    work = tempfile.mkdtemp(prefix="bench-step-hf-", dir=a.nvme_path)
    results, skipped = [], []

    def lines() -> list[str]:
        return report(a, shape, total, tokens, flops, notes, results, skipped)

    try:
        if choice is None and "ours" in a.contenders:
            skipped.append("ours (no row of the estimate fits)")
        from hf_checkpoint import write_random_checkpoint, write_config_only

        ckpt = os.path.join(work, "checkpoint")
        if a.largest:
            write_config_only(hf_config(shape, seq=a.seq), ckpt)
            notes.append("no checkpoint (--largest): the model built from its config.json, its weights drawn by "
                         "the engine as it partitions them")
        else:
            saved = write_random_checkpoint(hf_config(shape, seq=a.seq), ckpt, max_shard_size_bytes=2 * GIB)
            notes.append(f"checkpoint: {saved['params'] / 1e9:.2f}B params of bf16 safetensors written tensor by "
                         f"tensor in {saved['seconds']:.0f} s")
        runs = [c for c in a.contenders if c != "ours" or choice is not None]
        for i, contender in enumerate(runs):
            seconds = None
            if a.budget_seconds:
                seconds = (a.budget_seconds - (time.perf_counter() - t0)) / (len(runs) - i)
            if contender == "ours":
                results.append(_run_child(a, "ours", ["--choice", choice.name] + (["--from-config"] if a.largest else []),
                                          ckpt, shape.vocab, seconds))
            else:
                from step_deepspeed import available

                why = available() if ds_zero is not None else ds_why
                if why:
                    skipped.append(f"ds ({why})")
                    continue
                notes.append(f"DeepSpeed's config: {ds_why}")
                results.append(_run_child(a, "ds", ["--ds-zero", json.dumps(ds_zero)], ckpt, shape.vocab, seconds))
            print(json.dumps({k: v for k, v in results[-1].items() if k != "losses"})[:600], flush=True)
            if a.out:  # what was measured so far survives a stage stopped from outside
                with open(a.out, "w") as f:
                    f.write("\n".join(lines()) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    from step_common import publish

    publish(lines(), a.out)
    return 0 if results and not any("failed" in r for r in results) else 1


def report(a, shape, total, tokens, flops, notes, results, skipped) -> list[str]:
    import torch

    where = torch.cuda.get_device_name() if a.device == "cuda" else f"CPU only ({os.cpu_count()} CPUs)"
    lines = [f"# HF step bench: Llama {total / 1e9:.2f}B ({a.model}), bf16, {datetime.date.today().isoformat()}", "",
             f"- machine: {where}; torch {torch.__version__}; Python {platform.python_version()}; load average at the "
             f"end {os.getloadavg()[0]:.2f}",
             f"- command: `python3 tools/bench/step_hf.py {' '.join(sys.argv[1:])}`",
             f"- model: {shape.layers} layers, hidden {shape.hidden}, intermediate {shape.intermediate}, heads "
             f"{shape.heads} (kv {shape.kv_heads}), vocab {shape.vocab}, untied; gradient checkpointing; a step = "
             f"{a.accum} micro-batches of {a.micro_batch} x {a.seq} tokens ({tokens:,} tokens) + the optimizer step",
             f"- TFLOP/s: (6 N + 12 L d T) x tokens, N less the input embedding = {flops / 1e12:.1f} TFLOP a step",
             *[f"- {n}" for n in notes], "",
             "| contender | step s | tokens/s | TFLOP/s | GPU wait | host peak GiB | GPU peak GiB | set-up s | losses |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        if "failed" in r:
            lines.append(f"| {r['contender']} | failed: {r['failed'][-300:]!r} | | | | | | | |")
            continue
        med = statistics.median(r["times"])
        wait = "n/a" if r["busy"] is None else f"{max(0.0, 1 - r['busy'] / med):.1%}"
        gpu = "n/a" if r["gpu_peak"] is None else f"{r['gpu_peak'] / GIB:.1f}"
        lines.append(f"| {r['contender']} | {med:.3f} ({min(r['times']):.3f}-{max(r['times']):.3f}) | {tokens / med:,.0f} | "
                     f"{flops / med / 1e12:.1f} | {wait} | {r['host_peak'] / GIB:.1f} | {gpu} | {r['setup_s']:.0f} | "
                     f"{' '.join(f'{x:.4f}' for x in r['losses'])} |")
    lines += [""] + [f"- {r['contender']}: {r['settings']}" for r in results if "settings" in r]
    ok = [r for r in results if "failed" not in r]
    if len(ok) == 2:
        n = min(len(ok[0]["losses"]), len(ok[1]["losses"]))
        gap = max((abs(x - y) for x, y in zip(ok[0]["losses"][:n], ok[1]["losses"][:n])), default=float("nan"))
        rate = statistics.median(ok[1]["times"]) / statistics.median(ok[0]["times"])
        lines += ["", f"ours / DeepSpeed tokens/s: {rate:.2f}x (issue 39: >= 2x); largest |loss - DeepSpeed's| over "
                  f"{n} steps: {gap:.4f}"]
    if skipped:
        lines += ["", "Skipped: " + "; ".join(skipped)]
    return lines


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=list(SHAPES), default="8b")
    p.add_argument("--largest", action="store_true", help="the most layers at --model's widths that fit (--model "
                   "30b unless given)")
    p.add_argument("--max-layers", type=int, default=256, help="--largest: search up to this many layers")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--contenders", nargs="+", choices=("ours", "ds"), default=["ours", "ds"])
    p.add_argument("--seq", type=int, default=None, help="tokens a sequence (4096; 64 with --model tiny)")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences a micro-batch (2; 2 with tiny)")
    p.add_argument("--accum", type=int, default=None, help="micro-batches a step (8: 65,536 tokens; 2 with tiny)")
    p.add_argument("--steps", type=int, default=3, help="measured steps after the warm-up one")
    p.add_argument("--headroom", type=float, default=0.85, help="share of each memory the estimate plans for")
    p.add_argument("--nvme-path", default=tempfile.gettempdir(), help="checkpoint and swap files go under it")
    p.add_argument("--budget-seconds", type=float, default=None, help="stop measuring a contender past its share")
    p.add_argument("--out", default=None, help="write the markdown report here too")
    p.add_argument("--vocab", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--child", choices=("ours", "ds"), dest="contender", help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    p.add_argument("--from-config", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--choice", choices=list(BY_CHOICE), help="ours runs this row, not the estimate's pick")
    p.add_argument("--ds-zero", help="DeepSpeed's zero_optimization stage and offload_optimizer (JSON), not the "
                   "bench's pick")
    given = "--model" in (sys.argv[1:] if argv is None else argv)
    a = p.parse_args(argv)
    if a.largest and not given:
        a.model = "30b"
    tiny = a.model == "tiny"
    a.seq = a.seq or (64 if tiny else 4096)
    a.micro_batch = a.micro_batch or 2
    a.accum = a.accum or (2 if tiny else 8)
    return a


def main(argv=None) -> int:
    a = parse(argv)
    if a.contender:
        print(json.dumps(child(a)), flush=True)
        return 0
    return driver(a)


if __name__ == "__main__":
    sys.exit(main())
