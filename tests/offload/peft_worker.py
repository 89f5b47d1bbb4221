"""A LoRA model trained by the engine on two ranks, for tests/offload/test_peft.py (run under torchrun; not
collected).

usage: peft_worker.py WORKDIR STEPS
Stage 3, params and optimizer on NVMe under WORKDIR, every param partitioned: trains on rank halves of one
global batch, saves the adapters (WORKDIR/adapter) and a checkpoint (WORKDIR/ckpt); writes WORKDIR/rank<r>.pt:
the losses and the gathered params.
"""
import os
import sys
import warnings

import torch

from offload import initialize
from offload.integrations.peft import save_adapter
from tests.offload import hf_models as hf
from tests.offload.test_peft import config, lora_model


def main() -> None:
    warnings.filterwarnings("ignore")
    workdir, steps = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    net = lora_model()
    engine, _, _, _ = initialize(model=net, config=config(3, "nvme", workdir))
    rank = engine.global_rank
    losses = hf.train_own_slices(engine, steps)
    save_adapter(engine, os.path.join(workdir, "adapter"))
    engine.save_checkpoint(os.path.join(workdir, "ckpt"))
    with engine.stage3.coordinator.gathered():
        params = {n: p.detach().clone() for n, p in net.named_parameters()}
    engine.close()
    torch.save({"losses": losses, "params": params}, os.path.join(workdir, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
