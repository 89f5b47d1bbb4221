"""AdamPlan: a checked address table of params and their Adam state, stepped many times.

``adam_step`` checks every tensor it is handed on every call (see [Note: checks per
tensor] in ``cpu_adam.kernels``). A plan checks its tensors once, when it is built, and
each ``step`` then checks only what it is handed anew: the gradients, unless they too
were bound to the plan. With everything bound (the engine's flat sub-group buffers,
stepped once per training step) a step is one C call and a few microseconds of Python.

The plan holds references to every tensor it was built over, so their memory lives as
long as it does. Those tensors must keep their storage: a tensor that is resized or
pointed elsewhere (``set_``, ``.data =``) needs a new plan. ``matches`` tells whether a
list of params is still the one a plan describes; ``CPUAdam`` rebuilds its plans when
it is not, and whenever it loads a state dict.
"""
from __future__ import annotations

import array
import logging
import operator
from typing import Sequence

import torch

from csrc import ConfigError
from cpu_adam.kernels import (
    AdamConfig,
    Isa,
    address_array,
    build_tensors,
    call_adam,
    call_sumsq,
    checked_addresses,
    dtype_code,
    explain,
    lib,
)

logger = logging.getLogger(__name__)

__all__ = ["AdamPlan"]

_DATA_PTR = torch.Tensor.data_ptr
_CONTIGUOUS = torch.Tensor.is_contiguous


class AdamPlan:
    """Params, their Adam state and optionally their gradients and param copies, checked once.

    ``params``, ``exp_avgs``, ``exp_avg_sqs``, ``steps`` as for ``adam_step``. ``grads``:
    gradient buffers to bind (their contents change between steps, their storage does
    not); a step may still pass other gradients. ``params_out``: bfloat16/float16/float32
    tensors that receive the updated params at every step.
    """

    def __init__(self, params: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
                 exp_avg_sqs: Sequence[torch.Tensor], steps: Sequence[torch.Tensor], *,
                 grads: Sequence[torch.Tensor] | None = None,
                 params_out: Sequence[torch.Tensor] | None = None) -> None:
        n = len(params)
        named = {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "steps": steps}
        if grads is not None:
            named["grads"] = grads
        if params_out is not None:
            named["params_out"] = params_out
        for what, seq in named.items():
            if len(seq) != n:
                raise ConfigError(f"{what} has {len(seq)} tensors, params has {n}")
        f32 = torch.float32
        self._numel_list = [p.numel() for p in params]
        numels = self._numel_list
        self._params = list(params)
        # Every tensor whose address is in a table is kept here, so its memory stays alive.
        self._keep = (self._params, list(exp_avgs), list(exp_avg_sqs), list(steps),
                      list(grads or []), list(params_out or []))
        self._param_addrs = address_array(params, "params", f32, None)
        self._param_ptr_list = list(self._param_addrs)
        self._state_addrs = [
            address_array(exp_avgs, "exp_avgs", f32, numels),
            address_array(exp_avg_sqs, "exp_avg_sqs", f32, numels),
            address_array(steps, "steps", f32, [1] * n),
        ]
        self._numels = array.array("q", numels)
        self._out_code = lib.OFL_DTYPE_NONE
        self._outs = None
        if params_out is not None and n:
            self._out_code = dtype_code(params_out, "params_out")
            self._outs = address_array(params_out, "params_out", params_out[0].dtype, numels)
        self._bound = None  # (grad dtype code, grad addresses, the C struct over them)
        if grads is not None and n:
            code = dtype_code(grads, "grads")
            addrs = address_array(grads, "grads", grads[0].dtype, numels)
            self._bound = (code, addrs, self._tensors(addrs))

    def _tensors(self, grad_addrs: array.array) -> tuple:
        p, (m, v, s) = self._param_addrs, self._state_addrs
        return build_tensors([p, grad_addrs, m, v, s], self._outs, self._numels)

    def __len__(self) -> int:
        return len(self._params)

    def matches(self, params: Sequence[torch.Tensor]) -> bool:
        """True if ``params`` are this table's tensors, unmoved and contiguous."""
        mine = self._params
        return (len(params) == len(mine) and all(map(operator.is_, params, mine))
                and all(map(_CONTIGUOUS, params)) and list(map(_DATA_PTR, params)) == self._param_ptr_list)

    def step(self, grads: Sequence[torch.Tensor] | None = None, *, config: AdamConfig,
             grad_scale: float = 1.0) -> bool:
        """One Adam step of every param of the table; True if a scaled gradient was not finite.

        ``grads``: this step's gradients, checked now; None: the gradients bound to the plan.
        """
        n = len(self._params)
        if grads is None:
            if self._bound is None:
                if n == 0:
                    return False
                raise ConfigError("this plan has no gradients bound: pass grads to step()")
            code, _, tensors = self._bound
            return call_adam(config, grad_scale, code, self._out_code, tensors)
        if len(grads) != n:
            raise ConfigError(f"grads has {len(grads)} tensors, the plan has {n} params")
        if n == 0:
            return False
        code = dtype_code(grads, "grads")
        addrs = checked_addresses(grads, grads[0].dtype, self._numel_list)
        if addrs is None:
            explain(grads, "grads", grads[0].dtype, self._numel_list)
            raise ConfigError("a gradient failed the argument checks")  # not reached
        return call_adam(config, grad_scale, code, self._out_code, self._tensors(array.array("Q", addrs)))

    def grad_sumsq(self, *, num_threads: int | None = None, isa: Isa | str | None = None) -> float:
        """Sum of squares (in double) of the bound gradients, as ``cpu_adam.grad_sumsq``."""
        if self._bound is None:
            if not self._params:
                return 0.0
            raise ConfigError("this plan has no gradients bound: use cpu_adam.grad_sumsq(grads)")
        code, addrs, _ = self._bound
        return call_sumsq(addrs, self._numels, code, num_threads=num_threads, isa=isa)
