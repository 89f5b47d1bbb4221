"""Adam with compressed moments (bf16, or 8-bit blockwise-quantized): the calls into ``csrc._adam``
for them, as ``cpu_adam.kernels`` holds those of the fp32 path.

See [Note: quantized Adam states] in ``csrc/ofl_adam.h``. The fp32 master stays; per param:

- ``StateDtype.FP32``: ``exp_avg``, ``exp_avg_sq`` float32 (8 bytes), the bit-exact path of old;
- ``StateDtype.BF16``: both bfloat16 (4 bytes);
- ``StateDtype.INT8``: both uint8 codes, and per block of ``Q8_BLOCK`` elements of a tensor one
  float32 scale each (``exp_avg_scale``, ``exp_avg_sq_scale``): 2 + 8/256 bytes.

``quantize`` / ``dequantize`` convert whole tensors (checkpoints, state conversions); the step
runs through ``adam_step`` of ``cpu_adam.kernels``, which hands compressed moments to
``adam_step_q`` here.
"""
from __future__ import annotations

import array
import enum
import logging
from typing import NamedTuple, Sequence

import torch

from csrc import ConfigError, raise_errno
from cpu_adam.kernels import (AdamConfig, address_array, config_struct, default_num_threads, dtype_code, ffi, lib,
                              resolve_isa)

logger = logging.getLogger(__name__)

__all__ = ["Q8_BLOCK", "Moments", "StateDtype", "adam_step_q", "bf16_round_sr", "dequantize", "q8_map",
           "quantize", "scale_count", "zeros_moments"]

Q8_BLOCK = lib.OFL_Q8_BLOCK


class StateDtype(enum.Enum):
    """How the Adam moments are stored (the fp32 master is kept in every case)."""

    FP32 = "fp32"  # float32 moments: 8 bytes a param, today's bit-exact path
    BF16 = "bf16"  # bfloat16 moments, rounded to nearest even: 4 bytes a param
    INT8 = "int8"  # blockwise dynamic 8-bit codes + a float32 scale per block: ~2.03 bytes a param

    @classmethod
    def parse(cls, value: "StateDtype | str", what: str = "state_dtype") -> "StateDtype":
        """A member from itself or its name; ConfigError naming ``what`` otherwise."""
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            raise ConfigError(f"{what} must be one of {', '.join(m.value for m in cls)}, got {value!r}") from None

    @property
    def moment_dtype(self) -> torch.dtype:
        return {StateDtype.FP32: torch.float32, StateDtype.BF16: torch.bfloat16, StateDtype.INT8: torch.uint8}[self]

    def moment_bytes(self, numel: int) -> int:
        """Bytes of both moments of ``numel`` elements of one tensor, scales included."""
        per = self.moment_dtype.itemsize
        return 2 * numel * per + (2 * 4 * scale_count(numel) if self is StateDtype.INT8 else 0)


_CODES = {StateDtype.FP32: lib.OFL_STATE_F32, StateDtype.BF16: lib.OFL_STATE_BF16, StateDtype.INT8: lib.OFL_STATE_Q8}


