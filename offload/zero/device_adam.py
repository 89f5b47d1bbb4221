"""The optimizer's steps on the model's device: torch's fused Adam over state kept there (``offload_optimizer``
none, or the share ``ratio`` keeps: [Note: GPU-resident share] in offload.zero.device_share), and the sum of
squares of gradients landed there, kept on the device until the step reads it."""
from __future__ import annotations

import torch
from torch.optim.adam import adam as functional_adam  # torch.optim does not expose its submodules as attributes

from cpu_adam import AdamConfig

__all__ = ["device_sumsq", "torch_adam"]


def device_sumsq(t: torch.Tensor, chunk: int = 1 << 24) -> torch.Tensor:
    """The sum of squares of a device tensor in float64, as a device scalar (no wait), 16M elements at a time."""
    return sum(t[i:i + chunk].double().square().sum() for i in range(0, t.numel(), chunk))


def torch_adam(masters, grads, ms, vs, outs, hyper: AdamConfig, mult: float, step_count: int) -> None:
    """Adam over state on the device: torch's fused Adam, then the params into ``outs`` (on the device, or, for
    stage 3's kept share with its shards on the host, copied there)."""
    device = masters[0].device
    steps = [torch.full((1,), float(step_count), device=device) for _ in masters]
    torch._foreach_mul_(grads, mult)
    functional_adam(masters, grads, ms, vs, [], steps, fused=True, amsgrad=False, beta1=hyper.beta1,
                    beta2=hyper.beta2, lr=hyper.lr, weight_decay=hyper.weight_decay, eps=hyper.eps,
                    maximize=False, decoupled_weight_decay=hyper.adamw_mode)
    if all(o.device == device for o in outs):
        torch._foreach_copy_(outs, masters)
    else:
        for out, master in zip(outs, masters):
            out.copy_(master)
