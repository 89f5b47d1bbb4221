"""A trainer for the resume tests (a script, alone or under torchrun; not collected by pytest).

usage: resume_worker.py DEVICE WORKDIR STEPS
Environment: FAULT=kill-forward|kill-step|sigterm-forward with FAULT_STEP and FAULT_RANK (first attempt
only), CKPT_EVERY=N (save a checkpoint every N steps, and load the latest at a fresh start; with
LOAD_AT_START=1 at every start, as a DeepSpeed script does, noting the step it starts at in
WORKDIR/started-rank<r>.txt), OVERLAP=1 (offload.overlap_step on). Kills inside
the step that a restart finishes (issue 18): kill-after-sub-group (as the second sub-group is fetched),
kill-in-evict (the first sub-group stepped, its write-back just queued: nvme), kill-in-publish (every sub-group stepped,
the params not yet gathered), kill-after-verdict (an overlapped step's record just written: WORKDIR/faulted-rank<r>
names its early sub-groups), kill-in-adam (inside the C pass of sub-group FAULT_SUB_GROUP: call FAULT_CALL, chunk
FAULT_CHUNK, halfway through the piece at or after FAULT_OFFSET), kill-before-allreduce / kill-after-allreduce (about
the gradient norm's all-reduce: the peers wait in it, or pass it and go on), kill-in-compressed-pass (sub-group
FAULT_SUB_GROUP's compressed state written, its pass not said done), kill-in-block-copy (halfway through the undo
copy of sub-group FAULT_SUB_GROUP's block; -1: the last), kill-before-close (after the last step, before
engine.close()). WIDTH and SUB_GROUP: see ckpt_worker. STATE_DTYPE: offload.state_dtype (bf16, int8);
MASTER_DTYPE: offload.master_dtype (bf16).
PAUSE=S with PAUSE_RANKS=r,...: those ranks wait before FAULT_STEP, on the attempt FAULT_RANK faults in, until
SIGTERM (then die) or S s.
NAN_STEP=N: rank 0's gradient is NaN at step N (the step is skipped). SLOW_BACKWARD=S: backward waits S seconds
before the first layer's gradients (the later layers' reductions finish meanwhile: an overlapped step steps
their sub-groups early, with two ranks too).
Each rank appends "step loss" lines to WORKDIR/losses-rank<r>.txt and writes WORKDIR/final-rank<r>.pt
(its params, the step it resumed at, and what offload_stats() returned at the end).
"""
import os
import signal
import sys
import threading
import time

import torch

from offload import StateTornError, initialize
from tests.offload import ckpt_worker
from tests.offload.ckpt_worker import final_params


def read_losses(workdir, rank: int, steps: int) -> list[float]:
    """The last loss a rank logged for each step (a resumed run logs some steps again)."""
    out = {}
    with open(os.path.join(workdir, f"losses-rank{rank}.txt")) as f:
        for line in f:
            step, loss = line.split()
            out[int(step)] = float(loss)
    return [out[s] for s in range(steps)]


STEP_FAULTS = ("kill-after-sub-group", "kill-in-evict", "kill-in-publish", "kill-in-adam", "kill-after-verdict",
               "kill-before-allreduce", "kill-after-allreduce", "kill-in-compressed-pass", "kill-in-block-copy")