def scale_count(numel: int) -> int:
    """Blocks (scales) of one tensor of ``numel`` elements."""
    return -(-numel // Q8_BLOCK)


class Moments(NamedTuple):
    """The moments of one tensor; the scales are None unless they are INT8."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    exp_avg_scale: torch.Tensor | None = None
    exp_avg_sq_scale: torch.Tensor | None = None


def zeros_moments(shape: torch.Size | Sequence[int], state_dtype: StateDtype | str) -> Moments:
    """Zero moments for a param of ``shape`` (zero codes and scales decode to 0.0)."""
    sd = StateDtype.parse(state_dtype)
    m = torch.zeros(shape, dtype=sd.moment_dtype)
    v = torch.zeros(shape, dtype=sd.moment_dtype)
    if sd is not StateDtype.INT8:
        return Moments(m, v)
    n = scale_count(m.numel())
    return Moments(m, v, torch.zeros(n), torch.zeros(n))


def q8_map(signed: bool) -> torch.Tensor:
    """The 256 values of the signed (exp_avg) or unsigned (exp_avg_sq) map, indexed by code."""
    out = torch.empty(256, dtype=torch.float32)
    raise_errno(lib.ofl_q8_map(_map(signed), ffi.cast("float *", out.data_ptr())), "ofl_q8_map")
    return out


def _map(signed: bool) -> int:
    return lib.OFL_Q8_MAP_SIGNED if signed else lib.OFL_Q8_MAP_UNSIGNED


def _flat_check(t: torch.Tensor, what: str, dtype: torch.dtype, numel: int) -> None:
    if not (t.is_cpu and t.dtype == dtype and t.is_contiguous() and t.numel() == numel):
        raise ConfigError(f"{what} must be a contiguous CPU {dtype} tensor of {numel} elements, "
                          f"got {t.dtype} {tuple(t.shape)} on {t.device}")


def quantize(x: torch.Tensor, *, signed: bool, codes: torch.Tensor | None = None,
             scales: torch.Tensor | None = None, num_threads: int | None = None,
             isa: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (uint8, x's shape) and block scales (float32) of a float32 tensor; into the given ones if any."""
    n = x.numel()
    codes = torch.empty(x.shape, dtype=torch.uint8) if codes is None else codes
    scales = torch.empty(scale_count(n)) if scales is None else scales
    _flat_check(x, "x", torch.float32, n)
    _flat_check(codes, "codes", torch.uint8, n)
    _flat_check(scales, "scales", torch.float32, scale_count(n))
    rc = lib.ofl_q8_quantize(ffi.cast("float *", x.data_ptr()), ffi.cast("uint8_t *", codes.data_ptr()),
                             ffi.cast("float *", scales.data_ptr()), n, _map(signed), resolve_isa(isa),
                             num_threads or default_num_threads())
    raise_errno(rc, "ofl_q8_quantize")
    return codes, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, *, signed: bool, out: torch.Tensor | None = None,
               num_threads: int | None = None, isa: str | None = None) -> torch.Tensor:
    """The float32 values of codes and block scales (into ``out`` if given)."""
    n = codes.numel()
    out = torch.empty(codes.shape, dtype=torch.float32) if out is None else out
    _flat_check(codes, "codes", torch.uint8, n)
    _flat_check(scales, "scales", torch.float32, scale_count(n))
    _flat_check(out, "out", torch.float32, n)
    rc = lib.ofl_q8_dequantize(ffi.cast("uint8_t *", codes.data_ptr()), ffi.cast("float *", scales.data_ptr()),
                               ffi.cast("float *", out.data_ptr()), n, _map(signed), resolve_isa(isa),
                               num_threads or default_num_threads())
    raise_errno(rc, "ofl_q8_dequantize")
    return out


