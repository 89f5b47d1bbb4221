"""The functional Adam step over CPU buffers: every call into ``csrc._adam`` is here.

Each function checks what it is handed (device, dtype, contiguity, lengths) before
passing addresses to C, so a bad tensor is a ``ConfigError`` that names it rather
than memory corruption. The C releases the GIL and runs its own threads.

``adam_step`` is what the engine calls for a fused offload step: bf16/fp16 gradients
in, fp32 master and moments updated in place, an optional bf16/fp16 copy of the new
params written in the same pass, and a gradient multiplier (1/loss_scale times the
clip coefficient) applied on the way in. ``grad_sumsq`` is the cheap pass that comes
first: its result gives the clip coefficient, and a non-finite result says to skip
the step under fp16 loss scaling.
"""
from __future__ import annotations

import array
import dataclasses
import enum
import logging
import os
from typing import Sequence

import torch

from csrc import ConfigError, raise_errno
from csrc.loader import load_extension

logger = logging.getLogger(__name__)

__all__ = [
    "AdamConfig",
    "AdamPlan",
    "Isa",
    "adam_step",
    "available_isas",
    "default_num_threads",
    "grad_sumsq",
    "resolve_isa",
    "stream_inplace",
]

ABI_VERSION = 1
ffi, lib = load_extension("csrc._adam", "ofl_adam_abi_version", ABI_VERSION, "the compiled Adam kernels")


class Isa(enum.IntEnum):
    """Instruction-set path of the kernels."""

    AUTO = lib.OFL_ISA_AUTO  # the best this CPU and OS support
    SCALAR = lib.OFL_ISA_SCALAR  # portable C, any CPU
    AVX2 = lib.OFL_ISA_AVX2  # AVX2 + FMA + F16C
    AVX512 = lib.OFL_ISA_AVX512  # AVX-512 F/BW/VL/DQ


ISA_ENV = "OFFLOAD_CPU_ADAM_ISA"

_DTYPE_CODES = {
    torch.float32: lib.OFL_DTYPE_F32,
    torch.bfloat16: lib.OFL_DTYPE_BF16,
    torch.float16: lib.OFL_DTYPE_F16,
}


def available_isas() -> list[Isa]:
    """The concrete paths (not AUTO) this machine can run, slowest first."""
    return [isa for isa in (Isa.SCALAR, Isa.AVX2, Isa.AVX512) if lib.ofl_adam_isa_supported(isa)]


def resolve_isa(isa: Isa | str | None) -> Isa:
    """Turn a name, an ``Isa`` or None (the ``OFFLOAD_CPU_ADAM_ISA`` variable, else AUTO) into a concrete path."""
    if isa is None:
        isa = os.environ.get(ISA_ENV, "auto")
    if isinstance(isa, str):
        try:
            isa = Isa[isa.strip().upper()]
        except KeyError:
            names = ", ".join(i.name.lower() for i in Isa)
            raise ConfigError(f"unknown ISA {isa!r}: expected one of {names}") from None
    isa = Isa(isa)
    if isa == Isa.AUTO:
        return Isa(lib.ofl_adam_best_isa())
    if not lib.ofl_adam_isa_supported(isa):
        raise ConfigError(f"ISA {isa.name.lower()} is not supported by this CPU")
    return isa


def default_num_threads() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0))


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdamConfig:
    """Hyperparameters of one Adam step and how the kernel runs it."""

    lr: float = 1e-3
    """Learning rate."""
    beta1: float = 0.9
    """Decay of the first moment, in [0, 1)."""
    beta2: float = 0.999
    """Decay of the second moment, in [0, 1)."""
    eps: float = 1e-8
    """Added to the denominator, >= 0."""
    weight_decay: float = 0.0
    """Decay coefficient, >= 0."""
    adamw_mode: bool = True
    """True: decoupled decay (AdamW); False: L2 decay added to the gradient (Adam)."""
    bias_correction: bool = True
    """Divide the moments by (1 - beta^step)."""
    num_threads: int | None = None
    """Threads the kernel may use; None: the cores this process may run on."""
    isa: Isa | str | None = None
    """Instruction-set path; None: the OFFLOAD_CPU_ADAM_ISA variable, else the best available."""

    def __post_init__(self) -> None:
        if not self.lr >= 0.0:
            raise ConfigError(f"lr must be >= 0, got {self.lr}")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {value}")
        if not self.eps >= 0.0:
            raise ConfigError(f"eps must be >= 0, got {self.eps}")
        if not self.weight_decay >= 0.0:
            raise ConfigError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"num_threads must be >= 1, got {self.num_threads}")
        resolve_isa(self.isa)  # fail at construction, not at the first step


