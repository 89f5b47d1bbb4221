"""CPUAdam: a ``torch.optim.Optimizer`` whose step is one SIMD C call per param group.

State per param is what torch's Adam/AdamW keep (``step`` as a float32 scalar tensor,
``exp_avg``, ``exp_avg_sq``), and each group stores torch's own
``decoupled_weight_decay`` key, so a state dict moves both ways between this and
``torch.optim.AdamW`` / ``torch.optim.Adam`` where the semantics agree. What torch has
and this does not (AMSGrad, maximize) is an error, never ignored.
"""
from __future__ import annotations

import itertools
import logging
import operator
from typing import Any, Callable, Iterable

import torch

from csrc import ConfigError
from cpu_adam.kernels import AdamConfig, Isa, adam_step, resolve_isa
from cpu_adam.plan import AdamPlan
from cpu_adam.quant import StateDtype, dequantize, quantize, zeros_moments
from cpu_adam.state_memory import zeros_state_like

logger = logging.getLogger(__name__)

__all__ = ["CPUAdam", "CPUAdamW"]

_GRAD = operator.attrgetter("grad")
_NONES = itertools.repeat(None)

_UNSUPPORTED = {
    "amsgrad": "AMSGrad is not implemented by CPUAdam; use torch.optim.AdamW(amsgrad=True)",
    "maximize": "maximize=True is not implemented by CPUAdam; negate the loss instead",
}


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW over float32 CPU params, all tensors of a group in one multithreaded SIMD call.

    ``adamw_mode=True`` (the default) decays weights decoupled, as AdamW; False adds
    ``weight_decay * p`` to the gradient, as Adam. ``num_threads`` defaults to the cores
    this process may use; ``isa`` forces a path ("scalar", "avx2", "avx512", "avx512_bf16").
    ``state_dtype`` stores the moments as "fp32" (torch's state, bit for bit), "bf16" or "int8"
    (uint8 codes in ``exp_avg``/``exp_avg_sq`` and block scales in ``exp_avg_scale``/
    ``exp_avg_sq_scale``; see ``cpu_adam.quant``); a loaded state of another kind is converted.

    Each group's params and state are held in an ``AdamPlan`` (their addresses, checked
    once), so a step costs a C call plus a check of the new gradients. The state tensors
    belong to the optimizer: replace them through ``load_state_dict``, not by hand.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        amsgrad: bool = False,
        *,
        num_threads: int | None = None,
        isa: Isa | str | None = None,
        state_dtype: StateDtype | str = "fp32",
    ) -> None:
        if amsgrad:
            raise ConfigError(_UNSUPPORTED["amsgrad"])
        self._isa = resolve_isa(isa)
        self._num_threads = num_threads
        self._state_dtype = StateDtype.parse(state_dtype)
        self._plans: dict[int, AdamPlan] = {}  # group index -> checked address table
        self._configs: dict[int, tuple[tuple, AdamConfig]] = {}  # group index -> (its values, their config)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            decoupled_weight_decay=bool(adamw_mode),
            bias_correction=bool(bias_correction),
            amsgrad=False,
            maximize=False,
        )
        self._group_config(defaults)  # validates the defaults before torch stores them
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if "adamw_mode" in param_group:  # our constructor's name for torch's key
            param_group = dict(param_group)
            param_group["decoupled_weight_decay"] = bool(param_group.pop("adamw_mode"))
        super().add_param_group(param_group)
        self._plans = {}

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()  # torch keeps only defaults, state and groups
        state.update(_isa=self._isa, _num_threads=self._num_threads, _state_dtype=self._state_dtype)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if not hasattr(self, "_state_dtype"):  # pickled before the option (load_state_dict keeps ours)
            self._state_dtype = StateDtype.FP32
        self._plans = {}  # the state tensors may be new
        self._configs = {}
        for group in self.param_groups:
            group.setdefault("decoupled_weight_decay", True)
            group.setdefault("bias_correction", True)
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            for p in group["params"]:
                st = self.state.get(p)
                if st and not (torch.is_tensor(st["step"]) and st["step"].dtype == torch.float32
                               and st["step"].device.type == "cpu"):
                    st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for i, group in enumerate(state_dict["param_groups"]):
            for key, why in _UNSUPPORTED.items():
                if group.get(key):
                    raise ConfigError(f"param group {i} of the state has {key}=True: {why}")
        super().load_state_dict(state_dict)
        for st in self.state.values():  # torch casts every state tensor to the param's dtype
            if "exp_avg" in st:
                _convert_moments(st, self._state_dtype)

    def _cached_config(self, index: int, group: dict[str, Any]) -> AdamConfig:
        """The group's config, made anew only when a value changed (a scheduler moves lr)."""
        key = (group["lr"], group["betas"], group["eps"], group["weight_decay"],
               group["decoupled_weight_decay"], group["bias_correction"], group["amsgrad"], group["maximize"])
        cached = self._configs.get(index)
        if cached is not None and cached[0] == key:
            return cached[1]
        config = self._group_config(group)
        self._configs[index] = (key, config)
        return config

    def _group_config(self, group: dict[str, Any]) -> AdamConfig:
        for key, why in _UNSUPPORTED.items():
            if group.get(key):
                raise ConfigError(why)
        beta1, beta2 = group["betas"]
        return AdamConfig(
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            adamw_mode=bool(group["decoupled_weight_decay"]),
            bias_correction=bool(group["bias_correction"]),
            num_threads=self._num_threads,
            isa=self._isa,
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            params = group["params"]
            grads = list(map(_GRAD, params))
            if any(map(operator.is_, grads, _NONES)):
                params = [p for p, g in zip(params, grads) if g is not None]
                grads = [g for g in grads if g is not None]
            if not params:
                continue
            config = self._cached_config(index, group)
            if self._state_dtype is not StateDtype.FP32:
                self._step_compressed(params, grads, config)
                continue
            plan = self._plans.get(index)
            if plan is None or not plan.matches(params):
                plan = self._plans[index] = self._make_plan(params)
            plan.step(grads, config=config)
        return loss

    def _step_compressed(self, params: list[torch.Tensor], grads: list[torch.Tensor], config: AdamConfig) -> None:
        """One call over bf16 or int8 moments (no plan: the call checks every tensor)."""
        self._check_params(params)
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state.update(zip(_MOMENT_KEYS, zeros_moments(p.shape, self._state_dtype)))
        states = [self.state[p] for p in params]
        q8 = self._state_dtype is StateDtype.INT8
        adam_step(params, grads, [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states],
                  [st["step"] for st in states], config=config,
                  exp_avg_scales=[st["exp_avg_scale"] for st in states] if q8 else None,
                  exp_avg_sq_scales=[st["exp_avg_sq_scale"] for st in states] if q8 else None)

    def _check_params(self, params: list[torch.Tensor]) -> None:
        for p in params:
            if p.grad.is_sparse:
                raise ConfigError("CPUAdam does not support sparse gradients")
            if p.dtype != torch.float32:
                raise ConfigError(f"CPUAdam updates float32 params; got a {p.dtype} param of "
                                  f"shape {tuple(p.shape)} (keep a float32 master copy)")

    def _make_plan(self, params: list[torch.Tensor]) -> AdamPlan:
        """Create missing state and the checked address table of ``params``."""
        self._check_params(params)
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = zeros_state_like(p)  # [Note: huge pages for the moments]
                state["exp_avg_sq"] = zeros_state_like(p)
        states = [self.state[p] for p in params]
        return AdamPlan(params, [st["exp_avg"] for st in states],
                        [st["exp_avg_sq"] for st in states], [st["step"] for st in states])


_MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")


def _convert_moments(st: dict[str, Any], want: StateDtype) -> None:
    """A loaded state's moments (fp32, bf16, or int8 codes and scales, cast to float by torch) in ``want``."""
    m, v = st["exp_avg"], st["exp_avg_sq"]
    if want is StateDtype.FP32 and "exp_avg_scale" not in st and m.dtype == v.dtype == torch.float32:
        return  # as loaded, as before
    if "exp_avg_scale" in st:  # int8 codes, which torch's loader made float: the codes are exact
        m = dequantize(m.to(torch.uint8).contiguous(), st.pop("exp_avg_scale").float().contiguous(), signed=True)
        v = dequantize(v.to(torch.uint8).contiguous(), st.pop("exp_avg_sq_scale").float().contiguous(), signed=False)
    m, v = m.float().contiguous(), v.float().contiguous()
    if want is StateDtype.FP32:
        st["exp_avg"], st["exp_avg_sq"] = zeros_state_like(m).copy_(m), zeros_state_like(v).copy_(v)
    elif want is StateDtype.BF16:
        st["exp_avg"], st["exp_avg_sq"] = m.to(torch.bfloat16), v.to(torch.bfloat16)
    else:
        st["exp_avg"], st["exp_avg_scale"] = quantize(m, signed=True)
        st["exp_avg_sq"], st["exp_avg_sq_scale"] = quantize(v, signed=False)


class CPUAdamW(CPUAdam):
    """CPUAdam with decoupled weight decay and torch.optim.AdamW's default decay of 1e-2."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        bias_correction: bool = True,
        amsgrad: bool = False,
        *,
        num_threads: int | None = None,
        isa: Isa | str | None = None,
        state_dtype: StateDtype | str = "fp32",
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, True, bias_correction, amsgrad,
                         num_threads=num_threads, isa=isa, state_dtype=state_dtype)
