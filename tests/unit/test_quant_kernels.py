"""The cpu backend's weight ops on narrow weights (quant_ops.cpp through kernels.py) against float32
math on the dequantized weight: every storage kind (bf16, f16, FP8 128x128 / 32x32 / refined row
blocks, FP4 with ue8m0 or float32 scales), K and N off the block edges, decode-sized calls (the
GEMV kernels) and large ones (widened chunks + MKL). Per-element bounds: tests/quant_checks.py.
A row's result must not depend on the batch it is computed in (the GEMV path)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.backends import reference as ref
from deepinfer.backends.cpu import kernels, quant_kernels
from deepinfer.backends.quant import ActQuant, QuantizedWeight, act_quant, quantize_fp8
from quant_checks import assert_within, dot_bound, moe_case, weight_kinds, widened

pytestmark = pytest.mark.skipif(not kernels.load(), reason="the cpu C++ kernels do not build here")

SHAPES = [(130, 258), (40, 96), (17, 40)]  # (N, K): K, N off the 128 and 32 blocks
KINDS = list(weight_kinds(torch.randn(40, 96)))


def _case(n, k, kind, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.1 * torch.logspace(0, -2, n)[:, None]  # row blocks of different size
    return weight_kinds(w)[kind]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("t", [1, 3, 40])
def test_linear(kind, n, k, t):
    w = _case(n, k, kind, n + k)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(t)) * torch.logspace(-1, 1, k)
    out = kernels.linear(x, w)
    wd = widened(w)
    assert_within(f"linear {kind} T={t} N={n} K={k}", out, x @ wd.T, dot_bound(x, wd))
    assert torch.equal(ref.linear(x, w), torch.nn.functional.linear(x, wd))  # the reference is that math


@pytest.mark.parametrize("kind", ["bf16", "fp8_128_f32", "fp4_ue8m0"])
def test_leading_dims_and_a_row_alone(kind):
    """A token's row is the same alone as in a batch of 7 (the GEMV path sums in one order)."""
    w = _case(72, 160, kind, 1)
    x = torch.randn(7, 160, generator=torch.Generator().manual_seed(2))
    batch = kernels.linear(x, w)
    assert torch.equal(torch.cat([kernels.linear(x[i:i + 1], w) for i in range(7)]), batch)
    assert torch.equal(kernels.linear(x.view(7, 1, 160), w).view(7, 72), batch)


@pytest.mark.parametrize("kind", ["bf16", "f16", "fp8_128_f32", "fp8_32_ue8m0", "fp4_ue8m0"])
@pytest.mark.parametrize("n,k", [(37, 100), (12, 258)])
def test_token_tiles_give_each_token_its_own_bits(kind, n, k):
    """quant_ops.cpp multiplies tiles of up to 3 tokens against a row group at once (and 2 or 1 for
    the rest); each token's dot keeps the single-token order, so every T from 1 to 9 gives every
    token the bits it gets alone, with K and blocks off the multiples of 8 (the tails), on 1 and 2
    threads."""
    w = _case(n, k, kind, 5)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(6))
    alone = torch.cat([kernels.linear(x[i:i + 1], w) for i in range(9)])
    threads = torch.get_num_threads()
    try:
        for nthreads in (1, 2):
            torch.set_num_threads(nthreads)
            for t in range(1, 10):
                assert torch.equal(kernels.linear(x[:t], w), alone[:t]), (kind, t, nthreads)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", ["bf16", "fp8_32_ue8m0", "fp4_ue8m0"])
def test_routed_experts_give_each_token_its_own_bits(kind):
    """An expert's rows go through the token tiles in groups of 3: a token's output is the same as
    when it is the only token of the call (so the same whatever the other tokens route to)."""
    x, weights, ids, gu, dn = moe_case(kind, 13, e=3, d=64, i=48)
    batch = kernels.moe_experts(x, weights, ids, gu, dn, 7.0)
    for row in range(13):
        alone = kernels.moe_experts(x[row:row + 1], weights[row:row + 1], ids[row:row + 1], gu, dn, 7.0)
        assert torch.equal(alone[0], batch[row]), (kind, row)