def adam_step_q(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
                exp_avg_sqs: Sequence[torch.Tensor], steps: Sequence[torch.Tensor], *, config: AdamConfig,
                grad_scale: float = 1.0, params_out: Sequence[torch.Tensor] | None = None,
                exp_avg_scales: Sequence[torch.Tensor] | None = None,
                exp_avg_sq_scales: Sequence[torch.Tensor] | None = None,
                master_seeds: Sequence[int] | None = None) -> bool:
    """``adam_step`` over bf16 or int8 moments (their dtype says which); True if a scaled gradient
    was not finite. int8 moments need ``exp_avg_scales`` and ``exp_avg_sq_scales``.

    ``params`` float32, or bfloat16 masters stored back by stochastic rounding ([Note: a bf16
    master] in ``csrc/ofl_adam.h``): each then needs its ``master_seeds`` entry (a 64-bit
    integer naming the tensor; the rounding of an element depends on it, its index and the
    step count only), and its moments may also be float32."""
    n = len(params)
    master = params[0].dtype if n else torch.float32
    if master not in (torch.float32, torch.bfloat16):
        raise ConfigError(f"params have dtype {master}; a master is float32 or bfloat16")
    if master is torch.bfloat16 and (master_seeds is None or len(master_seeds) != n):
        raise ConfigError(f"bfloat16 masters need one master_seeds entry each ({n}), "
                          f"got {'none' if master_seeds is None else len(master_seeds)}")
    moments = {torch.bfloat16: StateDtype.BF16, torch.uint8: StateDtype.INT8}
    if master is torch.bfloat16:  # a bf16 master also takes float32 moments (a bfloat16 model's)
        moments[torch.float32] = StateDtype.FP32
    sd = moments.get(exp_avgs[0].dtype) if n else None
    if n and sd is None:
        raise ConfigError(f"exp_avgs have dtype {exp_avgs[0].dtype}; supported: float32, bfloat16, uint8 (int8 codes)")
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "steps": steps}
    if params_out is not None:
        lists["params_out"] = params_out
    if sd is StateDtype.INT8:
        if exp_avg_scales is None or exp_avg_sq_scales is None:
            raise ConfigError("int8 moments need exp_avg_scales and exp_avg_sq_scales")
        lists.update(exp_avg_scales=exp_avg_scales, exp_avg_sq_scales=exp_avg_sq_scales)
    for what, seq in lists.items():
        if len(seq) != n:
            raise ConfigError(f"{what} has {len(seq)} tensors, params has {n}")
    if n == 0:
        return False
    numels = [p.numel() for p in params]
    f32 = torch.float32
    keep = [address_array(params, "params", master, None), address_array(grads, "grads", grads[0].dtype, numels),
            address_array(exp_avgs, "exp_avgs", sd.moment_dtype, numels),
            address_array(exp_avg_sqs, "exp_avg_sqs", sd.moment_dtype, numels)]
    zeros = array.array("Q", [0] * n)
    if sd is StateDtype.INT8:
        blocks = [scale_count(k) for k in numels]
        keep += [address_array(exp_avg_scales, "exp_avg_scales", f32, blocks),
                 address_array(exp_avg_sq_scales, "exp_avg_sq_scales", f32, blocks)]
    else:
        keep += [zeros, zeros]
    grad_code = dtype_code(grads, "grads")
    out_code = lib.OFL_DTYPE_NONE
    if params_out is not None:
        out_code = dtype_code(params_out, "params_out")
        keep.append(address_array(params_out, "params_out", params_out[0].dtype, numels))
    else:
        keep.append(zeros)
    keep.append(address_array(steps, "steps", f32, [1] * n))
    numel_arr = array.array("q", numels)
    bufs = [ffi.from_buffer("uint64_t[]", a) for a in keep]
    tens = ffi.new("ofl_adam_qtensors *")
    (tens.param, tens.grad, tens.exp_avg, tens.exp_avg_sq, tens.exp_avg_scale, tens.exp_avg_sq_scale,
     tens.param_out, tens.step) = bufs
    numel_buf = ffi.from_buffer("int64_t[]", numel_arr)
    tens.numel = numel_buf
    tens.count = n
    cfg = config_struct(config, grad_scale, grad_code, out_code)
    nonfinite = ffi.new("int32_t *")
    if master is torch.float32:
        raise_errno(lib.ofl_adam_step_q(cfg, _CODES[sd], tens, nonfinite), "ofl_adam_step_q")
    else:
        seeds = ffi.from_buffer("uint64_t[]", array.array("Q", [int(s) & _U64 for s in master_seeds]))
        raise_errno(lib.ofl_adam_step_qm(cfg, _CODES[sd], lib.OFL_DTYPE_BF16, tens, seeds, nonfinite),
                    "ofl_adam_step_qm")
    return bool(nonfinite[0])


_U64 = (1 << 64) - 1


def bf16_round_sr(x: torch.Tensor, *, seed: int, step: int, first: int = 0, isa: str | None = None) -> torch.Tensor:
    """float32 ``x`` rounded to bfloat16 as a bf16 master's step rounds elements ``first`` ..
    ``first + numel - 1`` of the tensor of ``seed`` at step count ``step``."""
    n = x.numel()
    _flat_check(x, "x", torch.float32, n)
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    rc = lib.ofl_bf16_round_sr(ffi.cast("float *", x.data_ptr()), ffi.cast("uint16_t *", out.data_ptr()), n,
                               int(seed) & _U64, int(step), int(first), resolve_isa(isa))
    raise_errno(rc, "ofl_bf16_round_sr")
    return out
