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
from typing import Any, Callable, Iterable, Sequence

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
    """Adam/AdamW over CPU params, all tensors of a group in one multithreaded SIMD call.

    ``adamw_mode=True`` (the default) decays weights decoupled, as AdamW; False adds
    ``weight_decay * p`` to the gradient, as Adam. ``num_threads`` defaults to the cores
    this process may use; ``isa`` forces a path ("scalar", "avx2", "avx512", "avx512_bf16").
    ``state_dtype`` stores the moments as "fp32" (torch's state, bit for bit), "bf16" or "int8"
    (uint8 codes in ``exp_avg``/``exp_avg_sq`` and block scales in ``exp_avg_scale``/
    ``exp_avg_sq_scale``; see ``cpu_adam.quant``); a loaded state of another kind is converted.

    Params are float32 or bfloat16; a bfloat16 param is its own master ([Note: bfloat16 params]):
    2 bytes for it, and 8, 4 or about 2 for its moments.

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
        # torch's loader casts floating state to the param's dtype ([Note: bfloat16 params]): the
        # moments go around it, each to its param by the order torch matches them in
        moments, rest = {}, {}
        for pid, st in state_dict["state"].items():
            moments[pid] = {k: v for k, v in st.items() if k in _MOMENT_KEYS}
            rest[pid] = {k: v for k, v in st.items() if k not in _MOMENT_KEYS}
        super().load_state_dict({**state_dict, "state": rest})
        saved_ids = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        for pid, p in zip(saved_ids, params):
            if moments.get(pid):
                st = self.state[p]
                st.update((k, v.to(device=p.device) if torch.is_tensor(v) else v) for k, v in moments[pid].items())
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
        first = 0  # the place of the group's first param among all (a bf16 param's seed)
        for index, group in enumerate(self.param_groups):
            params = group["params"]
            seeds = range(first, first + len(params))
            first += len(params)
            grads = list(map(_GRAD, params))
            if any(map(operator.is_, grads, _NONES)):
                seeds = [s for s, g in zip(seeds, grads) if g is not None]
                params = [p for p, g in zip(params, grads) if g is not None]
                grads = [g for g in grads if g is not None]
            if not params:
                continue
            config = self._cached_config(index, group)
            if self._state_dtype is not StateDtype.FP32:
                self._step_per_dtype(params, grads, seeds, config)
                continue
            plan = self._plans.get(index)
            if plan is None or not plan.matches(params):
                if any(p.dtype is torch.bfloat16 for p in params):  # no plan: checked as the plan would be
                    self._step_per_dtype(params, grads, seeds, config)
                    continue
                plan = self._plans[index] = self._make_plan(params)
            plan.step(grads, config=config)
        return loss

    def _step_per_dtype(self, params: list[torch.Tensor], grads: list[torch.Tensor], seeds: Sequence[int],
                        config: AdamConfig) -> None:
        """A call per param dtype, for compressed moments or bfloat16 params (no plan: the call
        checks every tensor)."""
        self._make_state(params)
        q8 = self._state_dtype is StateDtype.INT8
        for dtype in (torch.float32, torch.bfloat16):
            mine = [i for i, p in enumerate(params) if p.dtype is dtype]
            if not mine:
                continue
            states = [self.state[params[i]] for i in mine]
            adam_step([params[i] for i in mine], [grads[i] for i in mine], [st["exp_avg"] for st in states],
                      [st["exp_avg_sq"] for st in states], [st["step"] for st in states], config=config,
                      exp_avg_scales=[st["exp_avg_scale"] for st in states] if q8 else None,
                      exp_avg_sq_scales=[st["exp_avg_sq_scale"] for st in states] if q8 else None,
                      master_seeds=[seeds[i] for i in mine] if dtype is torch.bfloat16 else None)

    def _check_params(self, params: list[torch.Tensor]) -> None:
        for p in params:
            if p.grad.is_sparse:
                raise ConfigError("CPUAdam does not support sparse gradients")
            if p.dtype is not torch.float32 and p.dtype is not torch.bfloat16:
                raise ConfigError(f"CPUAdam updates float32 or bfloat16 params; got a {p.dtype} param of "
                                  f"shape {tuple(p.shape)} (keep a float32 master copy)")

    def _make_state(self, params: list[torch.Tensor]) -> None:
        """Check ``params`` and give each without state its step count and zero moments."""
        self._check_params(params)
        for p in params:
            state = self.state[p]
            if state:
                continue
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            if self._state_dtype is StateDtype.FP32:  # float32 moments, for a bfloat16 param too
                state["exp_avg"] = zeros_state_like(p)  # [Note: huge pages for the moments]
                state["exp_avg_sq"] = zeros_state_like(p)
            else:  # bf16 moments have no scales: no None entries
                state.update((k, t) for k, t in zip(_MOMENT_KEYS, zeros_moments(p.shape, self._state_dtype))
                             if t is not None)

    def _make_plan(self, params: list[torch.Tensor]) -> AdamPlan:
        """Create missing state and the checked address table of ``params``."""
        self._make_state(params)
        states = [self.state[p] for p in params]
        return AdamPlan(params, [st["exp_avg"] for st in states],
                        [st["exp_avg_sq"] for st in states], [st["step"] for st in states])


_MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")

# [Note: bfloat16 params]
# A bfloat16 param (with float32, bf16 or int8 moments) is its own master: each step widens it to float32
# exactly, updates it as a float32 param and stores it back by stochastic rounding, so updates
# below its last place add up on average instead of being lost, as they are when torch's AdamW
# steps a bfloat16 param (rounded to nearest). The rounding of an element depends only on the
# param's place among the optimizer's params (group after group: its seed), the element and the
# step count ([Note: a bf16 master] in csrc/ofl_adam.h): the same on every ISA and thread count,
# and on every data-parallel replica, which so stay equal. A group may mix float32 and bfloat16
# params: each dtype is one call. torch's state-dict loader would cast every floating state
# tensor to its param's dtype, rounding int8 block scales to bfloat16; load_state_dict keeps the
# moments and scales out of its way and converts them itself.


def _convert_moments(st: dict[str, Any], want: StateDtype) -> None:
    """A loaded state's moments (fp32, bf16, or int8 codes and scales, as saved) in ``want``."""
    m, v = st["exp_avg"], st["exp_avg_sq"]
    for key in ("exp_avg_scale", "exp_avg_sq_scale"):  # a bf16 state's, saved as None
        if key in st and st[key] is None:
            del st[key]
    if want is StateDtype.FP32 and "exp_avg_scale" not in st and m.dtype == v.dtype == torch.float32:
        return  # as loaded, as before
    if "exp_avg_scale" in st:  # int8 codes: uint8, or float from a caller who cast them (exact either way)
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
