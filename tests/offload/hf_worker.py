"""A Hugging Face model trained by the engine, for the tests (run under torchrun; not collected).

usage: hf_worker.py KIND DEVICE WORKDIR STEPS
Builds KIND under init_context, loads WORKDIR/ckpt (safetensors the test saved) with load_pretrained,
trains on rank slices of one global batch, generates greedily from a fixed prompt, saves the model back
to WORKDIR/out with save_16bit_model; writes WORKDIR/rank<r>.pt: losses, the gathered params, the tokens.
"""
import os
import sys

import torch
import torch.distributed as dist

from offload import init_context, initialize, load_pretrained
from tests.offload import hf_models as hf


def main() -> None:
    kind, device, workdir, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    config = hf.engine_config(3, device, workdir)
    cls, model_config = hf.BUILDERS[kind]
    with init_context(config):
        net = cls(model_config())
    load_pretrained(net, os.path.join(workdir, "ckpt"))
    engine, _, _, _ = initialize(model=net, config=config)
    rank, world = engine.global_rank, engine.world_size
    per_rank = hf.BATCH // world
    losses = []
    for ids in hf.batches(steps):
        mine = ids[rank * per_rank:(rank + 1) * per_rank]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    net.eval()
    tokens = net.generate(hf.batches(1, seed=9)[0][:1, :4], max_new_tokens=5, do_sample=False)
    engine.save_16bit_model(os.path.join(workdir, "out"))
    with engine.stage3.coordinator.gathered():
        params = {n: p.detach().clone() for n, p in net.named_parameters()}
    torch.save({"losses": losses, "params": params, "tokens": tokens}, os.path.join(workdir, f"rank{rank}.pt"))
    engine.close()
    if dist.is_initialized():  # gloo's threads joined before exit ([Note: world group lifetime])
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
