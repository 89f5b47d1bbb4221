"""The functional Adam step over CPU buffers: every call into ``csrc._adam`` is here.

Each function checks what it is handed (device, dtype, contiguity, lengths) before
passing addresses to C, so a bad tensor is a ``ConfigError`` that names it rather
than memory corruption. The C releases the GIL and runs its own threads.

``adam_step`` is what the engine calls for a fused offload step: bf16/fp16 gradients
in, fp32 master and moments updated in place, an optional bf16/fp16 copy of the new
params written in the same pass, and a gradient multiplier (1/loss_scale times the
clip coefficient) applied on the way in. ``grad_sumsq`` is the cheap pass that comes
first: its result gives the clip coefficient, and a non-finite result says to skip
the step under fp16 loss scaling. ``grad_land`` is the engine's landing pass: it copies or
adds reduced gradients into the fp32 accumulators and returns the same sum of squares,
taken while the bytes are in registers (and can zero the sources on the way).
"""
from __future__ import annotations

import array
import dataclasses
import enum
import itertools
import logging
import operator
import os
from typing import Any, Sequence

import torch

from csrc import ConfigError, raise_errno
from csrc.loader import load_extension
from cpu_adam.cores import usable_cores

logger = logging.getLogger(__name__)

__all__ = [
    "AdamConfig",
    "Isa",
    "adam_step",
    "available_isas",
    "default_num_threads",
    "grad_land",
    "grad_sumsq",
    "resolve_isa",
    "stream_inplace",
]

ABI_VERSION = 8
ffi, lib = load_extension("csrc._adam", "ofl_adam_abi_version", ABI_VERSION, "the compiled Adam kernels")


class Isa(enum.IntEnum):
    """Instruction-set path of the kernels."""

    AUTO = lib.OFL_ISA_AUTO  # the best this CPU and OS support
    SCALAR = lib.OFL_ISA_SCALAR  # portable C, any CPU
    AVX2 = lib.OFL_ISA_AVX2  # AVX2 + FMA + F16C
    AVX512 = lib.OFL_ISA_AVX512  # AVX-512 F/BW/VL/DQ
    AVX512_BF16 = lib.OFL_ISA_AVX512_BF16  # the same, with AVX512_BF16 for the bf16 param copy


ISA_ENV = "OFFLOAD_CPU_ADAM_ISA"

_DTYPE_CODES = {
    torch.float32: lib.OFL_DTYPE_F32,
    torch.bfloat16: lib.OFL_DTYPE_BF16,
    torch.float16: lib.OFL_DTYPE_F16,
}


def available_isas() -> list[Isa]:
    """The concrete paths (not AUTO) this machine can run, slowest first."""
    return [isa for isa in (Isa.SCALAR, Isa.AVX2, Isa.AVX512, Isa.AVX512_BF16) if lib.ofl_adam_isa_supported(isa)]


_RESOLVED: dict[Isa | str | int, Isa] = {}  # what resolve_isa was asked -> its answer (the CPU does not change)


def resolve_isa(isa: Isa | str | int | None) -> Isa:
    """Turn a name, an ``Isa`` or None (the ``OFFLOAD_CPU_ADAM_ISA`` variable, else AUTO) into a concrete path."""
    if isa is None:
        isa = os.environ.get(ISA_ENV, "auto")
    known = _RESOLVED.get(isa)
    if known is None:
        known = _RESOLVED[isa] = _resolve_uncached(isa)
    return known


def _resolve_uncached(isa: Isa | str | int) -> Isa:
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
    """The cores this rank may really use: affinity, cgroup quota, ranks on this node
    ([Note: threads per rank] in cpu_adam.cores)."""
    return usable_cores()


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


_DTYPE = operator.attrgetter("dtype")
_IS_CPU = operator.attrgetter("is_cpu")
_CONTIGUOUS = torch.Tensor.is_contiguous
_NUMEL = torch.Tensor.numel
_DATA_PTR = torch.Tensor.data_ptr