def _die_inside_the_step(engine, fault: str) -> None:
    """SIGKILL this process at a moment of the next optimizer step ([Note: restartable step])."""
    storage, adam = engine.adam.storage, engine.adam

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    if fault == "kill-after-sub-group":
        acquire = storage.acquire
        storage.acquire = lambda sg: die() if sg == 1 else acquire(sg)
    elif fault == "kill-in-evict":
        done = engine.commit.sub_group_done

        def recorded(n):
            done(n)
            die()  # the first sub-group's write-back was just queued: in flight in the daemon
        engine.commit.sub_group_done = recorded
    elif fault == "kill-in-adam":  # the C pass kills itself halfway through a piece (its test hook)
        from cpu_adam.undo import arm_fault_for_tests

        acquire = storage.acquire
        target = int(os.environ.get("FAULT_SUB_GROUP", "0"))

        def arming(sg):
            if sg == target:
                arm_fault_for_tests(int(os.environ.get("FAULT_CALL", "0")), int(os.environ.get("FAULT_CHUNK", "0")),
                                    int(os.environ.get("FAULT_OFFSET", "0")))
            return acquire(sg)
        storage.acquire = arming
    elif fault == "kill-in-compressed-pass":  # the block written, its pass not yet said done ([Note: block undo])
        step_compressed = adam._step_compressed
        target = int(os.environ.get("FAULT_SUB_GROUP", "0"))

        def written(sg, *args, **kwargs):
            step_compressed(sg, *args, **kwargs)
            if sg.index == target:
                die()
        adam._step_compressed = written
    elif fault == "kill-in-block-copy":  # halfway through the undo copy of the block (FAULT_SUB_GROUP -1: the last)
        undo = adam.undo
        target = int(os.environ.get("FAULT_SUB_GROUP", "0")) % len(engine.layout.sub_groups)
        save = undo.save

        def half_copied(sg, state):
            if sg == target:
                data = state.reshape(-1).view(torch.uint8)
                undo._bytes[:data.numel() // 2].copy_(data[:data.numel() // 2])
                die()
            save(sg, state)
        undo.save = half_copied
    elif fault == "kill-after-verdict":  # an overlapped step's record written, its early sub-groups named
        begin = engine.commit.begin_recorded_step
        workdir = sys.argv[2]

        def recorded(record):
            begin(record)
            with open(os.path.join(workdir, f"faulted-rank{engine.global_rank}"), "w") as f:
                f.write(" ".join(map(str, record.get("early", ()))))
            die()  # nvme: before the early blocks are marked dirty
        engine.commit.begin_recorded_step = recorded
    elif fault in ("kill-before-allreduce", "kill-after-allreduce"):  # [Note: pending step]
        global_sumsq = adam.global_sumsq

        def reduced():
            if fault == "kill-before-allreduce":
                die()  # its record written all but the multiplier; the peers wait in the all-reduce
            total = global_sumsq()
            die()  # its peers have the same result and go on: they step, and may commit
        adam.global_sumsq = reduced
    else:
        adam.publish = die


def main() -> int:
    device, workdir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    config = ckpt_worker.config(device, workdir, stage=int(os.environ.get("STAGE", "2")))
    config["offload"] = {"job_id": os.environ.get("JOB_ID", "resume-test")}
    if not os.environ.get("OFFLOAD_DAEMON_SOCKET"):
        config.pop("offload")
    if os.environ.get("STATE_DTYPE"):  # offload.state_dtype: bf16 or int8 moments
        config.setdefault("offload", {})["state_dtype"] = os.environ["STATE_DTYPE"]
    if os.environ.get("MASTER_DTYPE"):  # offload.master_dtype: bf16, stochastically rounded
        config.setdefault("offload", {})["master_dtype"] = os.environ["MASTER_DTYPE"]
    if os.environ.get("GRADIENT_TIER"):  # offload.gradient_tier: nvme puts stage 3's accumulators on NVMe
        config.setdefault("offload", {})["gradient_tier"] = os.environ["GRADIENT_TIER"]
    if os.environ.get("OVERLAP"):  # offload.overlap_step: a kill-step fault then dies under backward
        config.setdefault("offload", {})["overlap_step"] = True
        config["gradient_clipping"] = 0.0  # this model's norms clip: no sub-group would be stepped early
    net = ckpt_worker.model()
    slow = float(os.environ.get("SLOW_BACKWARD", "0"))
    if slow:
        net[0].register_full_backward_pre_hook(lambda module, grad_output: time.sleep(slow))
    try:
        engine, _, _, _ = initialize(model=net, config=config)
    except StateTornError as exc:
        print(f"TORN: {exc}", file=sys.stderr, flush=True)
        return 3
    rank, world = engine.global_rank, engine.world_size
    ckpt_dir = os.path.join(workdir, "ckpt")
    every = int(os.environ.get("CKPT_EVERY", "0"))
    deepspeed_shaped = bool(os.environ.get("LOAD_AT_START"))  # loads whenever a checkpoint exists
    if (engine.resumed_step is None or deepspeed_shaped) and every and os.path.exists(os.path.join(ckpt_dir, "latest")):
        engine.load_checkpoint(ckpt_dir)
        with open(os.path.join(workdir, f"started-rank{engine.global_rank}.txt"), "a") as f:
            f.write(f"{engine.global_steps}\n")
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and not os.path.exists(
        os.path.join(workdir, f"faulted-rank{rank}"))
    fault = os.environ.get("FAULT", "") if first_attempt and rank == int(os.environ.get("FAULT_RANK", "0")) else ""
    fault_step = int(os.environ.get("FAULT_STEP", "20"))
    # PAUSE=S with PAUSE_RANKS=r,..: until FAULT_RANK has faulted, those ranks wait up to S s before FAULT_STEP,
    # healthy, until their agent stops them for the next round (SIGTERM): torchrun then restarts them without
    # counting a restart on their node, as it does ranks busy in a long forward when another node lost one
    pause = 0.0 if os.path.exists(os.path.join(workdir, f"faulted-rank{os.environ.get('FAULT_RANK', '0')}")) or \
        str(rank) not in os.environ.get("PAUSE_RANKS", "").split(",") else float(os.environ.get("PAUSE", "0"))
    per_rank = ckpt_worker.GLOBAL_BATCH // world
    data = ckpt_worker.batches(steps)
    start = engine.client_state.get("next_step", 0)
    with open(os.path.join(workdir, f"losses-rank{rank}.txt"), "a") as log:
        for step in range(start, steps):
            if pause and step == fault_step:
                deadline = time.monotonic() + pause
                while not engine.stop_requested and time.monotonic() < deadline:
                    time.sleep(0.05)
                if engine.stop_requested:  # stopped for the restart: end as the lost rank did
                    os.kill(os.getpid(), signal.SIGKILL)
            if fault and step == fault_step:
                open(os.path.join(workdir, f"faulted-rank{rank}"), "w").close()
                if fault == "kill-forward":
                    os.kill(os.getpid(), signal.SIGKILL)
                if fault == "sigterm-forward":
                    os.kill(os.getpid(), signal.SIGTERM)
                if fault == "kill-step":  # die after the first sub-group of this step is written
                    step_sub_group = engine.adam._step_sub_group

                    def dying(*args, **kwargs):
                        step_sub_group(*args, **kwargs)
                        with open(os.path.join(workdir, f"faulted-rank{rank}"), "w") as f:
                            f.write(threading.current_thread().name)  # an overlapped step's worker, or main
                        os.kill(os.getpid(), signal.SIGKILL)
                    engine.adam._step_sub_group = dying
                    if engine.overlap is not None:  # hold backward open: the early step's kill lands under it
                        backward_done = engine.overlap.backward_done

                        def held_open():
                            time.sleep(60)
                            backward_done()
                        engine.overlap.backward_done = held_open
                if fault in STEP_FAULTS:
                    _die_inside_the_step(engine, fault)
            x, y = data[step]
            x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
            loss = torch.nn.functional.mse_loss(engine(x), y)
            nan = step == int(os.environ.get("NAN_STEP", "-1")) and rank == 0  # a step skipped on overflow
            engine.backward(loss * float("nan") if nan else loss)
            engine.client_state["next_step"] = step + 1
            log.write(f"{step} {loss.item()!r}\n")
            log.flush()
            engine.step()
            if every and (step + 1) % every == 0:
                engine.save_checkpoint(ckpt_dir)
    engine.adam.storage.drain()  # the last step's evicts: nothing moves after this (close reports it too)
    stats = engine.offload_stats()
    torch.save({"params": final_params(engine, net), "resumed_step": engine.resumed_step,
                "grads_on_nvme": engine.adam.storage.grads_tier is not None,
                "global_steps": engine.global_steps, "bytes_read_total": stats.bytes_read_total,
                "bytes_written_total": stats.bytes_written_total, "optimizer_steps": stats.optimizer_steps,
                "skipped_steps": stats.skipped_steps, "reports": engine.reporter.reports if engine.reporter else 0},
               os.path.join(workdir, f"final-rank{rank}.pt"))
    if fault == "kill-before-close":  # its last step committed; its peers close (and would drop their sessions)
        os.kill(os.getpid(), signal.SIGKILL)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
