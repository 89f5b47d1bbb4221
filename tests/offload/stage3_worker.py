"""A stage-3 training process for the tests (run alone or under torchrun; not collected).

usage: stage3_worker.py OPTIMIZER_DEVICE PARAM_DEVICE WORKDIR STEPS
Trains the tiny tied-embedding model on rank slices of one global batch; writes
WORKDIR/rank<r>.pt: the losses and the final (gathered) params.
"""
import os
import sys

import torch
import torch.distributed as dist

from offload.builder import initialize

GLOBAL_BATCH = 8
VOCAB, WIDTH, SEQ = 32, 24, 6


class Tiny(torch.nn.Module):
    """Token embedding tied to the output head, two MLP layers with a LayerNorm: a small GPT's shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.up = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.down = torch.nn.Linear(4 * WIDTH, WIDTH)
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.down(torch.nn.functional.gelu(self.up(h)))
        logits = self.head(self.norm(h))
        return torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return Tiny()


def batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
             torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)) for _ in range(n)]


def config(optimizer_device: str, param_device: str, workdir: str, **zero) -> dict:
    def where(device):
        return {"device": device, **({"nvme_path": workdir} if device == "nvme" else {})}

    return {"train_batch_size": GLOBAL_BATCH, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "offload_optimizer": where(optimizer_device),
                                  "offload_param": where(param_device), "sub_group_size": 512,
                                  "stage3_param_persistence_threshold": 100, **zero}}


def main() -> None:
    opt_device, param_device, workdir, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    net = model()
    engine, _, _, _ = initialize(model=net, config=config(opt_device, param_device, workdir))
    rank, world = engine.global_rank, engine.world_size
    per_rank = GLOBAL_BATCH // world
    losses = []
    for ids, targets in batches(steps):
        loss = engine(ids[rank * per_rank:(rank + 1) * per_rank], targets[rank * per_rank:(rank + 1) * per_rank])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with engine.stage3.coordinator.gathered():
        params = [p.detach().clone() for p in net.parameters()]
    torch.save({"losses": losses, "params": params}, os.path.join(workdir, f"rank{rank}.pt"))
    engine.close()
    if dist.is_initialized():  # gloo's threads joined before exit ([Note: world group lifetime])
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