def _addresses(tensors: Sequence[torch.Tensor], what: str, dtype: torch.dtype | None,
               numels: Sequence[int] | None) -> array.array:
    """Check every tensor and return their addresses as a uint64 array.

    This runs for every tensor of every step, so each check is the cheapest torch
    offers (``is_cpu``, not ``device.type``) and the slow path only builds the message.
    """
    addrs = array.array("Q", [t.data_ptr() for t in tensors])
    ok = all(t.is_cpu and t.is_contiguous() for t in tensors)
    if ok and dtype is not None:
        ok = all(t.dtype == dtype for t in tensors)
    if ok and numels is not None:
        ok = [t.numel() for t in tensors] == list(numels)
    if not ok:
        _explain(tensors, what, dtype, numels)
    return addrs


def _explain(tensors: Sequence[torch.Tensor], what: str, dtype: torch.dtype | None,
             numels: Sequence[int] | None) -> None:
    """Raise for the first tensor that fails a check (the slow path of the checks)."""
    for i, t in enumerate(tensors):
        if t.layout != torch.strided:
            raise ConfigError(f"{what}[{i}] has layout {t.layout}; dense (strided) tensors are needed")
        if not t.is_cpu:
            raise ConfigError(f"{what}[{i}] is on {t.device}, expected a CPU tensor")
        if dtype is not None and t.dtype != dtype:
            raise ConfigError(f"{what}[{i}] has dtype {t.dtype}, expected {dtype}")
        if not t.is_contiguous():
            raise ConfigError(f"{what}[{i}] is not contiguous")
        if numels is not None and t.numel() != numels[i]:
            raise ConfigError(f"{what}[{i}] has {t.numel()} elements, its param has {numels[i]}")


def _dtype_code(tensors: Sequence[torch.Tensor], what: str) -> int:
    dtype = tensors[0].dtype
    if dtype not in _DTYPE_CODES:
        raise ConfigError(f"{what} have dtype {dtype}; supported: float32, bfloat16, float16")
    return _DTYPE_CODES[dtype]


def _collect(params, grads, exp_avgs, exp_avg_sqs, steps, params_out):
    """Check all tensors of one step in a single pass; return their address arrays and numels.

    This runs for every tensor of every step, so it is one loop with the cheapest
    checks torch offers (``is_cpu``, not ``device.type``); on any failure the slow
    path finds the first bad tensor and names it.
    """
    f32 = torch.float32
    gdt = grads[0].dtype
    odt = params_out[0].dtype if params_out is not None else None
    cols: list[list[int]] = [[], [], [], [], [], []]
    numels: list[int] = []
    outs = params_out if params_out is not None else grads  # zip partner; unused without outs
    try:
        _collect_into(cols, numels, f32, gdt, odt, zip(params, grads, exp_avgs, exp_avg_sqs, steps, outs))
    except RuntimeError:  # e.g. a sparse tensor has no is_contiguous(); named below
        pass
    if len(numels) != len(params):  # name the first offender
        want = [t.numel() for t in params]
        _explain(params, "params", f32, None)
        _explain(grads, "grads", gdt, want)
        _explain(exp_avgs, "exp_avgs", f32, want)
        _explain(exp_avg_sqs, "exp_avg_sqs", f32, want)
        _explain(steps, "steps", f32, [1] * len(params))
        _explain(params_out or [], "params_out", odt, want)
        raise ConfigError("a tensor of this step failed the argument checks")  # not reached
    return [array.array("Q", c) for c in cols], array.array("q", numels)