def test_prefill_sized_experts_switch_to_gemm_except_when_batch_invariant():
    """Past MOE_GEMM_FROM_ROWS rows an expert's GEMMs run widened + MKL in the fast mode (a row's bits
    then depend on the batch: seen here as a differing row) and never in batch-invariant mode."""
    x, weights, ids, gu, dn = moe_case("fp4_ue8m0", 120, e=3, d=64, i=48)
    invariant = kernels.batch_invariant_ops()["moe_experts"]
    fast_batch = kernels.moe_experts(x, weights, ids, gu, dn, 7.0)
    inv_batch = invariant(x, weights, ids, gu, dn, 7.0)
    alone = torch.cat([kernels.moe_experts(x[r:r + 1], weights[r:r + 1], ids[r:r + 1], gu, dn, 7.0)
                       for r in range(120)])
    assert torch.equal(inv_batch, alone)
    assert not torch.equal(fast_batch, alone)
    torch.testing.assert_close(fast_batch, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("t", [1, 5])
def test_grouped_linear(kind, t):
    g, n, k = 4, 24, 72  # group rows off the 128-row block: group 1 starts at row 24
    w = _case(g * n, k, kind, 3)
    x = torch.randn(t, g, k, generator=torch.Generator().manual_seed(4))
    out = kernels.grouped_linear(x, w)
    wd = widened(w).view(g, n, k)
    for gi in range(g):
        assert_within(f"grouped_linear {kind} T={t} group {gi}", out[:, gi], x[:, gi] @ wd[gi].T,
                      dot_bound(x[:, gi], wd[gi]))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("t", [1, 7, 40])
def test_swiglu_mlp(kind, t):
    d, i = 96, 40
    gu, dn = _case(2 * i, d, kind, 5), _case(d, i, kind, 6)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(7))
    out = kernels.swiglu_mlp(x, gu, dn, 7.0)
    h = ref.swiglu(*(x @ widened(gu).T).chunk(2, -1), 7.0)
    # the hidden layer's own rounding propagates: bound the second product with |h| + its error
    h_err = dot_bound(x, widened(gu)).chunk(2, -1)
    h_bound = h.abs() + 8 * (h_err[0] + h_err[1])
    bound = h_bound @ widened(dn).abs().T * (2 * (i + 2) * 2 ** -24) + 8 * (h_err[0] + h_err[1]) @ widened(dn).abs().T
    assert_within(f"swiglu_mlp {kind} T={t}", out, h @ widened(dn).T, bound + 1e-30)


@pytest.mark.parametrize("kind", ["bf16", "fp8_128_f32", "fp8_32_ue8m0", "fp4_ue8m0", "fp4_f32_scales"])
@pytest.mark.parametrize("t", [1, 9, 120])  # 120: ~40 rows per expert, past MOE_GEMM_FROM_ROWS (widened + MKL)
def test_moe_experts(kind, t):
    d, i, k = 64, 48, 2
    x, weights, ids, gu, dn = moe_case(kind, t, d=d, i=i, k=k)
    out = kernels.moe_experts(x, weights, ids, gu, dn, 7.0)
    expected = ref.moe_experts(x, weights, ids, widened(gu), widened(dn), 7.0)
    # each expert's output carries the rounding of two products: bound by the float32 reference's
    # own magnitude path (|x| |W1|, then |h| |W2|) per expert slot
    bound = torch.zeros(t, d)
    for j in range(k):
        for row in range(t):
            ex = int(ids[row, j])
            g1 = dot_bound(x[row:row + 1], widened(gu)[ex])
            h = ref.swiglu(*(x[row:row + 1] @ widened(gu)[ex].T).chunk(2, -1), 7.0)
            hb = h.abs() + 8 * sum(g1.chunk(2, -1))
            bound[row] += weights[row, j] * (hb @ widened(dn)[ex].abs().T * (2 * (i + 2) * 2 ** -24)
                                             + 8 * sum(g1.chunk(2, -1)) @ widened(dn)[ex].abs().T)[0]
    assert_within(f"moe_experts {kind} T={t}", out, expected, bound + 1e-30)


@pytest.mark.parametrize("kind", ["bf16", "fp8_32_ue8m0"])
def test_routers_take_narrow_gates(kind):
    gen = torch.Generator().manual_seed(9)
    gate = weight_kinds(torch.randn(16, 64, generator=gen) * 0.3)[kind]
    x = torch.randn(5, 64, generator=gen)
    bias = torch.randn(16, generator=gen) * 0.1
    w, ids = kernels.route_topk(x, gate, bias, 4, 1.5)
    rw, rids = ref.route_topk(x, widened(gate), bias, 4, 1.5)
    assert torch.equal(ids.sort(-1).values, rids.sort(-1).values)
    assert torch.allclose(w.gather(1, ids.argsort(-1)), rw.gather(1, rids.argsort(-1)), rtol=1e-5, atol=1e-6)
    hw = kernels.route_hash(x, gate, rids, 1.5)
    assert torch.allclose(hw, ref.route_hash(x, widened(gate), rids, 1.5), rtol=1e-5, atol=1e-6)


