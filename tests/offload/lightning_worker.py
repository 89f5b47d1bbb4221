"""Two Lightning fits on the CPU devices Lightning starts (not collected): plain DDP with torch's AdamW, then
OffloadStrategy at stage 3 with params and optimizer states on NVMe, the same module, data and seed.

usage: lightning_worker.py DEVICES WORKDIR
Lightning's launcher runs this script again for ranks 1..DEVICES-1; each rank writes WORKDIR/rank<r>.pt with
both fits' losses, LRs, gradient norms and final params.
"""
import os
import sys
import warnings

import torch
import torch.distributed as dist

from tests.offload.test_lightning import _fit, _stage3_nvme

ACCUMULATE = 2


def main() -> None:
    devices, workdir = int(sys.argv[1]), sys.argv[2]
    warnings.filterwarnings("ignore")
    kw = dict(devices=devices, batches=8, max_steps=4, accumulate=ACCUMULATE)
    plain = _fit("ddp", **kw)
    offload = _fit(_stage3_nvme(workdir), **kw)
    rank = dist.get_rank() if dist.is_initialized() else 0
    keep = ("losses", "lrs", "norms", "params", "global_step")
    torch.save({"plain": {k: plain[k] for k in keep}, "offload": {k: offload[k] for k in keep}},
               os.path.join(workdir, f"rank{rank}.pt"))
    if dist.is_initialized():  # gloo's threads joined before exit ([Note: world group lifetime] in offload.builder)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
