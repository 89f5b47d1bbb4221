"""The peer's rows of the step benches: DeepSpeed's own engine (``deepspeed.initialize``) on the same
model, batches and config keys as ours, so the two are measured alternately in one run.

[Note: DeepSpeed at its best] What its docs and maintainers advise for ZeRO-Offload, all on:
- its CPU Adam (``DeepSpeedCPUAdam``, built by its JIT on first use): the config's optimizer "AdamW"
  with ``offload_optimizer`` cpu selects it (``adamw_mode``), as a user's config does;
- ``pin_memory: true`` in ``offload_optimizer`` and ``offload_param`` (page-locked buffers, so its
  copies to and from the GPU are asynchronous);
- its threads bound to the rank's cores: what ``deepspeed --bind_cores_to_rank`` does (numactl to
  the rank's share of the cores and ``OMP_NUM_THREADS`` set to their count; with one rank that is
  every core this process may run on), done here in the process: its CPU Adam is an OpenMP loop on
  the calling thread's team, which ``torch.set_num_threads`` sizes;
- ``overlap_comm`` and ``contiguous_gradients`` (its defaults for ZeRO-Offload in its tutorial);
- bf16 as ours computes in. With one rank, its process group is a group of one (NCCL on a GPU, gloo
  on the CPU, ``DS_ACCELERATOR=cpu``), made here since no launcher made one.
Its ``offload_optimizer.ratio`` (a GPU-resident share, stage 3 only) is set where a row asks for one.

The module imports nothing of DeepSpeed until a row is built: ``available()`` says whether it can be.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import torch

__all__ = ["DeepSpeedRow", "available", "ds_config", "one_rank_env"]


def available() -> str | None:
    """None when DeepSpeed imports in this interpreter; else why not (one line). Asked in a child process:
    a failed import can leave half a package in ``sys.modules``."""
    r = subprocess.run([sys.executable, "-c", "import deepspeed; print(deepspeed.__version__)"],
                       capture_output=True, text=True, timeout=300)
    if r.returncode == 0:
        return None
    return "deepspeed does not import: " + ((r.stderr.strip().splitlines() or ["?"])[-1])


def ds_config(ours: dict, *, ratio: float | None = None) -> dict:
    """DeepSpeed's config from the engine's (the same keys, read by both): the offload sections pinned,
    the overlap settings of its ZeRO-Offload tutorial, and none of the keys only ours reads."""
    cfg = {k: v for k, v in ours.items() if k not in ("offload", "data_types")}
    zero = dict(cfg["zero_optimization"])
    for key in ("offload_optimizer", "offload_param"):
        if key in zero and zero[key].get("device", "none") != "none":
            zero[key] = {**zero[key], "pin_memory": True}
    if ratio is not None:
        zero["offload_optimizer"] = {**zero["offload_optimizer"], "ratio": ratio}
    zero.update(overlap_comm=True, contiguous_gradients=True)
    cfg["zero_optimization"] = zero
    cfg["wall_clock_breakdown"] = False
    return cfg


def one_rank_env() -> None:
    """RANK and friends for a group of one (DeepSpeed would otherwise look for MPI)."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


def bind_threads() -> int:
    """Every core this process may run on to the OpenMP team its CPU Adam runs on ([Note: DeepSpeed at its best])."""
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    return cores


class DeepSpeedRow:
    """One DeepSpeed engine: ``engine(x, y)`` (the loss), ``engine.backward(loss)``, ``engine.step()`` per
    micro-batch, as a DeepSpeed script calls it."""

    def __init__(self, name: str, model: torch.nn.Module, device: torch.device, config: dict) -> None:
        import deepspeed

        self.name = name
        self.device = device
        self.cores = bind_threads()
        one_rank_env()
        if device.type == "cuda":
            torch.cuda.set_device(device.index or 0)
        self.config = config
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        self.version = deepspeed.__version__

    def step(self, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
        t0 = time.perf_counter()
        for x, y in micro:
            loss = self.engine(x, y)
            self.engine.backward(loss)
            self.engine.step()  # DeepSpeed steps the optimizer at the accumulation boundary
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0, loss.item()

    def settings(self) -> str:
        """What this row ran with, as DeepSpeed's engine parsed its config (not as the bench wrote it)."""
        e = self.engine
        parts = [f"DeepSpeed {self.version}", f"ZeRO stage {e.zero_optimization_stage()}"]
        for what, section in (("offload_optimizer", e.zero_offload_optimizer()), ("offload_param", e.zero_offload_param())):
            if section is not None and str(section.device) not in ("none", "OffloadDeviceEnum.none"):
                ratio = getattr(section, "ratio", 1.0)
                parts.append(f"{what} {getattr(section.device, 'value', section.device)}"
                             + (" pin_memory" if section.pin_memory else " unpinned")
                             + (f" ratio {ratio}" if ratio != 1.0 else ""))
        parts += [f"overlap_comm {e.zero_overlap_comm()}", f"contiguous_gradients {e.zero_contiguous_gradients()}",
                  f"bf16 {e.bfloat16_enabled()}", type(getattr(e, "basic_optimizer", None)).__name__,
                  f"{self.cores} OpenMP threads (--bind_cores_to_rank's binding for one rank)"]
        return ", ".join(parts)

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None and hasattr(engine, "destroy"):
            engine.destroy()