def _collect_into(cols, numels, f32, gdt, odt, rows) -> None:
    """The fast path of ``_collect``: stops at the first tensor that fails a check."""
    cp, cg, cm, cv, cs, co = cols
    for p, g, m, v, s, o in rows:
        n = p.numel()
        if not (p.dtype == f32 and m.dtype == f32 and v.dtype == f32 and s.dtype == f32
                and g.dtype == gdt and p.is_cpu and g.is_cpu and m.is_cpu and v.is_cpu and s.is_cpu
                and p.is_contiguous() and g.is_contiguous() and m.is_contiguous()
                and v.is_contiguous() and g.numel() == n and m.numel() == n and v.numel() == n
                and s.numel() == 1):
            break
        if odt is not None:
            if not (o.dtype == odt and o.is_cpu and o.is_contiguous() and o.numel() == n):
                break
            co.append(o.data_ptr())
        numels.append(n)
        cp.append(p.data_ptr())
        cg.append(g.data_ptr())
        cm.append(m.data_ptr())
        cv.append(v.data_ptr())
        cs.append(s.data_ptr())


def adam_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    config: AdamConfig,
    grad_scale: float = 1.0,
    params_out: Sequence[torch.Tensor] | None = None,
) -> bool:
    """One Adam step over all tensors in one C call; returns True if a scaled gradient was not finite.

    ``params``, ``exp_avgs``, ``exp_avg_sqs``: float32, updated in place. ``grads``: one
    dtype among float32/bfloat16/float16, multiplied by ``grad_scale`` first. ``steps``:
    one-element float32 tensors, each incremented by one. ``params_out``: optional
    bfloat16/float16/float32 tensors that receive the updated params in the same pass.
    """
    n = len(params)
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "steps": steps}
    if params_out is not None:
        lists["params_out"] = params_out
    for what, seq in lists.items():
        if len(seq) != n:
            raise ConfigError(f"{what} has {len(seq)} tensors, params has {n}")
    if n == 0:
        return False
    grad_code = _dtype_code(grads, "grads")
    out_code = _dtype_code(params_out, "params_out") if params_out is not None else lib.OFL_DTYPE_NONE
    (cp, cg, cm, cv, cs, co), numels = _collect(params, grads, exp_avgs, exp_avg_sqs, steps, params_out)

    return _call_adam(config, grad_scale, grad_code, out_code, [cp, cg, cm, cv, cs],
                      co if params_out is not None else None, numels)


def _call_adam(config: AdamConfig, grad_scale: float, grad_code: int, out_code: int,
               cols: list[array.array], outs: array.array | None, numels: array.array) -> bool:
    """The one call of ofl_adam_step; cols are the param, grad, exp_avg, exp_avg_sq, step addresses."""
    cfg = ffi.new("ofl_adam_config *")
    cfg.lr = config.lr
    cfg.beta1 = config.beta1
    cfg.beta2 = config.beta2
    cfg.eps = config.eps
    cfg.weight_decay = config.weight_decay
    cfg.adamw_mode = int(config.adamw_mode)
    cfg.bias_correction = int(config.bias_correction)
    cfg.grad_scale = grad_scale
    cfg.grad_dtype = grad_code
    cfg.out_dtype = out_code
    cfg.isa = resolve_isa(config.isa)
    cfg.num_threads = config.num_threads or default_num_threads()

    keep = [ffi.from_buffer("uint64_t[]", c) for c in cols]
    tens = ffi.new("ofl_adam_tensors *")
    tens.param, tens.grad, tens.exp_avg, tens.exp_avg_sq, tens.step = keep
    if outs is not None:
        keep.append(ffi.from_buffer("uint64_t[]", outs))
        tens.param_out = keep[-1]
    numel_buf = ffi.from_buffer("int64_t[]", numels)
    tens.numel = numel_buf
    tens.count = len(numels)
    nonfinite = ffi.new("int32_t *")
    raise_errno(lib.ofl_adam_step(cfg, tens, nonfinite), "ofl_adam_step")
    return bool(nonfinite[0])


