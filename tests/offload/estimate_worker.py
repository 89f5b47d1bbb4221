"""A stage-3 GPT run whose peak resident memory the estimate tests compare with (not collected).

usage: estimate_worker.py OPTIMIZER_DEVICE PARAM_DEVICE WORKDIR N_LAYER N_EMBD
Prints one JSON line: the engine config, VmRSS before the model was built (the baseline) and
VmHWM after two training steps.
"""
import json
import sys

import torch

from offload import init_context, initialize
from offload.models.gpt import GPT, GPTConfig

VOCAB, SEQ, BATCH = 64, 16, 2


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def config(opt_device: str, param_device: str, workdir: str) -> dict:
    def where(device):
        return {"device": device, **({"nvme_path": workdir} if device == "nvme" else {})}

    return {"train_batch_size": BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 3, "offload_optimizer": where(opt_device),
                                  "offload_param": where(param_device)}}


def main() -> None:
    opt_device, param_device, workdir, n_layer, n_embd = sys.argv[1:4] + [int(a) for a in sys.argv[4:6]]
    cfg = config(opt_device, param_device, workdir)
    baseline = status("VmRSS")
    with init_context(cfg):
        model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=n_layer, n_head=4, n_embd=n_embd))
    engine, _, _, _ = initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        loss = engine(ids[:, :-1], ids[:, 1:])
        engine.backward(loss)
        engine.step()
    peak = status("VmHWM")
    engine.close()
    print(json.dumps({"config": cfg, "baseline": baseline, "peak": peak}))


if __name__ == "__main__":
    main()
