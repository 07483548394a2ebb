"""DeepSeek's FP8 block-scaled GEMM (the nvidia backend's linear on an FP8 QuantizedWeight,
fp8.quantized_linear): the Triton kernels against the cpu reference's linear on the same weight.

Runs through the Triton interpreter on CPU tensors (conftest sets TRITON_INTERPRET=1). Ragged T in
(1, 7, 33), N and K not multiples of 128 (partial scale blocks), weight rows and activation groups
of very different magnitudes (a wrong scale index shows), outputs poisoned with NaN (`alloc.poison`).

| check                                    | tolerance                  | measured                  |
|------------------------------------------|----------------------------|---------------------------|
| act_quant: e4m3 bytes and scales         | bit-identical              | identical                 |
| act_quant: every e4m3 value, tie, +-ulp  | bit-identical              | identical                 |
| kernel vs reference, both GEMM paths     | 1e-5 x max|ref|            | <= 5.4e-7                 |
| reference vs fp32 GEMM, unquantized w    | 0.08 x max|fp32| (max err) | 0.036                     |
|                                          | 0.06 x rms(fp32) (rms err) | 0.037                     |
| one row alone vs in a batch of 9         | bit-identical              | identical                 |

Kernel vs reference differ only in rounding order (the kernel scales each 128-wide partial sum, the
reference dequantizes first), because the quantized activations are bit-identical. The quantization
error is e4m3's 3 mantissa bits on both operands (|rel| <= 1/16 per value), averaged over K.
Interpreted runtime ~10 s (`pytest -s` prints each error).
On a GPU (TRITON_INTERPRET=0), tl.dot on fp8 operands accumulates each 128-wide block in the tensor
core's reduced-precision accumulator: that path is held to fp8.FP8_DOT_TOL = 2e-3 (a stated bound,
not yet measured on a GPU; benchmarks/gpu_kernels.py prints it at DeepSeek-V4 shapes).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the nvidia backend's kernels cannot run")

from deepinfer.backends import reference as ref  # noqa: E402
from deepinfer.backends.quant import FP8, ActQuant, QuantizedWeight  # noqa: E402
from deepinfer.backends.triton import fp8  # noqa: E402
from deepinfer.backends.triton.fp8 import FP8_DOT_TOL  # noqa: E402
from op_checks import poisoned, seeded  # noqa: E402

TOL = 1e-5
QUANT_TOL_MAX, QUANT_TOL_RMS = 0.08, 0.06
TOKENS = (1, 7, 33)
SHAPES = ((200, 300), (64, 128), (130, 257), (17, 40))  # (N, K)


@pytest.fixture(scope="module")
def nv():
    yield from poisoned("nvidia")


def _inputs(gen, t, n, k):
    """Activations whose 128-groups and weights whose 128-row blocks differ in scale by up to 100x."""
    x = torch.randn(t, k, generator=gen) * torch.logspace(0, 2, -(-k // 128)).repeat_interleave(128)[:k]
    w = torch.randn(n, k, generator=gen) * 0.05 * torch.logspace(0, -2, -(-n // 128)).repeat_interleave(128)[:n, None]
    return x, w


def _weight(w: torch.Tensor) -> QuantizedWeight:
    """w in DeepSeek's FP8 layout (128x128 blocks, float32 scales) with the GEMM's own activation
    quantization (per 1 x 128, scale amax / 448) stated, so the reference computes the same math."""
    wq, ws = ref.fp8_block_quant(w, (128, 128))
    return QuantizedWeight(wq, ws, FP8, (128, 128), ActQuant(128, pow2=False))


def _rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    out = out.cpu()
    assert out.shape == expected.shape, f"shape {tuple(out.shape)} != {tuple(expected.shape)}"
    assert not out.isnan().any(), "NaN in output (an element the kernel did not write?)"
    return float((out - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("k", (128, 300, 40))
def test_act_quant_matches_reference_bits(nv, t, k):
    gen = seeded(1, t, k)
    x, _ = _inputs(gen, t, 1, k)
    x[0, : min(k, 128)] = 0.0  # an all-zero group: the 1e-4 amax floor, not 0/0
    q, s = fp8.act_quant(x.to(nv.device))
    rq, rs = ref.fp8_block_quant(x, (1, 128))
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s.cpu(), rs)


def test_act_quant_rounding_edge_cases(nv):
    """Every e4m3 value, every midpoint between neighbours (ties to even), one ulp either side,
    subnormals, both signs. Each 128-group starts with 448 so its scale is exactly 1."""
    codes = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (codes[:-1] + codes[1:]) / 2
    up, down = torch.full_like(mids, 1e9), torch.full_like(mids, -1e9)
    vals = torch.cat([codes, mids, torch.nextafter(mids, up), torch.nextafter(mids, down), codes / 3])
    vals = torch.cat([vals, -vals])
    groups = -(-vals.numel() // 127)
    body = torch.zeros(groups * 127)
    body[: vals.numel()] = vals
    x = torch.cat([torch.full((groups, 1), 448.0), body.view(groups, 127)], dim=1).view(1, -1)
    q, s = fp8.act_quant(x.to(nv.device))
    assert bool((s == 1.0).all())
    assert torch.equal(q.cpu().view(torch.uint8), ref.fp8_block_quant(x, (1, 128))[0].view(torch.uint8))


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("fp8_dot", (True, False))
def test_fp8_linear(nv, t, n, k, fp8_dot):
    if fp8_dot and nv.device.type == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("tl.dot on fp8 operands needs fp8 tensor cores (sm_89+)")
    tol = FP8_DOT_TOL if fp8_dot and nv.device.type == "cuda" else TOL
    gen = seeded(2, t, n, k)
    x, w = _inputs(gen, t, n, k)
    weight = _weight(w)
    expected = ref.linear(x, weight)
    out = fp8.quantized_linear(x.to(nv.device), weight.to(nv.device), fp8_dot=fp8_dot)
    err = _rel_err(out, expected)
    print(f"\nfp8 linear T={t} N={n} K={k} fp8_dot={fp8_dot}: max rel err {err:.2e} (tol {tol:.0e})", end="")
    assert err <= tol


def test_fp8_linear_leading_dims_and_empty(nv):
    gen = seeded(3)
    x, w = _inputs(gen, 15, 24, 140)
    weight = _weight(w)
    x3 = x.view(3, 5, 140)
    tol = FP8_DOT_TOL if nv.device.type == "cuda" else TOL
    assert _rel_err(nv.linear(x3.to(nv.device), weight.to(nv.device)), ref.linear(x3, weight)) <= tol
    empty = nv.linear(torch.zeros(0, 140, device=nv.device), weight.to(nv.device))
    assert empty.shape == (0, 24)


def test_quantization_error_vs_fp32_gemm():
    """What FP8 costs against the float32 GEMM on the unquantized weights (the reference alone)."""
    gen = seeded(4)
    x = torch.randn(33, 512, generator=gen)
    w = torch.randn(256, 512, generator=gen) * 0.05
    exact = x @ w.T
    out = ref.linear(x, _weight(w))
    max_err = float((out - exact).abs().max() / exact.abs().max())
    rms_err = float((out - exact).square().mean().sqrt() / exact.square().mean().sqrt())
    print(f"\nfp8 quantization error vs fp32: max {max_err:.3f} (tol {QUANT_TOL_MAX}), "
          f"rms {rms_err:.3f} (tol {QUANT_TOL_RMS})", end="")
    assert max_err <= QUANT_TOL_MAX and rms_err <= QUANT_TOL_RMS
    assert rms_err > 1e-3  # the weights really were quantized (a no-op quantizer would pass above)


def test_fp8_linear_batch_invariant(nv):
    gen = seeded(5)
    x, w = _inputs(gen, 9, 72, 200)
    weight = _weight(w).to(nv.device)
    x = x.to(nv.device)
    alone = torch.cat([nv.linear(x[r:r + 1], weight) for r in range(9)])
    assert torch.equal(nv.linear(x, weight), alone)