def test_act_quant_weights_quantize_their_inputs_first():
    """A weight with ActQuant (V4.1's numerics): the input is quantized per 1 x 32 before the GEMM,
    on the kernels as in the reference."""
    gen = torch.Generator().manual_seed(10)
    w = quantize_fp8(torch.randn(40, 96, generator=gen) * 0.1, (32, 32), ue8m0=True, act=ActQuant(32))
    x = torch.randn(3, 96, generator=gen)
    xq = act_quant(x, ActQuant(32))
    plain = QuantizedWeight(w.data, w.scale, w.format, w.block)
    assert_within("linear act-quantized", kernels.linear(x, w), xq @ w.dequantize().T, dot_bound(xq, w.dequantize()))
    assert torch.equal(kernels.linear(x, w), kernels.linear(xq, plain))
    assert not torch.equal(kernels.linear(x, w), kernels.linear(x, plain))


@pytest.mark.parametrize("t", [1, 3, 40])  # GEMV kernel and widened + MKL
def test_v41_weights_quantize_as_the_model_would(t):
    """DeepSeek-V4.1's FP8 GEMM (models/deepseek_v41/numerics.py): a stored 32x32 ue8m0 weight carrying
    ActQuant(32), on bf16 inputs, equals the model quantizing the input itself (the reference's fp8_qdq,
    bit-exact to DeepSeek's act_quant) and multiplying by the dequantized weight, up to rounding order;
    the same weight fused off its block edge (shared expert w1 / w3) too."""
    from deepinfer.backends.quant import with_act

    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(t, 96, generator=gen) * torch.logspace(-2, 1, 96)).bfloat16().float()
    xq = ref.fp8_qdq(x, 32)
    for kind in ("fp8_32_ue8m0", "fp8_32_fused_rows"):
        w = with_act(_case(130, 96, kind, 12), ActQuant(32))
        wd = widened(w)
        assert_within(f"v41 linear {kind} T={t}", kernels.linear(x, w), xq @ wd.T, dot_bound(xq, wd))


