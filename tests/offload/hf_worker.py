"""A Hugging Face model trained by the engine, for the tests (run under torchrun; not collected).

usage: hf_worker.py KIND DEVICE WORKDIR STEPS [STAGE [BUILD]]
At stage 3 (the default) builds KIND under init_context and loads WORKDIR/ckpt (safetensors the test saved)
with load_pretrained (BUILD from_config, the default) or with from_pretrained inside the context (BUILD
from_pretrained); at stages 0-2 loads it with plain from_pretrained. Then trains on rank slices of one global batch, generates greedily from a fixed prompt, saves the model back
to WORKDIR/out with save_16bit_model; writes WORKDIR/rank<r>.pt: losses, the gathered params, the tokens.
"""
import contextlib
import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from offload import init_context, initialize, load_pretrained
from tests.offload import hf_models as hf


def main() -> None:
    kind, device, workdir, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    stage = int(sys.argv[5]) if len(sys.argv) > 5 else 3
    build = sys.argv[6] if len(sys.argv) > 6 else "from_config"
    config = hf.engine_config(stage, device, workdir)
    cls, model_config = hf.BUILDERS[kind]
    ckpt = os.path.join(workdir, "ckpt")
    if stage < 3:
        net = cls.from_pretrained(ckpt).train()
    elif build == "from_pretrained":
        with init_context(config):
            net = AutoModelForCausalLM.from_pretrained(ckpt).train()
    else:
        with init_context(config):
            net = cls(model_config())
        load_pretrained(net, ckpt)
    engine, _, _, _ = initialize(model=net, config=config)
    rank = engine.global_rank
    losses = hf.train_own_slices(engine, steps)
    net.eval()
    tokens = net.generate(hf.batches(1, seed=9)[0][:1, :4], max_new_tokens=5, do_sample=False)
    engine.save_16bit_model(os.path.join(workdir, "out"))
    with engine.stage3.coordinator.gathered() if stage == 3 else contextlib.nullcontext():
        params = {n: p.detach().clone() for n, p in net.named_parameters()}
    torch.save({"losses": losses, "params": params, "tokens": tokens}, os.path.join(workdir, f"rank{rank}.pt"))
    engine.close()
    if dist.is_initialized():  # gloo's threads joined before exit ([Note: world group lifetime])
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
