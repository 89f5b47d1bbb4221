"""One rank of the two-rank test (tests/offload/test_ranks.py), started by torchrun; pytest does
not collect it. For each (stage, device) in argv it trains the harness model with the engine
on this rank's half of every global batch, then writes the global loss of every step (the
mean of the ranks' losses, as each half is the same size), the gradient norm before
clipping (global: the same on every rank), the layout's sizes, and this rank's final params.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/offload/ranks_worker.py \
        OUT_DIR NVME_DIR STEPS GLOBAL_BATCH GRADIENT_CLIPPING 1:cpu 2:nvme 2:cpu:gloo 2:cpu:gas2 ...

A run is STAGE:DEVICE[:gloo][:gas2][:half]: "gloo" turns offload.node_shared_buffers off (the process
group's collectives), "gas2" splits each rank's half-batch into two micro-batches, "half" keeps half of the
optimizer state on the device (offload_optimizer.ratio 0.5).
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from offload.builder import init_distributed
from tests.offload.harness import engine_config, make_batches, run_engine, twin_models


def start_rank(steps: int, batch: int) -> tuple[int, int, list]:
    """Join the process group; this rank's number, the world size, and its half of every global batch."""
    torch.set_num_threads(1)
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    half = batch // world
    return rank, world, [(x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half])
                         for x, y in make_batches(steps, batch)]


def main(out_dir: str, nvme_dir: str, steps: int, batch: int, clip: float, runs: list[str]) -> None:
    rank, world, mine = start_rank(steps, batch)
    results = {}
    for run in runs:
        stage, device, *opts = run.split(":")  # opts: "gloo" (no node-shared buffers), "gas2", "half"
        gas = 2 if "gas2" in opts else 1
        model, _ = twin_models()
        config = engine_config(stage=int(stage), device=device, nvme_path=nvme_dir, batch_size=batch // gas,
                               world_size=world, gradient_clipping=clip, gas=gas,
                               offload={"node_shared_buffers": "gloo" not in opts})
        if "half" in opts:  # half of the optimizer kept on the (here: the CPU) device ([Note: GPU-resident share])
            config["zero_optimization"]["offload_optimizer"]["ratio"] = 0.5
        layout = {}
        norms = []

        def inspect(engine, step):
            norms.append(engine.get_global_grad_norm())
            layout.update(node_shared=engine.reducer._node is not None, kept=len(engine.adam.storage.on_device))
            layout.update(world_size=engine.layout.world_size, total_numel=engine.layout.total_numel,
                          partition_numel=engine.layout.partition_numel, engine_world_size=engine.world_size)

        losses, params = run_engine(model, config, mine, gas=gas, on_step=inspect)
        total = torch.tensor(losses, dtype=torch.float64)
        dist.all_reduce(total)
        results[run] = {"losses": (total / world).tolist(), "norms": norms, "layout": layout}
        torch.save(params, os.path.join(out_dir, f"params_{run.replace(':', '_')}_rank{rank}.pt"))
    if rank == 0:
        with open(os.path.join(out_dir, "losses.json"), "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), sys.argv[6:])
