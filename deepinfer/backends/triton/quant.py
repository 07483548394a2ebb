"""DeepSeek-V4.1's quantize-dequantize points: FP8 e4m3 with power-of-two (E8M0) scales per group
(GEMM inputs, window KV) and FP4 e2m1 with E8M0 (indexer) or E4M3 (compressed KV) scales.

Bit-exact to the reference (backends/reference.py: fp8_qdq / fp4_qdq) on every device: every
rounding is done with float32 operations that are exact (scaling by powers of two, floor,
comparisons) or with integer operations on the bits: the bf16 rounding of the input, the scale's
exponent, round-to-nearest-even on the target grid. No hardware conversion instruction is used,
so the Triton interpreter (whose fp8 cast is wrong: backends/triton/fp8.py) computes the same.
One program quantizes GROUPS groups; each group's result depends on that group alone (batch
invariant).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.backends.triton import alloc

_GROUPS = 16  # groups per program
_FP8_MAX_INV = float(torch.tensor(1 / 448, dtype=torch.float32))  # the float32 constant DeepSeek multiplies by
_FP4_MAX_INV = float(torch.tensor(1 / 6, dtype=torch.float32))
# float32(1e-4) (the reference's clamp_min(1e-4) on float32), made once here: a tensor made per call
# would be a host value inside a recorded step (core/graphs.py), and the step would stay eager
_FP8_AMAX_FLOOR = float(torch.tensor(1e-4, dtype=torch.float32))


@triton.jit
def _pow2(e):
    """2^e as float32 for int32 e in [-126, 127], from the bits."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _bf16(x):
    """float32 -> the nearest bfloat16 value (ties to even), as float32."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _exponent(x):
    """floor(log2 |x|) of a normal float32 (-127 for zero)."""
    return ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def _round_grid(v, MIN_EXP: tl.constexpr, MANT: tl.constexpr):
    """v rounded to the float grid with MANT mantissa bits and exponents >= MIN_EXP (subnormal below),
    to nearest, ties to even. |v| must stay below the format's largest binade end."""
    a = tl.abs(v)
    e = tl.maximum(_exponent(a), MIN_EXP)
    t = a * _pow2(MANT - e)  # exact: a power of two
    low = tl.floor(t)
    frac = t - low
    odd = (low - 2.0 * tl.floor(low * 0.5)) == 1.0
    r = (low + tl.where((frac > 0.5) | ((frac == 0.5) & odd), 1.0, 0.0)) * _pow2(e - MANT)
    sign = (v.to(tl.int32, bitcast=True) >> 31) << 31  # the sign bit alone (negation may lose -0)
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _ceil_pow2(x):
    """2^ceil(log2 x) for a positive normal float32 x: its exponent, plus one if a mantissa bit is set."""
    bits = x.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _qdq_kernel(x_ptr, out_ptr, num_groups, max_inv, amax_floor, FP4: tl.constexpr, E4M3_SCALE: tl.constexpr,
                BLOCK: tl.constexpr, GROUPS: tl.constexpr):
    g = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)
    i = tl.arange(0, BLOCK)
    offs = g[:, None] * BLOCK + i[None, :]
    mask = (g < num_groups)[:, None]
    x = _bf16(tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32))
    amax = tl.max(tl.abs(x), axis=1)
    if FP4:
        if E4M3_SCALE:
            s = _round_grid(tl.minimum(tl.div_rn(tl.maximum(amax, amax_floor), 6.0), 448.0), -6, 3)
        else:
            s = _ceil_pow2(tl.maximum(amax, amax_floor) * max_inv)
        v = tl.minimum(tl.maximum(tl.div_rn(x, s[:, None]), -6.0), 6.0)
        y = _round_grid(v, 0, 1) * s[:, None]
    else:
        s = _ceil_pow2(tl.maximum(amax, amax_floor) * max_inv)
        v = tl.minimum(tl.maximum(tl.div_rn(x, s[:, None]), -448.0), 448.0)
        y = _round_grid(v, -6, 3) * s[:, None]
    tl.store(out_ptr + offs, y, mask=mask)


def _qdq(x: torch.Tensor, block: int, fp4: bool, e4m3_scale: bool) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the quantization group {block}")
    xc = x.contiguous()
    out = alloc.empty(*x.shape, dtype=torch.float32, device=x.device)
    groups = xc.numel() // block
    if groups:
        floor = (6 * 2.0 ** -9 if e4m3_scale else 6 * 2.0 ** -126) if fp4 else _FP8_AMAX_FLOOR
        _qdq_kernel[(triton.cdiv(groups, _GROUPS),)](xc, out, groups, _FP4_MAX_INV if fp4 else _FP8_MAX_INV, floor,
                                                     FP4=fp4, E4M3_SCALE=e4m3_scale, BLOCK=block, GROUPS=_GROUPS)
    return out


def fp8_qdq(x: torch.Tensor, block: int) -> torch.Tensor:
    return _qdq(x, block, False, False)


def fp4_qdq(x: torch.Tensor, block: int, e4m3_scale: bool = False) -> torch.Tensor:
    return _qdq(x, block, True, e4m3_scale)
