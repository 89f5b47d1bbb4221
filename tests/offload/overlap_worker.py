"""One rank of the two-rank overlapped-step test (tests/offload/test_overlap.py), started by
torchrun; pytest does not collect it. For each ``stage:device:clip`` in argv it trains the
harness model on this rank's half of every global batch twice, with ``offload.overlap_step``
off and on (backward paused briefly before its last bucket, see PAUSE_SECONDS), and writes both runs' final params and the overlapped run's counters.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/offload/overlap_worker.py \
        OUT_DIR NVME_DIR STEPS GLOBAL_BATCH 1:cpu:0 2:nvme:6.5 ...
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from tests.offload.harness import engine_config, run_engine, twin_models
from tests.offload.ranks_worker import start_rank

PAUSE_SECONDS = 0.01
"""Backward of this tiny model takes microseconds, less than a gloo reduction; a pause before the
first layer's hooks lets the other buckets' reductions finish, and land, while backward runs."""


def main(out_dir: str, nvme_dir: str, steps: int, batch: int, runs: list[str]) -> None:
    rank, world, mine = start_rank(steps, batch)
    counters = {}
    for run in runs:
        stage, device, clip = run.split(":")
        for overlap in (False, True):
            model, _ = twin_models()
            for p in model.fc1.parameters():  # the last bucket: give the others' reductions time to finish
                p.register_post_accumulate_grad_hook(lambda _: time.sleep(PAUSE_SECONDS))
            config = engine_config(stage=int(stage), device=device, nvme_path=nvme_dir, batch_size=batch,
                                   world_size=world, gradient_clipping=float(clip), offload={"overlap_step": overlap})
            seen = {}

            def inspect(engine, step):
                seen["on"] = engine.overlap is not None
                if engine.overlap is not None:
                    seen.update(early=engine.overlap.early_sub_groups, rollbacks=engine.overlap.rollbacks)

            _, params = run_engine(model, config, mine, on_step=inspect)
            torch.save(params, os.path.join(out_dir, f"params_{run}_{overlap}_rank{rank}.pt"))
            if overlap:
                counters[run] = seen
    with open(os.path.join(out_dir, f"counters_rank{rank}.json"), "w") as f:
        json.dump(counters, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:])