@pytest.mark.parametrize("t", [1, 5, 40])  # decoded in registers, once into a buffer, widened for MKL
def test_every_code_decodes_exactly(t):
    """Row i holds code i alone, at column i: with x[k] = k + 1, output i is that code's value times
    i + 1 times its scale, exactly, and a code decoded into the wrong column shows as a wrong multiple.
    All 254 finite e4m3 codes (subnormals, both signs) and all 16 e2m1 codes; the scales are powers of
    two and the values have at most 4 significant bits, so every product is exact."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    n = codes.numel()
    data = torch.zeros(n, 256, dtype=torch.uint8)
    data[torch.arange(n), torch.arange(n)] = codes
    fp8 = QuantizedWeight(data.view(torch.float8_e4m3fn), torch.full((-(-n // 128), 2), 130, dtype=torch.uint8),
                          "fp8_e4m3", (128, 128))
    x = torch.arange(1, 257, dtype=torch.float32)
    values = codes.view(torch.float8_e4m3fn).float() * 8.0 * x[:n]
    assert torch.equal(kernels.linear(x.expand(t, 256).contiguous(), fp8), values.expand(t, n))
    nib = torch.arange(16)
    fp4_codes = torch.zeros(16, 32, dtype=torch.long)
    fp4_codes[nib, nib] = nib
    packed = (fp4_codes[:, 0::2] | (fp4_codes[:, 1::2] << 4)).to(torch.uint8)
    fp4 = QuantizedWeight(packed, torch.full((16, 1), 125, dtype=torch.uint8), "fp4_e2m1", (1, 32))
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6]) * 0.25 * x[:16]
    assert torch.equal(kernels.linear(x[:32].expand(t, 32).contiguous(), fp4), e2m1.expand(t, 16))


# ---------------------------------------------------------------- DeepSeek-V4.1's activation quantization
def _fp8_qdq_inputs() -> torch.Tensor:
    """Groups of 32 built to hit every branch of fp8_qdq: random values over 40 binades; float32 and
    e4m3 subnormals (after scaling); exact e4m3 ties (odd and even neighbours) at several scales; the
    group amax exactly at 448 * 2^n (a scale boundary: fp32(1/448) is not exact, so the product's
    mantissa decides) and one ulp either side; all-zero and tiny groups (the 1e-4 floor) and amax at
    the floor itself and one ulp around it; signed zeros; bf16 rounding ties of the input."""
    gen = torch.Generator().manual_seed(17)
    groups = [torch.randn(64, 32, generator=gen) * torch.exp2(torch.randint(-20, 20, (64, 1), generator=gen).float())]
    groups.append(torch.randn(8, 32, generator=gen) * torch.exp2(torch.randint(-140, -126, (8, 32), generator=gen).float()))
    # ties: midpoints of consecutive e4m3 values (normal and subnormal) under a group max of 448 * 2^e
    e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = ((e4m3[1:] + e4m3[:-1]) / 2)
    for e in (-8, 0, 5):
        g = torch.cat([mids, -mids, torch.zeros(-(2 * mids.numel()) % 31)]).view(-1, 31)
        groups.append(torch.cat([torch.full((g.shape[0], 1), 448.0), g], 1) * 2.0 ** e)
    for e in (-10, 0, 3):  # the amax at the boundary and one float32 ulp either side
        amax = torch.tensor(448.0 * 2.0 ** e)
        for v in (amax, torch.nextafter(amax, torch.tensor(0.0)), torch.nextafter(amax, torch.tensor(1e9))):
            g = torch.randn(1, 32, generator=gen) * float(v) / 8
            g[0, 3] = v
            groups.append(g)
    floor = torch.tensor(1e-4)
    for v in (floor, torch.nextafter(floor, torch.tensor(0.0)), torch.nextafter(floor, torch.tensor(1.0)), torch.tensor(3e-5)):
        g = torch.randn(1, 32, generator=gen) * float(v) / 4
        g[0, 0] = -v
        groups.append(g)
    groups.append(torch.zeros(1, 32))
    groups.append(torch.tensor([[0.0, -0.0] * 16]))
    # bf16 ties: halfway between two bf16 values, both parities
    base = torch.arange(1, 33, dtype=torch.float32).view(1, 32) * 0.37
    bits = base.bfloat16().float().view(torch.int32) | 0x8000
    groups.append(bits.view(torch.float32))
    return torch.cat(groups)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == torch.float32 and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("block", [32, 16, 64])
def test_fp8_qdq_kernel_is_bit_exact(block):
    """The cpu backend's fp8_qdq (quant_ops.cpp) equals the reference's bit for bit (the sign of zero
    included), on the edge cases of _fp8_qdq_inputs, in rows of 64, one long row and [R, 2, 64]; and its form
    without the bf16 rounding equals quant.act_quant (ActQuant(pow2), the weight op's input quantization)."""
    x = _fp8_qdq_inputs()
    x = torch.cat([x, torch.zeros(x.shape[0] % 2, 32)]).reshape(-1, 64)  # rows of two groups of 32
    for rows in (x, x.reshape(1, -1), x.reshape(-1, 2, 64)):
        assert _same_bits(kernels.fp8_qdq(rows, block), ref.fp8_qdq(rows, block))
        assert _same_bits(torch.ops.deepinfer_cpu.fp8_qdq(rows, block, False), act_quant(rows, ActQuant(block)))
    assert not _same_bits(torch.ops.deepinfer_cpu.fp8_qdq(x, block, False), ref.fp8_qdq(x, block))  # bf16 first matters
    with pytest.raises(RuntimeError, match="not a multiple"):
        torch.ops.deepinfer_cpu.fp8_qdq(torch.randn(2, 40), block, True)


def _moe_bf16_accelerators():
    from deepinfer.backends.cpu import CpuInvariantKernelAccelerator, CpuKernelAccelerator

    return {"fast": CpuKernelAccelerator(), "invariant": CpuInvariantKernelAccelerator()}


@pytest.mark.parametrize("kind", ["f32", "bf16", "fp8_32_ue8m0", "fp8_128_f32", "fp4_ue8m0"])
@pytest.mark.parametrize("t", [1, 9, 40, 100])
@pytest.mark.parametrize("act_block", [0, 32])
def test_moe_experts_bf16_kernel(kind, t, act_block):
    """moe_experts_bf16 in the experts kernel (one call, no host read) against the definition (base.py's
    composite on the reference ops; tolerances in tests/op_checks.py), fast and batch-invariant classes
    (at T=100, 300 rows for 7 experts, the fast class's kernel multiplies experts of more than
    MOE_GEMM_FROM_ROWS rows on widened tiles + MKL), and against the same composite on the kernel ops;
    a token's result alone equals its row in the batch, bit for bit, unless an expert switched."""
    from deepinfer.backends.base import Accelerator
    from op_checks import assert_moe_bf16, moe_bf16_case, moe_bf16_reference

    x, weights, ids, gu, dn = moe_bf16_case(kind, t)
    expected = moe_bf16_reference(x, weights, ids, gu, dn, 1.5, act_block)
    for mode, acc in _moe_bf16_accelerators().items():
        out = acc.moe_experts_bf16(x, weights, ids, gu, dn, 1.5, act_block)
        assert_moe_bf16(f"cpu {mode} {kind} T={t} act_block={act_block}", out, expected)
        composite = Accelerator.moe_experts_bf16(acc, x, weights, ids, gu, dn, 1.5, act_block)
        assert_moe_bf16(f"cpu {mode} vs composite on its ops", out, composite)
        alone = acc.moe_experts_bf16(x[-1:], weights[-1:], ids[-1:], gu, dn, 1.5, act_block)
        switched = int(torch.bincount(ids.flatten()).max()) > quant_kernels.MOE_GEMM_FROM_ROWS
        assert _same_bits(alone[0], out[-1]) or mode == "fast" and switched


@pytest.mark.parametrize("t", [4, 100])  # 100: 300 rows on 7 experts, some on the widened GEMM inside the call
def test_moe_experts_bf16_kernel_is_one_recorded_call(t):
    """A call of any size is one operator, recorded with fixed shapes (core/graphs.py): no host read, no
    data-shaped op, so a replayed step holds it as an ordinary call (DSpark's drafting blocks put tens
    of rows on each expert). The definition itself is not recordable (its loop reads the ids): the
    test can tell them apart."""
    from deepinfer.backends.base import Accelerator
    from deepinfer.core.graphs import record
    from op_checks import moe_bf16_case

    acc = _moe_bf16_accelerators()["fast"]
    x, weights, ids, gu, dn = moe_bf16_case("fp4_ue8m0", t)
    recording, failure, out = record(lambda: acc.moe_experts_bf16(x, weights, ids, gu, dn, 1.5, 32), [x, weights, ids])
    assert recording is not None, failure
    assert "deepinfer_cpu.qmoe_experts.default" in recording.ops()
    recording, failure, _ = record(lambda: Accelerator.moe_experts_bf16(acc, x, weights, ids, gu, dn, 1.5, 32),
                                   [x, weights, ids])
    assert recording is None and failure


def test_moe_experts_bf16_check_catches_other_numerics():
    """The tolerance of op_checks.assert_moe_bf16 is tight enough to fail on the numerics this op is
    not: the routing weight on the output instead of the intermediate (moe_experts' order), or the
    intermediate not quantized."""
    from op_checks import assert_moe_bf16, moe_bf16_case, moe_bf16_reference

    x, weights, ids, gu, dn = moe_bf16_case("fp4_ue8m0", 9)
    expected = moe_bf16_reference(x, weights, ids, gu, dn, 1.5, 32)
    weighted_after = torch.ops.deepinfer_cpu.qmoe_experts(
        torch.ops.deepinfer_cpu.fp8_qdq(x, 32, True), weights, ids,
        *quant_kernels.weight_args(gu), *quant_kernels.weight_args(dn), 1.5)
    unquantized = moe_bf16_reference(x, weights, ids, gu, dn, 1.5, 0)
    for wrong in (weighted_after, unquantized):
        with pytest.raises(AssertionError):
            assert_moe_bf16("wrong numerics", wrong, expected)


@pytest.mark.parametrize("kind", ["bf16", "fp8_32_ue8m0"])
def test_gemm_path_under_inference_mode_on_two_threads(kind):
    """The engine runs the weight ops under torch.inference_mode with every thread of its share: the
    GEMM path's tiles are multiplied on worker threads into the caller's output (which failed there
    once: the mode is thread-local). Same result as outside the mode, within the bound."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        w = _case(1100, 256, kind, 13)  # 3 tiles of 512 rows: more than one task
        x = torch.randn(40, 256, generator=torch.Generator().manual_seed(14))
        with torch.inference_mode():
            out = kernels.linear(x, w)
        assert torch.equal(out, kernels.linear(x, w))
        assert_within(f"linear {kind} T=40 inference mode", out, x @ widened(w).T, dot_bound(x, widened(w)))
    finally:
        torch.set_num_threads(threads)
