"""FP8 block-scaled GEMM (DeepSeek's fp8_gemm): y = act_quant(x) @ w_q.T with 128x128 weight scales.

Two kernels: `_act_quant_kernel` quantizes activations per token per 1 x block group (scale =
max(amax, 1e-4) / 448, e4m3fn bytes), `_fp8_gemm_kernel` multiplies BLOCK_M x block activation tiles
by BLOCK_N x block weight tiles, one K step per scale block, and folds each step's fp32 partial sum
into the accumulator times x_scale[t, kb] * w_scale[nb, kb] (DeepGEMM's "promotion" every 128 K:
the tensor core's fp8 accumulator never sums more than one block).

Triton interpreter (CI) findings, triton 3.7: loading float8_e4m3fn from CPU tensors is exact and
tl.dot on fp8 operands works (it upcasts), but the fp32 -> fp8e4nv cast is wrong (no carry when
rounding overflows the mantissa, 1.99 -> 1.0; subnormals truncated). So the quantizer has two paths
behind a constexpr: NATIVE_CVT (on a GPU: the hardware cvt.rn.satfinite) and a bit-exact integer
encoder (round to nearest even, saturating at 448) used under the interpreter. Both store raw
bytes (uint8) that the host views as float8_e4m3fn. The GEMM's FP8_DOT path (tl.dot on fp8
operands, sm_89+) and its fp32 path (upcast, IEEE fp32 dot) both run under the interpreter.

Batch invariance: tiles depend on the weight shape only; each token's groups, scales and dot
products never see another row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.backends.quant import FP8, QuantizedWeight
from deepinfer.backends.triton import alloc

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4  # DeepSeek's act_quant guard: an all-zero group gets a finite scale
# Stated bound (max |y - ref| / max |ref|) for the FP8_DOT path on a GPU: Hopper's fp8 MMA keeps
# ~14 bits while accumulating (DeepSeek-V3 report, sec. 3.3.2); a 128-wide block is 4 k-steps,
# ~4 * 2^-14 = 2.4e-4 of the block's partial sum, and 8x margin over that. Measured on an H200 at
# V4-Flash shapes: 1.4e-4 (64 tokens), 1.6e-4 (2048) (benchmarks/results/gpu_kernels_h200.json).
# Elsewhere (the fp32 path, the interpreter) the kernel meets 1e-5.
FP8_DOT_TOL = 2e-3


def tiles(n: int, k: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for a weight [n, k]; the K tile is the scale block. Never keyed on T."""
    return 64, 128 if n >= 128 else max(16, triton.next_power_of_2(n))


@triton.jit
def _e4m3_bits(v):
    """float32 -> float8_e4m3fn bit pattern (int32), round to nearest even, |v| > 448 saturates.
    Integer-only, so it is exact under the interpreter (whose fp8 cast is not)."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # normals (|v| >= 2^-6): round the 23-bit mantissa to 3 bits; a carry moves into the exponent
    r = a + 0x7FFFF + ((a >> 20) & 1)
    normal = (r >> 20) - (120 << 3)  # rebias 127 -> 7
    # subnormals (|v| < 2^-6): m = rne(|v| * 2^9) from the 24-bit significand
    exp = a >> 23
    full = (a & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum(141 - exp, 1), 31)  # 14 - (exp - 127): >= 21 where used
    q = full >> shift
    rem = full & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    code = tl.where(a < 0x3C800000, sub, tl.minimum(normal, 0x7E))
    code = tl.where(a > 0x7F800000, 0x7F, code)  # NaN
    return code | sign


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, K, KB, stride_x, amax_floor,
                      BLOCK: tl.constexpr, NATIVE_CVT: tl.constexpr, POW2: tl.constexpr):
    """One (token, K group) per program: s = max(amax, floor) / 448, q = e4m3(x / s). POW2: s rounded
    up to a power of two from the bits of amax * float32(1/448) (DeepSeek's fast_round_scale)."""
    t, kb = tl.program_id(0), tl.program_id(1)
    k = kb * BLOCK + tl.arange(0, BLOCK)
    mask = k < K
    x = tl.load(x_ptr + t * stride_x + k, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), amax_floor)
    if POW2:
        bits = (amax * (1.0 / 448.0)).to(tl.int32, bitcast=True)
        exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        s = (exp << 23).to(tl.float32, bitcast=True)
    else:
        s = tl.div_rn(amax, 448.0)  # IEEE division, as torch's (Triton's `/` may be approximate)
    y = tl.div_rn(x, s)
    if NATIVE_CVT:
        q = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        q = _e4m3_bits(y).to(tl.uint8)
    tl.store(q_ptr + t * K + k, q, mask=mask)
    tl.store(s_ptr + t * KB + kb, s)


