"""A numpy reference of the compressed-state kernels, written from the rules in csrc/ofl_adam.h
([Note: quantized Adam states]) and csrc/adam_q8.h, not from the C: the maps built from their
definition, the nearest code by a sorted search over the midpoints, and the update with a
correctly rounded fused multiply-add (round-to-odd in float64, then to float32)."""
from __future__ import annotations

import math

import numpy as np

BLOCK = 256
F32 = np.float32


def magnitudes(decades: int) -> np.ndarray:
    """0, then per decade d (smallest first) 2^(decades-1-d) values (0.1 + 0.9 (j+1)/c) / 10^d."""
    out = [0.0]
    for d in range(decades - 1, -1, -1):
        levels = 2 ** (decades - 1 - d)
        out += [(0.1 + 0.9 * (j + 1) / levels) / 10.0 ** d for j in range(levels)]
    return np.array(out, dtype=np.float64).astype(F32)


SIGNED_MAG = magnitudes(7)  # 128
UNSIGNED = magnitudes(8)  # 256
SIGNED = np.concatenate([SIGNED_MAG, -SIGNED_MAG]).astype(F32)


def _mids(mag: np.ndarray) -> np.ndarray:
    m = mag.astype(np.float64)
    return ((m[:-1] + m[1:]) * 0.5).astype(F32)


def _decades(decades: int) -> dict:
    """The constants of the code rule (csrc/adam_q8.h, [Note: the code of a value])."""
    return dict(thr=np.array([1.0 / 10.0 ** (d + 1) for d in range(decades)], dtype=F32),
                gain=np.array([10.0 ** d * 2 ** (decades - 1 - d) / 0.9 for d in range(decades)], dtype=F32),
                offset=np.array([(2 ** (decades - 1 - d) - 1) - 0.1 * 2 ** (decades - 1 - d) / 0.9
                                 for d in range(decades)], dtype=F32),
                decades=decades)


SIGNED_DEC, UNSIGNED_DEC = _decades(7), _decades(8)


def quantize_block(x: np.ndarray, signed: bool) -> tuple[np.ndarray, F32]:
    x = x.astype(F32)
    absbits = x.view(np.uint32) & np.uint32(0x7FFFFFFF)
    scale = np.uint32(absbits.max()).view(F32) if x.size else F32(0)
    inv = F32(1) / scale if scale > 0 else F32(0)
    with np.errstate(invalid="ignore", over="ignore"):
        a = absbits.view(F32) * inv
    a = np.where(a < F32(1), a, F32(1))  # NaN -> 1
    dec = SIGNED_DEC if signed else UNSIGNED_DEC
    d = sum((a <= dec["thr"][k]).astype(np.int64) for k in range(dec["decades"] - 1))
    s = fma32(a, dec["gain"][d], dec["offset"][d])
    idx = np.clip(np.rint(s).astype(np.int64), 0, 127 if signed else 255).astype(np.uint32)
    if signed:
        idx |= (x.view(np.uint32) >> np.uint32(24)) & np.uint32(0x80)
    else:
        idx = np.where((idx == 0) & (x > 0), np.uint32(1), idx)
    return idx.astype(np.uint8), F32(scale)


def quantize(x: np.ndarray, signed: bool) -> tuple[np.ndarray, np.ndarray]:
    parts = [quantize_block(x[i:i + BLOCK], signed) for i in range(0, x.size, BLOCK)]
    codes = np.concatenate([c for c, _ in parts]) if parts else np.zeros(0, np.uint8)
    return codes, np.array([s for _, s in parts], dtype=F32)


def dequantize(codes: np.ndarray, scales: np.ndarray, signed: bool) -> np.ndarray:
    table = SIGNED if signed else UNSIGNED
    return (table[codes] * np.repeat(scales, BLOCK)[:codes.size]).astype(F32)


def fma32(a, b, c) -> np.ndarray:
    """float32 fma(a, b, c), correctly rounded: a*b is exact in float64, the sum is rounded to odd."""
    a, b, c = (np.asarray(t, dtype=F32).astype(np.float64) for t in (a, b, c))
    p = a * b
    s = p + c
    bb = s - p
    e = (p - (s - bb)) + (c - bb)  # the sum's rounding error (TwoSum)
    even = (s.view(np.int64) & 1) == 0
    fix = (e != 0) & even & np.isfinite(s) & np.isfinite(e)
    s = np.where(fix, np.nextafter(s, np.where(e > 0, np.inf, -np.inf)), s)
    return s.astype(F32)


def coeffs(*, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction, step, grad_scale):
    bc1 = 1.0 - beta1 ** step if bias_correction else 1.0
    bc2 = 1.0 - beta2 ** step if bias_correction else 1.0
    return dict(b1=F32(beta1), omb1=F32(1.0 - beta1), b2=F32(beta2), omb2=F32(1.0 - beta2), eps=F32(eps),
                step=F32(lr / bc1), ibc2=F32(1.0 / math.sqrt(bc2)),
                decay=F32(1.0 - lr * weight_decay) if adamw_mode else F32(1),
                l2=F32(0) if adamw_mode else F32(weight_decay), gscale=F32(grad_scale))


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest bfloat16 (ties to even), widened back to float32 (finite inputs)."""
    b = x.astype(F32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16
    return b.astype(np.uint32).view(F32)


def step(p, g, m0, v0, c) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One element-wise update from dequantized moments; returns the new (p, m, v) in float32."""
    with np.errstate(over="ignore", invalid="ignore"):
        g = g.astype(F32) * c["gscale"]
        if c["l2"] != 0:
            g = fma32(c["l2"], p, g)
        m = fma32(c["b1"], m0, c["omb1"] * g)
        v = fma32(c["b2"], v0, (c["omb2"] * g) * g)
        den = fma32(np.sqrt(v), c["ibc2"], c["eps"])
        p = fma32(-c["step"], m / den, p * c["decay"])
    return p, m, v


# ---- a bf16 master's stochastic rounding ([Note: a bf16 master] in csrc/ofl_adam.h) ----

def _fmix32(h: np.ndarray) -> np.ndarray:
    h = np.asarray(h, dtype=np.uint64) & 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 16
    return h


def sr_key(seed: int, step: int) -> int:
    seed &= (1 << 64) - 1
    h = int(_fmix32(np.uint64(((seed >> 32) ^ 0x5BD1E995) & 0xFFFFFFFF)))
    h = int(_fmix32(np.uint64(h ^ (seed & 0xFFFFFFFF))))
    return int(_fmix32(np.uint64((h + step * 0x27D4EB2F) & 0xFFFFFFFF)))


def bf16_round_sr(x: np.ndarray, seed: int, step: int, first: int = 0) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16): x + (random 16 bits) truncated, NaN -> quiet NaN. One hash a
    pair of elements (j // 2): its high half for the even element, its low half for the odd one."""
    bits = x.astype(F32).view(np.uint32).astype(np.uint64)
    j = np.arange(first, first + x.size, dtype=np.uint64) & 0xFFFFFFFF
    h = _fmix32(((j >> 1) * 0x9E3779B1 + sr_key(seed, step)) & 0xFFFFFFFF)
    r = np.where(j & 1, h & 0xFFFF, h >> 16)
    out = ((bits + r) >> 16) & 0xFFFF
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    out = np.where(nan, (bits >> 16) | 0x40, out)
    return out.astype(np.uint16)


def bf16_widen(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(F32)
