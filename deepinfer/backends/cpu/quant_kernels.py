"""The cpu weight ops for weights stored narrower than float32: bf16 / f16 matrices and
backends/quant.py's QuantizedWeight (FP8 e4m3 block-scaled, FP4 e2m1 per-32), through
quant_ops.cpp (compiled with the other kernels, kernels.py).

Activations stay float32 and the weight is widened in registers (weight-only dequantization), so
on this backend a quantized model computes what its dequantized float32 copy computes, up to
rounding order. A QuantizedWeight whose `act` asks for activation quantization (V4.1) gets its
input quantized first (quant.act_quant), as on every backend.

Decode-sized calls stream the weight once through the GEMV kernels. Past `MAX_TOKENS` rows a call
widens the weight one cache-sized tile of rows at a time (quant_ops.cpp, one rounding per value: the
dequantized weight bit for bit) and runs MKL's GEMM on each tile while it is in cache: prefill and
large decode batches are bound by arithmetic, where a blocked GEMM wins. Batch-invariant mode lifts the limit (a switch by batch size would change a row's
rounding). Each op returns None for an input it does not take; kernels.py then uses the reference.
"""

from __future__ import annotations

import math

import torch

from deepinfer.backends import reference as ops
from deepinfer.backends.quant import FP8, QuantizedWeight, Weight, act_quant

_F32 = torch.float32
_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # quant_ops.cpp's Format
_FP8, _FP4 = 3, 4
# Rows up to which the GEMV kernels beat widening + MKL (python benchmarks/quant_kernels.py
# --crossover): see MAX_TOKENS's measurement there.
MAX_TOKENS = 16
# float32 bytes of weight rows widened per tile on the GEMM path: a tile stays in cache between its
# widening and its GEMM. 512 KB was the fastest of 128 KB / 512 KB / 2 MB at V4-Flash shapes (a one-off
# run on the loaded machine); against the 8 MB chunks widened into memory before, 1.1-1.9x at 16-32
# rows and about even at 64 (benchmarks/quant_kernels.py --crossover, quiet).
_WIDEN_TILE_BYTES = 512 << 10
# Rows per routed expert past which its GEMMs go widened + MKL (moe_experts' gemm_from_rows).
# `python benchmarks/quant_kernels.py --experts-crossover`, FP4 experts 8 x 256 x 256, top-2, 2
# threads, GEMV tiles vs widened: even at 16 rows per expert (1.21 vs 1.24 ms), 1.4x at 32, 2x at 128;
# with V4.1's rounding points the same (1.11 vs 1.05, 2.05 vs 1.39 ms); at V4.1-Flash's shape about
# even from 16 to 32 rows, run to run. 32 keeps decode batches (a few rows per expert) on the GEMV
# tiles, whose bits do not depend on the batch, even when routing is uneven.
MOE_GEMM_FROM_ROWS = 32


def is_plain_f32(w: Weight) -> bool:
    return isinstance(w, torch.Tensor) and w.dtype == _F32


def weight_args(w: Weight) -> tuple | None:
    """(data, scale, [format, b0, b1]) as quant_ops.cpp takes a weight, or None for one it does not."""
    if isinstance(w, QuantizedWeight):
        return w.data, w.scale, [_FP8 if w.format == FP8 else _FP4, *w.block]
    code = _FORMATS.get(w.dtype)
    return None if code is None else (w, None, [code, 1, 1])


def _input(x: torch.Tensor, w: Weight) -> torch.Tensor:
    if not isinstance(w, QuantizedWeight) or w.act is None:
        return x
    if w.act.pow2 and x.dtype == _F32 and x.dim() and x.shape[-1] % w.act.block == 0:
        # act_quant's power-of-two form in one C++ pass (no bf16 rounding first: act_quant takes any
        # float32), bit for bit (tests/unit/test_quant_kernels.py)
        return torch.ops.deepinfer_cpu.fp8_qdq(x, w.act.block, False)
    return act_quant(x, w.act)


def fp8_qdq(x: torch.Tensor, block: int) -> torch.Tensor | None:
    """Accelerator.fp8_qdq in one C++ pass, bit-exact; None for an input it does not take."""
    if x.dtype != _F32 or x.dim() == 0 or block < 1 or x.shape[-1] % block:
        return None
    return torch.ops.deepinfer_cpu.fp8_qdq(x, block, True)