@triton.jit
def _fp8_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K, KB, SCALE_ROWS,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     FP8_DOT: tl.constexpr, E8M0: tl.constexpr):
    """c = sum_kb (a[:, kb] @ b[:, kb].T) * as[:, kb] * bs[n // SCALE_ROWS, kb]; a [M, K], b [N, K] fp8
    row-major, as [M, KB] float32, bs [cdiv(N, SCALE_ROWS), KB] float32 or ue8m0 bytes (E8M0).
    grid (m tiles, n tiles)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mmask, nmask = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, KB):
        kk = kb * BLOCK_K + rk
        kmask = kk < K
        a = tl.load(a_ptr + rm[:, None] * K + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptr + rn[None, :] * K + kk[:, None], mask=kmask[:, None] & nmask[None, :], other=0.0)
        if FP8_DOT:
            part = tl.dot(a, b)
        else:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        a_s = tl.load(as_ptr + rm * KB + kb, mask=mmask, other=0.0)
        b_s = tl.load(bs_ptr + (rn // SCALE_ROWS) * KB + kb, mask=nmask, other=0)
        if E8M0:
            b_s = e8m0_float(b_s)
        acc += part * a_s[:, None] * b_s[None, :]
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc, mask=mmask[:, None] & nmask[None, :])


@triton.jit
def e8m0_float(e):
    """ue8m0 exponent bytes -> float32 2^(e - 127), exactly (from the bits; 2^-127 for byte 0)."""
    e = e.to(tl.int32)
    return tl.where(e == 0, 5.877471754111438e-39, (e << 23).to(tl.float32, bitcast=True))


def act_quant(x: torch.Tensor, block: int = 128, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (float8_e4m3fn [T, K], float32 scales [T, cdiv(K, block)]), as the cpu
    reference's fp8_block_quant(x, (1, block)) (pow2: quant.act_quant's power-of-two scales)."""
    t, k = x.shape
    kb = triton.cdiv(k, block)
    x = x.contiguous()
    q = alloc.empty(t, k, dtype=torch.uint8, device=x.device)
    s = alloc.empty(t, kb, dtype=torch.float32, device=x.device)
    if t and k:
        _act_quant_kernel[(t, kb)](x, q, s, k, kb, x.stride(0), AMAX_FLOOR, BLOCK=block,
                                   NATIVE_CVT=x.device.type == "cuda", POW2=pow2)
    return q.view(torch.float8_e4m3fn), s


def _fp8_dot_default(device: torch.device) -> bool:
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def takes(weight: QuantizedWeight) -> bool:
    """Whether `quantized_linear` runs this weight: FP8 whose K block is a power of two >= 16 and,
    when the model quantizes activations itself (weight.act), in groups of that same K block."""
    b1 = weight.block[1]
    return (weight.format == FP8 and weight.dim() == 2 and b1 >= 16 and not b1 & (b1 - 1)
            and (weight.act is None or weight.act.block == b1))


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, fp8_dot: bool | None = None) -> torch.Tensor:
    """linear on an FP8 QuantizedWeight: activations quantized per token per 1 x block[1] group
    (DeepSeek's act_quant; power-of-two scales where weight.act asks for them), then the block
    GEMM. The reference: quant.act_quant then float32 math on the dequantized weight."""
    pow2 = weight.act.pow2 if weight.act is not None else False
    return _gemm(x, weight.data, weight.scale, weight.block, pow2, fp8_dot)


def _gemm(x, weight, scale, block: tuple[int, int], pow2: bool, fp8_dot: bool | None) -> torch.Tensor:
    b0, b1 = block
    if b1 < 16 or b1 & (b1 - 1):
        raise ValueError(f"FP8 linear: the K block {b1} must be a power of two >= 16")
    lead, k = x.shape[:-1], x.shape[-1]
    n = weight.shape[0]
    kb = triton.cdiv(k, b1)
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    out = alloc.empty(m, n, dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return out.view(*lead, n)
    x_q, x_s = act_quant(x2, b1, pow2)
    bm, bn = tiles(n, k)
    fp8_dot = _fp8_dot_default(x.device) if fp8_dot is None else fp8_dot
    _fp8_gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x_q, x_s, weight.contiguous(), scale.contiguous(), out, m, n, k, kb, b0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=b1, FP8_DOT=fp8_dot, E8M0=scale.dtype == torch.uint8)
    return out.view(*lead, n)
