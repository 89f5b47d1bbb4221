"""A training process for the checkpoint tests (run as a script, alone or under torchrun; not collected).

usage: ckpt_worker.py MODE DEVICE WORKDIR STEPS_FROM STEPS_TO
  MODE "run": train steps [from, to) from a fresh engine (saving at `to` if SAVE is set),
  MODE "resume": load WORKDIR/ckpt first, then train [from, to).
Writes WORKDIR/<mode>-rank<r>.pt: the losses and the final params.
"""
import contextlib
import os
import sys

import torch
import torch.distributed as dist

from offload.builder import initialize

GLOBAL_BATCH = 8


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    width = int(os.environ.get("WIDTH", "48"))  # wider: sub-groups of several 65536-element chunks
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.LayerNorm(width), torch.nn.GELU(),
                               torch.nn.Dropout(float(os.environ.get("DROPOUT", "0.1"))), torch.nn.Linear(width, 4))


def batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)) for _ in range(n)]


def config(device: str, workdir: str, stage: int) -> dict:
    offload = {"device": device}
    if device == "nvme":
        offload["nvme_path"] = workdir
    zero = {}
    if stage == 3 and os.environ.get("PARAM_DEVICE"):  # stage 3's param shards offloaded too
        zero["offload_param"] = {"device": os.environ["PARAM_DEVICE"]}
    return {"train_batch_size": GLOBAL_BATCH, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 3e-3,
                                                              "total_num_steps": 60}},
            "zero_optimization": {"stage": stage, "offload_optimizer": offload, "sub_group_size": int(os.environ.get("SUB_GROUP", "256")),
                                  "reduce_bucket_size": 500, **zero}}


def final_params(engine, net) -> list[torch.Tensor]:
    """The model's params as values (stage 3: gathered; a released one is empty outside forward)."""
    with engine.stage3.coordinator.gathered() if engine.stage3 is not None else contextlib.nullcontext():
        return [p.detach().clone() for p in net.parameters()]


def main() -> None:
    mode, device, workdir, start, stop = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    stage = int(os.environ.get("STAGE", "2"))
    net = model()
    engine, _, _, _ = initialize(model=net, config=config(device, workdir, stage))
    rank, world = engine.global_rank, engine.world_size
    if mode == "resume":
        _, client = engine.load_checkpoint(os.path.join(workdir, "ckpt"))
        assert client["next_step"] == start, client
    per_rank = GLOBAL_BATCH // world
    losses = []
    for x, y in batches(stop)[start:stop]:
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if os.environ.get("SAVE"):
        engine.save_checkpoint(os.path.join(workdir, "ckpt"), client_state={"next_step": stop})
    torch.save({"losses": losses, "params": final_params(engine, net),
                "lr": engine.get_lr(), "steps": engine.global_steps},
               os.path.join(workdir, f"{mode}-rank{rank}.pt"))
    engine.close()
    if dist.is_initialized():  # gloo's threads joined before exit ([Note: world group lifetime])
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