def checked_addresses(tensors: Sequence[torch.Tensor], dtype: torch.dtype,
                      numels: list[int] | None) -> list[int] | None:
    """The addresses of ``tensors`` if each is a contiguous CPU tensor of ``dtype`` (and, unless
    ``numels`` is None, of that many elements); None if any check fails.

    [Note: checks per tensor]
    These run for every tensor of every step, so each check is one pass of ``map`` over the
    list with the cheapest accessor torch offers (``is_cpu``, not ``device.type``): about
    40 ns a tensor and check, where a loop testing every condition per tensor costs several
    times that. The slow path (``explain``) runs only after a failure, to name the tensor.
    """
    try:
        ok = (all(map(_IS_CPU, tensors)) and all(map(_CONTIGUOUS, tensors))
              and all(map(operator.is_, map(_DTYPE, tensors), itertools.repeat(dtype)))
              and (numels is None or list(map(_NUMEL, tensors)) == numels))
    except RuntimeError:  # e.g. a sparse tensor has no is_contiguous(); named by explain()
        return None
    return list(map(_DATA_PTR, tensors)) if ok else None


def address_array(tensors: Sequence[torch.Tensor], what: str, dtype: torch.dtype,
               numels: list[int] | None) -> array.array:
    """Check every tensor and return their addresses as a uint64 array, or raise naming the first bad one."""
    addrs = checked_addresses(tensors, dtype, numels)
    if addrs is None:
        explain(tensors, what, dtype, numels)
        raise ConfigError(f"a tensor of {what} failed the argument checks")  # not reached
    return array.array("Q", addrs)


def explain(tensors: Sequence[torch.Tensor], what: str, dtype: torch.dtype | None,
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


def dtype_code(tensors: Sequence[torch.Tensor], what: str) -> int:
    """The OFL_DTYPE_* code of the first tensor's dtype, or ConfigError if the kernels have none."""
    code = _DTYPE_CODES.get(tensors[0].dtype)
    if code is None:
        raise ConfigError(f"{what} have dtype {tensors[0].dtype}; supported: float32, bfloat16, float16")
    return code


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
    exp_avg_scales: Sequence[torch.Tensor] | None = None,
    exp_avg_sq_scales: Sequence[torch.Tensor] | None = None,
    master_seeds: Sequence[int] | None = None,
) -> bool:
    """One Adam step over all tensors in one C call; returns True if a scaled gradient was not finite.

    ``params``, ``exp_avgs``, ``exp_avg_sqs``: float32, updated in place. ``grads``: one
    dtype among float32/bfloat16/float16, multiplied by ``grad_scale`` first. ``steps``:
    one-element float32 tensors, each incremented by one. ``params_out``: optional
    bfloat16/float16/float32 tensors that receive the updated params in the same pass.
    For many calls over the same buffers, ``AdamPlan`` checks them once. Moments of dtype
    bfloat16, or uint8 codes with their float32 block scales (``exp_avg_scales``,
    ``exp_avg_sq_scales``), are compressed states: ``cpu_adam.quant.adam_step_q`` steps them,
    and with them, or with float32 moments, ``params`` may be bfloat16 masters rounded
    stochastically (``master_seeds``).
    """
    compressed = exp_avgs and exp_avgs[0].dtype in (torch.bfloat16, torch.uint8)
    if compressed or (params and params[0].dtype is torch.bfloat16):  # a bf16 master takes fp32 moments too
        from cpu_adam.quant import adam_step_q  # it imports this module
        return adam_step_q(params, grads, exp_avgs, exp_avg_sqs, steps, config=config, grad_scale=grad_scale,
                           params_out=params_out, exp_avg_scales=exp_avg_scales,
                           exp_avg_sq_scales=exp_avg_sq_scales, master_seeds=master_seeds)
    if master_seeds is not None:
        raise ConfigError("master_seeds name bfloat16 masters; these params are not bfloat16")
    n = len(params)
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "steps": steps}
    if params_out is not None:
        lists["params_out"] = params_out
    for what, seq in lists.items():
        if len(seq) != n:
            raise ConfigError(f"{what} has {len(seq)} tensors, params has {n}")
    if n == 0:
        return False
    grad_code = dtype_code(grads, "grads")
    out_code = dtype_code(params_out, "params_out") if params_out is not None else lib.OFL_DTYPE_NONE
    tensors = build_tensors(*_collect(params, grads, exp_avgs, exp_avg_sqs, steps, params_out))
    return call_adam(config, grad_scale, grad_code, out_code, tensors)