class AdamPlan:
    """A checked address table of params and their Adam state, built once and stepped many times.

    Building it checks every tensor. Each ``step`` then checks only what changes between
    steps: the gradients (new tensors after every backward). ``matches`` tells whether the
    table still describes a list of params (the same tensors, at the same addresses,
    still contiguous); ``CPUAdam`` rebuilds the table when it does not, and whenever it
    loads a state dict, since the state tensors are then new.
    """

    def __init__(self, params: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
                 exp_avg_sqs: Sequence[torch.Tensor], steps: Sequence[torch.Tensor]) -> None:
        n = len(params)
        for what, seq in (("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs), ("steps", steps)):
            if len(seq) != n:
                raise ConfigError(f"{what} has {len(seq)} tensors, params has {n}")
        numels = [p.numel() for p in params]
        f32 = torch.float32
        self._params = list(params)
        self._state = (list(exp_avgs), list(exp_avg_sqs), list(steps))  # keeps the memory alive
        self._param_addrs = _addresses(params, "params", f32, None)
        self._addrs = [
            self._param_addrs,
            _addresses(exp_avgs, "exp_avgs", f32, numels),
            _addresses(exp_avg_sqs, "exp_avg_sqs", f32, numels),
            _addresses(steps, "steps", f32, [1] * n),
        ]
        self._numels = array.array("q", numels)

    def matches(self, params: Sequence[torch.Tensor]) -> bool:
        """True if ``params`` are this table's tensors, unmoved and contiguous."""
        mine = self._params
        return (len(params) == len(mine) and all(a is b for a, b in zip(params, mine))
                and all(p.is_contiguous() for p in params)
                and array.array("Q", [p.data_ptr() for p in params]) == self._param_addrs)

    def step(self, grads: Sequence[torch.Tensor], *, config: AdamConfig, grad_scale: float = 1.0) -> bool:
        """One Adam step of every param of the table; True if a scaled gradient was not finite."""
        n = len(self._params)
        if len(grads) != n:
            raise ConfigError(f"grads has {len(grads)} tensors, the plan has {n} params")
        if n == 0:
            return False
        gdt = grads[0].dtype
        code = _dtype_code(grads, "grads")
        try:
            ok = all(g.dtype == gdt and g.is_cpu and g.is_contiguous() for g in grads)
        except RuntimeError:  # sparse tensors have no is_contiguous()
            ok = False
        addrs = array.array("Q", [g.data_ptr() for g in grads]) if ok else None
        if not ok or array.array("q", [g.numel() for g in grads]) != self._numels:
            _explain(grads, "grads", gdt, self._numels)
            raise ConfigError("a gradient failed the argument checks")  # not reached
        return _call_adam(config, grad_scale, code, lib.OFL_DTYPE_NONE,
                          [self._addrs[0], addrs, *self._addrs[1:]], None, self._numels)


def grad_sumsq(grads: Sequence[torch.Tensor], *, num_threads: int | None = None,
               isa: Isa | str | None = None) -> float:
    """Sum of squares (in double) of all gradients; inf or NaN means some gradient was not finite."""
    if not grads:
        return 0.0
    code = _dtype_code(grads, "grads")
    addrs = _addresses(grads, "grads", grads[0].dtype, None)
    numels = array.array("q", [g.numel() for g in grads])
    out = ffi.new("double *")
    rc = lib.ofl_grad_sumsq(ffi.from_buffer("uint64_t[]", addrs), ffi.from_buffer("int64_t[]", numels),
                            len(grads), code, resolve_isa(isa), num_threads or default_num_threads(), out)
    raise_errno(rc, "ofl_grad_sumsq")
    return float(out[0])


def stream_inplace(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor, *,
                   num_threads: int | None = None) -> None:
    """Roofline probe with Adam's traffic: a += b; c += b; d += b over float32 tensors."""
    tensors = [a, b, c, d]
    _addresses(tensors, "stream operands", torch.float32, [a.numel()] * 4)
    rc = lib.ofl_stream_inplace(ffi.cast("float *", a.data_ptr()), ffi.cast("float *", b.data_ptr()),
                                ffi.cast("float *", c.data_ptr()), ffi.cast("float *", d.data_ptr()),
                                a.numel(), num_threads or default_num_threads())
    raise_errno(rc, "ofl_stream_inplace")
