"""Trains a one-block GPT (width 1536, ~28M parameters) on the CPU, stage 1 with the optimizer in
host memory, and prints one JSON line: VmRSS after every optimizer step (not collected).

usage: heap_worker.py STEPS RELEASE_HOST_HEAP(0|1)
"""
import json
import sys

import torch

from offload import initialize
from offload.models.gpt import GPT, GPTConfig

VOCAB, SEQ, BATCH = 64, 16, 2


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise KeyError("VmRSS")


def main() -> None:
    steps, release = int(sys.argv[1]), sys.argv[2] == "1"
    cfg = {"train_batch_size": BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
           "offload": {"release_host_heap": release}}
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=1, n_head=4, n_embd=1536))
    engine, _, _, _ = initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(0)
    rss = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        engine.backward(engine(ids[:, :-1], ids[:, 1:]))
        engine.step()
        rss.append(rss_bytes())
    engine.close()
    print(json.dumps({"rss": rss}))


if __name__ == "__main__":
    main()
