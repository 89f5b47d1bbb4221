"""A float64 reference of the Adam math the kernels implement (the oracle of the kernel tests)."""
from __future__ import annotations

import math

import torch


def reference_steps(p, m, v, grads, *, lr, beta1, beta2, eps, weight_decay, adamw_mode,
                    bias_correction, grad_scale=1.0, first_step=1):
    """Apply one step per gradient in ``grads`` to float64 copies; returns (p, m, v)."""
    p, m, v = p.double().clone(), m.double().clone(), v.double().clone()
    for k, grad in enumerate(grads):
        t = first_step + k
        g = grad.double() * grad_scale
        if adamw_mode:
            p = p * (1.0 - lr * weight_decay)
        else:
            g = g + weight_decay * p
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        bc1 = 1.0 - beta1**t if bias_correction else 1.0
        bc2 = 1.0 - beta2**t if bias_correction else 1.0
        p = p - (lr / bc1) * m / (v.sqrt() / math.sqrt(bc2) + eps)
    return p, m, v