def _collect(params, grads, exp_avgs, exp_avg_sqs, steps, params_out):
    """Check all tensors of one step in a single pass; return their address arrays (outs:
    None when absent) and numels.

    One loop over the rows, each test the cheapest torch offers (``is_cpu``, not
    ``device.type``; ``is`` for dtypes, which are singletons): for the few large tensors of
    an engine call this costs less than a ``map`` per column ([Note: checks per tensor]),
    and as little for many. On any failure the slow path names the first bad tensor.
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
        explain(params, "params", f32, None)
        explain(grads, "grads", gdt, want)
        explain(exp_avgs, "exp_avgs", f32, want)
        explain(exp_avg_sqs, "exp_avg_sqs", f32, want)
        explain(steps, "steps", f32, [1] * len(params))
        explain(params_out or [], "params_out", odt, want)
        raise ConfigError("a tensor of this step failed the argument checks")  # not reached
    outs_addrs = array.array("Q", cols[5]) if params_out is not None else None
    return [array.array("Q", c) for c in cols[:5]], outs_addrs, array.array("q", numels)


def _collect_into(cols, numels, f32, gdt, odt, rows) -> None:
    """The fast path of ``_collect``: stops at the first tensor that fails a check."""
    cp, cg, cm, cv, cs, co = cols
    for p, g, m, v, s, o in rows:
        n = p.numel()
        if not (p.dtype is f32 and m.dtype is f32 and v.dtype is f32 and s.dtype is f32
                and g.dtype is gdt and p.is_cpu and g.is_cpu and m.is_cpu and v.is_cpu and s.is_cpu
                and p.is_contiguous() and g.is_contiguous() and m.is_contiguous()
                and v.is_contiguous() and g.numel() == n and m.numel() == n and v.numel() == n
                and s.numel() == 1):
            break
        if odt is not None:
            if not (o.dtype is odt and o.is_cpu and o.is_contiguous() and o.numel() == n):
                break
            co.append(o.data_ptr())
        numels.append(n)
        cp.append(p.data_ptr())
        cg.append(g.data_ptr())
        cm.append(m.data_ptr())
        cv.append(v.data_ptr())
        cs.append(s.data_ptr())


def build_tensors(cols: list[array.array], outs: array.array | None, numels: array.array) -> Any:
    """An ofl_adam_tensors struct over address arrays (param, grad, exp_avg, exp_avg_sq, step).

    The struct holds raw pointers into the arrays, so it is returned with them: a tuple of
    the struct and everything it points into, kept together for as long as it is used.
    """
    keep = [ffi.from_buffer("uint64_t[]", c) for c in cols]
    tens = ffi.new("ofl_adam_tensors *")
    tens.param, tens.grad, tens.exp_avg, tens.exp_avg_sq, tens.step = keep
    if outs is not None:
        keep.append(ffi.from_buffer("uint64_t[]", outs))
        tens.param_out = keep[-1]
    keep.append(ffi.from_buffer("int64_t[]", numels))
    tens.numel = keep[-1]
    tens.count = len(numels)
    return tens, keep, cols, outs, numels


_TEMPLATES: dict[int, tuple[AdamConfig, Any]] = {}  # id(config) -> (config, ofl_adam_config)
_TEMPLATES_MAX = 64


def _template(config: AdamConfig) -> Any:
    """The C struct of a config's hyperparameters and ISA, built once per config object.

    Entries hold their config, so an id is never reused while its entry lives; the table
    is emptied when full (a scheduler makes a config per step).
    """
    entry = _TEMPLATES.get(id(config))
    if entry is not None and entry[0] is config:
        return entry[1]
    cfg = ffi.new("ofl_adam_config *")
    cfg.lr = config.lr
    cfg.beta1 = config.beta1
    cfg.beta2 = config.beta2
    cfg.eps = config.eps
    cfg.weight_decay = config.weight_decay
    cfg.adamw_mode = int(config.adamw_mode)
    cfg.bias_correction = int(config.bias_correction)
    cfg.isa = resolve_isa(config.isa)
    if len(_TEMPLATES) >= _TEMPLATES_MAX:
        _TEMPLATES.clear()
    _TEMPLATES[id(config)] = (config, cfg)
    return cfg


def config_struct(config: AdamConfig, grad_scale: float, grad_code: int, out_code: int) -> Any:
    """The ofl_adam_config of one call."""
    cfg = ffi.new("ofl_adam_config *", _template(config)[0])
    cfg.grad_scale = grad_scale
    cfg.grad_dtype = grad_code
    cfg.out_dtype = out_code
    cfg.num_threads = config.num_threads or default_num_threads()
    return cfg


def call_adam(config: AdamConfig, grad_scale: float, grad_code: int, out_code: int, tensors: tuple) -> bool:
    """The one call of ofl_adam_step, over a struct from ``build_tensors``."""
    cfg = config_struct(config, grad_scale, grad_code, out_code)
    nonfinite = ffi.new("int32_t *")
    raise_errno(lib.ofl_adam_step(cfg, tensors[0], nonfinite), "ofl_adam_step")
    return bool(nonfinite[0])


def grad_sumsq(grads: Sequence[torch.Tensor], *, num_threads: int | None = None,
               isa: Isa | str | None = None) -> float:
    """Sum of squares (in double) of all gradients; inf or NaN means some gradient was not finite."""
    if not grads:
        return 0.0
    code = dtype_code(grads, "grads")
    addrs = address_array(grads, "grads", grads[0].dtype, None)
    return call_sumsq(addrs, array.array("q", map(_NUMEL, grads)), code, num_threads=num_threads, isa=isa)


def call_sumsq(addrs: array.array, numels: array.array, code: int, *, num_threads: int | None,
               isa: Isa | str | None) -> float:
    """The one call of ofl_grad_sumsq, over checked address and length arrays."""
    out = ffi.new("double *")
    rc = lib.ofl_grad_sumsq(ffi.from_buffer("uint64_t[]", addrs), ffi.from_buffer("int64_t[]", numels),
                            len(addrs), code, resolve_isa(isa), num_threads or default_num_threads(), out)
    raise_errno(rc, "ofl_grad_sumsq")
    return float(out[0])


def grad_land(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], *, accumulate: bool,
              zero_sources: bool = False, num_threads: int | None = None, isa: Isa | str | None = None) -> float:
    """Land gradients in accumulators in one pass; return the sum of squares (double) of the result.

    ``dst = src`` (``accumulate`` False: the first micro-step) or ``dst += src`` for each pair;
    ``dsts`` all float32, or all bfloat16 (the sum taken in fp32, then rounded to nearest even),
    ``srcs`` one dtype among float32/bfloat16/float16, each pair of the same length; with
    ``zero_sources`` every source is zero afterwards. The sum is of the values stored: it equals
    ``grad_sumsq(dsts)`` afterwards (the same chunk grid and partials), with any thread count."""
    if len(dsts) != len(srcs):
        raise ConfigError(f"dsts has {len(dsts)} tensors, srcs has {len(srcs)}")
    if not dsts:
        return 0.0
    code = dtype_code(srcs, "srcs")
    numels = list(map(_NUMEL, dsts))
    dst_dtype = dsts[0].dtype
    if dst_dtype not in (torch.float32, torch.bfloat16):
        raise ConfigError(f"dsts must be float32 or bfloat16 accumulators, got {dst_dtype}")
    dst_addrs = address_array(dsts, "dsts", dst_dtype, None)
    src_addrs = address_array(srcs, "srcs", srcs[0].dtype, numels)
    out = ffi.new("double *")
    dst_code = lib.OFL_DTYPE_F32 if dst_dtype == torch.float32 else lib.OFL_DTYPE_BF16
    rc = lib.ofl_grad_land(ffi.from_buffer("uint64_t[]", dst_addrs), ffi.from_buffer("uint64_t[]", src_addrs),
                           ffi.from_buffer("int64_t[]", array.array("q", numels)), len(numels), code, dst_code,
                           int(accumulate), int(zero_sources), resolve_isa(isa), num_threads or default_num_threads(),
                           out)
    raise_errno(rc, "ofl_grad_land")
    return float(out[0])


def stream_inplace(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor, *,
                   num_threads: int | None = None) -> None:
    """Roofline probe with Adam's traffic: a += b; c += b; d += b over float32 tensors."""
    tensors = [a, b, c, d]
    address_array(tensors, "stream operands", torch.float32, [a.numel()] * 4)
    rc = lib.ofl_stream_inplace(ffi.cast("float *", a.data_ptr()), ffi.cast("float *", b.data_ptr()),
                                ffi.cast("float *", c.data_ptr()), ffi.cast("float *", d.data_ptr()),
                                a.numel(), num_threads or default_num_threads())
    raise_errno(rc, "ofl_stream_inplace")
