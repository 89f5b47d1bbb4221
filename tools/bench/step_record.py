"""bench_step's restartable-step rows (issue 18): what the step record costs, and how long a resume takes.

``python tools/bench/bench_step.py --record`` (or this script alone) starts a real daemon
(``step_ranks._start_daemon``) and builds the ~100M GPT of bench_step four times (same seed),
each an engine through the daemon with its own job: two on cpu, two on nvme. In each round one
engine of a pair steps recorded (``Engine.record_steps``, the default: [Note: restartable step]
in offload.checkpoint.resume) and the other without the record (the step as before issue 18: torn if cut
short), and they swap from round to round: an engine's own speed (where its memory landed, say:
in one run one of two engines doing the same work was 7% slower in forward and backward, which the
record does not touch) then weighs on both modes alike instead of passing for the record's cost.
In every round each engine runs
``--steps-per-round`` steps on the same batches, in an order that rotates from round to round;
the first of them (the switch of mode included) is not measured. Reported: the median step and
optimizer step per device and mode, and the median over rounds of the paired ratio recorded /
unrecorded in the same round.

Then the resume: the recorded nvme engine is cut inside a step (after its first sub-group is
stepped, by an exception where a kill would land) and detached, as a killed rank leaves its
session; a fresh ``offload.initialize`` finishes that step from the record; the recorded cpu
engine is detached between steps and resumed. Their ``initialize`` wall times are reported.

Alone: python tools/bench/step_record.py [--rounds 3] [--steps-per-round 3] [--state-dtype fp32|bf16|int8] [--out FILE]
"""
from __future__ import annotations

import argparse
import copy
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))
from machine import cpu_description as _cpu_model  # noqa: E402
from step_common import (GPT, EngineContender, _fmt, _load, engine_config, model_and_batches,  # noqa: E402
                         model_arguments, parse_step_args, publish, rotating_rounds)
from step_ranks import SEGMENT_BYTES, _start_daemon  # noqa: E402

from offload.builder import initialize  # noqa: E402


class _Cut(Exception):
    """Raised where a kill inside the step would land."""


def _contender(name: str, base: GPT, device: str, socket: str, workdir: str, state_dtype: str) -> EngineContender:
    config = engine_config(device, 2, workdir, 4)
    config["offload"].update(daemon_socket=socket, job_id=name.replace(" ", "-").replace(",", ""),
                             state_dtype=state_dtype)
    if device == "nvme":  # a window of 8 blocks beside the grads (else sized from the pool, shared by four)
        n_params = sum(p.numel() for p in base.parameters())
        config["offload"]["host_memory_bytes"] = 4 * n_params + 8 * 12 * (4 << 20) + (64 << 20)
    c = EngineContender(name, copy.deepcopy(base), config)
    c.config, c.base = config, base
    return c


def _record_seconds(engine, repeats: int = 200) -> float:
    """The record's own work per step, timed alone on a live engine: the small state, its pickle into
    the region before the all-reduce, the multiplier after it, and one start and one done per
    sub-group; the engine's commit is rewritten after."""
    n = len(engine.layout.sub_groups)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.commit.begin_pending_step({"small": engine.small_state(), "step_count": engine.adam.step_count,
                                          "hypers": {}})
        engine.commit.record_multiplier(1.0)
        for i in range(n):
            engine.commit.sub_group_started(i)
            engine.commit.sub_group_done(i + 1)
        times.append(time.perf_counter() - t0)
    engine.commit.commit(engine.global_steps, engine.small_state())
    return statistics.median(times)