def _widened_linear(x2: torch.Tensor, args: tuple, n: int, k: int) -> torch.Tensor:
    """x2 [T, K] @ weight.T with the weight widened one cache-sized tile of rows at a time, each tile an
    MKL GEMM (quant_ops.cpp qlinear_widened)."""
    return torch.ops.deepinfer_cpu.qlinear_widened(x2, *args, _WIDEN_TILE_BYTES)


def linear(x: torch.Tensor, weight: Weight, max_tokens: float = MAX_TOKENS) -> torch.Tensor | None:
    args = weight_args(weight)
    if args is None or x.dtype != _F32 or x.dim() == 0:
        return None
    n, k = weight.shape
    x2 = _input(x, weight).reshape(-1, k)
    if x2.shape[0] > max_tokens:
        out = _widened_linear(x2, args, n, k)
    else:
        out = torch.ops.deepinfer_cpu.qlinear(x2, *args)
    return out.view(*x.shape[:-1], n)


def grouped_linear(x: torch.Tensor, weight: Weight, max_tokens: float = MAX_TOKENS) -> torch.Tensor | None:
    args = weight_args(weight)
    if args is None or x.dtype != _F32 or x.dim() != 3 or x.shape[0] > max_tokens:
        return None
    return torch.ops.deepinfer_cpu.qgrouped_linear(_input(x, weight), *args)


def swiglu_mlp(x: torch.Tensor, gate_up: Weight, down: Weight, limit: float,
               max_tokens: float = MAX_TOKENS) -> torch.Tensor | None:
    gu, dn = weight_args(gate_up), weight_args(down)
    if gu is None or dn is None or x.dtype != _F32 or x.dim() != 2:
        return None
    if x.shape[0] > max_tokens or any(isinstance(w, QuantizedWeight) and w.act for w in (gate_up, down)):
        gate, up = linear(x, gate_up, max_tokens).chunk(2, dim=-1)
        return linear(ops.swiglu(gate, up, limit), down, max_tokens)
    return torch.ops.deepinfer_cpu.qswiglu_mlp(x, *gu, *dn, limit)


def moe_experts(x, weights, ids, gate_up: Weight, down: Weight, limit: float, bf16_acts: bool = False,
                act_block: int = 0, gemm_from_rows: float = math.inf) -> torch.Tensor | None:
    """moe_experts, or with `bf16_acts` moe_experts_bf16 (act_block as there), in one C++ call. An expert
    with more than `gemm_from_rows` rows (prefill) goes through its widened tiles and MKL's GEMM instead
    of the GEMV tiles: ~3x faster there, its rows rounded differently."""
    gu, dn = weight_args(gate_up), weight_args(down)
    if gu is None or dn is None or x.dtype != _F32 or x.shape[0] == 0 or gate_up.dim() != 3:
        return None
    if any(isinstance(w, QuantizedWeight) and w.act for w in (gate_up, down)):
        return None  # a weight that quantizes its own input: the reference applies it per GEMM
    if act_block and (x.shape[-1] % act_block or down.shape[-1] % act_block):
        return None
    gemm_from = -1 if gemm_from_rows == math.inf else int(gemm_from_rows)
    return torch.ops.deepinfer_cpu.qmoe_experts(x, weights, ids, *gu, *dn, limit, bf16_acts, act_block, gemm_from,
                                                _WIDEN_TILE_BYTES)


def route_topk(x, gate: Weight, bias, top_k, scaling):
    args = weight_args(gate)
    if args is None or x.dtype != _F32 or isinstance(gate, QuantizedWeight) and gate.act:
        return None
    return tuple(torch.ops.deepinfer_cpu.qroute_topk(x, *args, bias, top_k, scaling))


def route_hash(x, gate: Weight, ids, scaling):
    args = weight_args(gate)
    if args is None or x.dtype != _F32 or isinstance(gate, QuantizedWeight) and gate.act:
        return None
    return torch.ops.deepinfer_cpu.qroute_hash(x, *args, ids, scaling)