def _resume_seconds(c: EngineContender, batch: torch.Tensor, *, cut: bool) -> tuple[float, int | None]:
    """Detach ``c``'s engine (inside a step with ``cut``), then time a fresh initialize on its session."""
    engine = c.engine
    if cut:
        done = engine.commit.sub_group_done

        def cut_after_first(n: int) -> None:
            done(n)
            raise _Cut
        engine.commit.sub_group_done = cut_after_first
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        try:
            engine.step()
        except _Cut:
            pass
    engine.close(keep_session=True)
    gc.collect()
    model = copy.deepcopy(c.base)
    t0 = time.perf_counter()
    c.engine, _, _, _ = initialize(model=model, config=c.config)
    return time.perf_counter() - t0, c.engine.resumed_step


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps-per-round", type=int, default=3, help="the first of them is not measured")
    model_arguments(ap)
    ap.add_argument("--nvme-path", default=None, help="directory for the daemon's swap (default: a temporary one)")
    ap.add_argument("--state-dtype", choices=("fp32", "bf16", "int8"), default="fp32",
                    help="offload.state_dtype of every engine (bf16, int8: the record's undo copy of each block)")
    ap.add_argument("--out", default=None, help="write the markdown report here too")
    args = parse_step_args(ap, argv)
    base, data = model_and_batches(args)
    n_params = sum(p.numel() for p in base.parameters())
    workdir = tempfile.mkdtemp(prefix="bench-record-", dir=args.nvme_path)
    # two cpu engines hold their whole state and grads in the pool, two nvme engines their grads and window
    need = 2 * 20 * n_params + 2 * (4 * n_params + 8 * 12 * (4 << 20))
    pool = (need // SEGMENT_BYTES + 5) * SEGMENT_BYTES  # whole segments, 4 spare for the packing
    daemon, socket = _start_daemon(workdir, pool_bytes=pool, swap_bytes=4 * 12 * n_params, checksum=True, inflight=0)
    contenders: list[EngineContender] = []
    try:
        for device in ("cpu", "nvme"):
            for twin in "AB":
                contenders.append(_contender(f"{device} {twin}", base, device, socket, workdir, args.state_dtype))
        print(f"{n_params / 1e6:.1f}M params; engines: {', '.join(c.name for c in contenders)}", flush=True)
        modes = [f"{device}, {mode}" for device in ("cpu", "nvme") for mode in ("recorded", "unrecorded")]
        samples = {m: {"step": [], "opt": []} for m in modes}
        paired: dict[str, list[float]] = {"cpu": [], "nvme": []}
        for c in contenders:  # warm-up: first step allocates, first NVMe read
            c.step(data[0][:, :-1], data[0][:, 1:])
        by_round: list[dict[str, list[float]]] = [{} for _ in range(args.rounds)]
        for r, c, s, batch in rotating_rounds(contenders, args.rounds, args.steps_per_round, data):
            c.engine.record_steps = (r + contenders.index(c)) % 2 == 0  # the twins swap modes every round
            mode = f"{c.name.split()[0]}, {'recorded' if c.engine.record_steps else 'unrecorded'}"
            step, opt, _, _ = c.step(batch[:, :-1], batch[:, 1:])
            if s:  # the first of a run is not measured
                samples[mode]["step"].append(step)
                samples[mode]["opt"].append(opt)
                by_round[r].setdefault(mode, []).append(step)
        for c in contenders:
            c.engine.record_steps = True
        for device in paired:
            paired[device] = [statistics.median(steps[f"{device}, recorded"])
                              / statistics.median(steps[f"{device}, unrecorded"]) for steps in by_round]
        record_s = _record_seconds(contenders[0].engine)
        sub_groups = len(contenders[0].engine.layout.sub_groups)
        finish_s, finish_step = _resume_seconds(contenders[2], data[0], cut=True)
        resume_s, resume_step = _resume_seconds(contenders[0], data[0], cut=False)
    finally:
        for c in contenders:
            c.close()
        daemon.terminate()
        daemon.wait(60)
        shutil.rmtree(workdir, ignore_errors=True)

    lines = [
        f"# Restartable step bench: ~100M GPT through the daemon, {datetime.date.today().isoformat()}",
        "",
        f"- machine: {_cpu_model()} ({os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads); torch "
        f"{torch.__version__}; Python {platform.python_version()}; load average at the end {_load()}",
        f"- command: `{' '.join(['python', 'tools/bench/bench_step.py', '--record'] + argv)}`",
        f"- model: GPT, {n_params / 1e6:.1f}M params, fp32, {args.state_dtype} Adam states, batch {args.batch} x seq "
        f"{args.seq}; ZeRO stage 1 on "
        "one rank; every contender an engine through one daemon (its own job)",
        f"- {args.rounds} rounds x {len(contenders)} engines x {args.steps_per_round} steps (first not measured), "
        "rotating order; the two engines of a device swap recorded and unrecorded every round; medians (min-max) "
        "over measured steps; recorded / unrecorded: median over rounds of the paired ratio of the round's "
        "median steps",
        "",
        "| device, mode | step s | opt s |",
        "| --- | --- | --- |",
    ]
    for m in modes:
        lines.append(f"| {m} | {_fmt(samples[m]['step'])} | {_fmt(samples[m]['opt'], digits=3)} |")
    lines += ["", "Step with the record / without, paired: " + ", ".join(f"{d} **{_fmt(v, digits=3)}x**"
                                                                        for d, v in paired.items()), "",
              f"The record's own work, timed alone (median of 200): {record_s * 1e6:.0f} us per step ({sub_groups} "
              f"sub-groups), {record_s / statistics.median(samples['cpu, recorded']['opt']):.2%} of the cpu "
              "recorded median optimizer step.", "",
              f"Resume through the daemon: nvme cut inside a step (after its first sub-group) and finished by "
              f"initialize in {finish_s:.2f} s (resumed at step {finish_step}); cpu detached between steps and "
              f"resumed in {resume_s:.2f} s (step {resume_step})."]
    publish(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
