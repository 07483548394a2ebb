"""The ascend backend against the cpu reference, op by op, with no NPU: torch_npu calls go to the
test shim (tests/ascend/shim, plain torch following the torch_npu documentation), Triton kernels run
through the Triton interpreter. What this cannot show: that real torch_npu / triton-ascend behave as
documented, and anything about the AscendC kernels (not compiled here).

Inputs float32, a distinct fixed seed per case, ragged sizes (T in 1, 7, 33; widths that are not tile
multiples). Triton outputs start as NaN (`alloc.poison`), so an element a kernel fails to write fails.
Tolerance: max |ascend - cpu| <= TOL[op] * max |cpu|; 0.0 = bit-identical; ids/tokens must be equal.

| op                  | runs as (here)                          | TOL             | measured (max rel err) |
|---------------------|-----------------------------------------|-----------------|------------------------|
| rms_norm            | npu_rms_norm (shim)                     | 1e-5            | 0                      |
| swiglu              | npu_swiglu (shim)                       | 1e-5            | 1.9e-8                 |
| moe_experts         | npu_grouped_matmul + npu_swiglu (shim)  | 1e-5            | 3.3e-7                 |
| moe_experts_bf16    | the same + Triton fp8_qdq (V4.1)        | op_checks       | 0 (bit-identical)      |
| rope                | Triton                                  | 0               | 0                      |
| hc_pre/post/head    | Triton                                  | 1e-5            | 2.0e-7/8.6e-8/2.9e-7   |
| compress_windows    | Triton, re-tiled (AscendC not built)    | 1e-5            | 1.8e-7                 |
| sparse_attention    | Triton, re-tiled                        | 1e-5            | 3.4e-7                 |
| dense_attention     | Triton, re-tiled                        | 1e-5            | 8.8e-7                 |
| route_topk/hash     | Triton + torch.topk                     | 1e-5, ids equal | 2.1e-7/1.8e-7          |
| route_grouped_topk  | Triton + torch.topk                     | 1e-5, ids equal | 2.7e-7                 |
| indexer_topk        | Triton + torch stable sort              | ids equal       | equal                  |
| apply_token_bitmask | Triton                                  | 0               | 0                      |
| apply_penalties     | Triton                                  | 1e-6            | 0                      |
| apply_min_p, apply_logit_bias, count_tokens | Triton          | 0               | 0 (+ tests/logits_checks.py) |
| fp8_qdq, fp4_qdq    | Triton (integer rounding)               | 0 (bits)        | 0                      |
| hc_mixes, hc_collapse, indexer_scores | Triton                | op_checks.V41_OPS |                      |
| hc_pre_norm, hc_post_pre_norm, rms_norm_rope, swiglu_mlp, compress_entries | base.py composites of the above | 1e-5 | 2.7e-7, 2.5e-7, 0, 6.4e-8, 1.7e-7 |

DeepSeek-V3's inputs to the existing ops, at the same tolerances: sparse_attention with no sink (-inf)
(2.7e-7), moe_experts / swiglu_mlp / swiglu with limit inf (1.7e-7 / 3.6e-9 / 1.6e-10).

linear, grouped_linear, embedding and sample are bound to the reference functions
themselves (plain torch, which runs on the NPU as aclnn ops): comparing them with the reference here
could not fail, so what is tested of them is what the backend adds, the weight layout and dtype
`prepare_weight` stores.

Measured with `pytest -s tests/ascend` (each comparison prints its error).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the ascend backend's Triton kernels cannot run")

from deepinfer.backends.base import WeightRole  # noqa: E402
from deepinfer.backends.quant import QuantizedWeight, quantize_fp4  # noqa: E402
from deepinfer.backends import reference as ref  # noqa: E402
from quant_checks import assert_within, dot_bound, weight_kinds, widened  # noqa: E402
from logits_checks import cases as logit_cases, check_case, check_op_conformance  # noqa: E402
from op_checks import (FUSED_OPS, GROUPED_ROUTINGS, MOE_BF16_KINDS, V41_OPS, assert_close, check_attention_without_sink,  # noqa: E402
                       check_fused, check_moe_experts_bf16, check_route_grouped_topk, check_unclamped_experts,
                       check_v41_op,
                       grouped_routing_id, indices, poisoned, randn, run, seeded)

TOL = {"rms_norm": 1e-5, "swiglu": 1e-5, "moe_experts": 1e-5, "rope": 0.0, "hc_pre": 1e-5, "hc_post": 1e-5,
       "hc_head": 1e-5, "compress_windows": 1e-5, "sparse_attention": 1e-5, "dense_attention": 1e-5, "route_topk": 1e-5,
       "route_grouped_topk": 1e-5, "route_hash": 1e-5,
       # composites of the ops above (base.py): each within the sum of its parts' tolerances
       "hc_pre_norm": 1e-5, "hc_post_pre_norm": 1e-5, "rms_norm_rope": 1e-5, "swiglu_mlp": 1e-5, "compress_entries": 1e-5}
TOKENS = (1, 7, 33)


@pytest.fixture(scope="module")
def asc():
    yield from poisoned("ascend")


def _close(op: str, out, expected, tol=None) -> None:
    assert_close(op, out, expected, TOL[op] if tol is None else tol)


def test_backend_identity(asc):
    assert (asc.name, asc.dist_backend, asc.device.type) == ("ascend", "hccl", "cpu")
    assert asc.batch_invariant is False and asc.deterministic_sampling is False
    assert asc.shim and not asc.ascendc  # the AscendC kernels are never used under the shim


# ------------------------------------------------------------------ torch_npu-mapped ops


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("shape,weighted", [((64,), True), ((3, 96), False), ((3, 40), True), ((1500,), True)])
def test_rms_norm(asc, t, shape, weighted):
    gen = seeded(1, t, *shape, weighted)
    x = randn(gen, t, *shape, scale=3.0)
    w = randn(gen, shape[-1]) if weighted else None
    _close("rms_norm", *run(asc, "rms_norm", x, w, 1e-6))


@pytest.mark.parametrize("shape", [(1, 32), (7, 100), (33, 3, 17)])
def test_swiglu(asc, shape):
    gen = seeded(3, *shape)
    _close("swiglu", *run(asc, "swiglu", randn(gen, *shape, scale=6.0), randn(gen, *shape, scale=6.0), 7.0))


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("e,k,d,inter", [(8, 2, 64, 32), (5, 3, 40, 24)])
def test_moe_experts(asc, t, e, k, d, inter):
    gen = seeded(15, t, e, k, d, inter)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    x, weights = randn(gen, t, d), torch.rand(t, k, generator=gen)
    gate_up, down = randn(gen, e, 2 * inter, d, scale=0.3), randn(gen, e, d, inter, scale=0.3)
    out = asc.moe_experts(x, weights, ids, asc.prepare_weight(gate_up, WeightRole.EXPERTS),
                          asc.prepare_weight(down, WeightRole.EXPERTS), 1.0)  # clamp is hit
    _close("moe_experts", out, ref.moe_experts(x, weights, ids, gate_up, down, 1.0))


@pytest.mark.parametrize("kind", MOE_BF16_KINDS)
@pytest.mark.parametrize("t", [1, 9])
@pytest.mark.parametrize("act_block", [0, 32])
def test_moe_experts_bf16(asc, kind, t, act_block):
    """DeepSeek-V4.1's routed experts: moe_experts' grouped GEMMs (float stacks in the transposed layout
    prepare_weight stores) with its rounding points and the Triton fp8_qdq, against base.py's composite."""
    check_moe_experts_bf16(asc, kind, t, act_block)


def test_prepare_weight_layouts_and_dtypes(asc):
    """What the backend stores: float expert stacks transposed to [E, K, N] (npu_grouped_matmul's
    layout), everything else as loaded; dtypes kept (bf16 stays bf16, quantized stays quantized)."""
    gen = seeded(19)
    stack = randn(gen, 3, 8, 5).to(torch.bfloat16)
    experts = asc.prepare_weight(stack, WeightRole.EXPERTS)
    assert experts.shape == (3, 5, 8) and experts.dtype == torch.bfloat16 and experts.is_contiguous()
    assert torch.equal(experts, stack.transpose(1, 2))
    plain = asc.prepare_weight(stack[0].t(), WeightRole.PLAIN)  # a non-contiguous view comes back contiguous
    assert plain.shape == (5, 8) and plain.dtype == torch.bfloat16 and plain.is_contiguous()
    assert torch.equal(plain, stack[0].t())
    fp4 = quantize_fp4(randn(gen, 3, 8, 64))
    kept = asc.prepare_weight(fp4, WeightRole.EXPERTS)
    assert isinstance(kept, QuantizedWeight) and kept.shape == (3, 8, 64) and torch.equal(kept.data, fp4.data)
    table = torch.randint(0, 8, (10, 2), generator=gen)
    assert asc.prepare_weight(table).dtype == torch.int64


@pytest.mark.parametrize("kind", ["fp4_ue8m0", "fp8_128_f32", "fp8_32_ue8m0", "bf16"])
@pytest.mark.parametrize("t", [1, 9])
def test_moe_experts_on_stored_stacks(asc, kind, t):
    """FP4 / FP8 / bf16 expert stacks stay as loaded and are widened per call, only the experts hit."""
    e, d, i, k = 6, 64, 48, 2
    gen = seeded(21, t)
    gu = weight_kinds(torch.randn(e, 2 * i, d, generator=gen) * 0.1)[kind]
    dn = weight_kinds(torch.randn(e, d, i, generator=gen) * 0.1)[kind]
    x = torch.randn(t, d, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=gen)
    out = asc.moe_experts(x, weights, ids, asc.prepare_weight(gu, WeightRole.EXPERTS),
                          asc.prepare_weight(dn, WeightRole.EXPERTS), 7.0)
    _close("moe_experts", out, ref.moe_experts(x, weights, ids, widened(gu), widened(dn), 7.0))


@pytest.mark.parametrize("kind", ["fp8_128_f32", "fp8_32_ue8m0", "fp8_fused_rows", "fp8_32_fused_rows", "fp4_ue8m0",
                                  "bf16"])
def test_dense_ops_on_stored_weights(asc, kind):
    """linear / grouped_linear / swiglu_mlp widen stored weights per call (row chunks): float32 math on
    the dequantized weight, K and N off the block edges."""
    gen = seeded(22)
    w = weight_kinds(torch.randn(96, 130, generator=gen) * 0.1)[kind]
    x = torch.randn(5, 130, generator=gen)
    wd = widened(w)
    assert_within(f"linear {kind}", asc.linear(x, w), x @ wd.T, dot_bound(x, wd))
    xg = torch.randn(5, 4, 130, generator=gen)
    out = asc.grouped_linear(xg, w)
    for g in range(4):
        wg = wd[24 * g:24 * (g + 1)]
        assert_within(f"grouped_linear {kind} group {g}", out[:, g], xg[:, g] @ wg.T, dot_bound(xg[:, g], wg))


@pytest.mark.parametrize("kind", ["fp8_32_ue8m0", "fp8_32_fused_rows"])
def test_v41_weights_quantize_as_the_model_would(asc, kind):
    """DeepSeek-V4.1's FP8 GEMM (models/deepseek_v41/numerics.py): a stored 32x32 ue8m0 weight with
    ActQuant(32) on bf16 inputs equals the model quantizing the input itself with this backend's
    fp8_qdq (bit-exact to DeepSeek's act_quant) times the dequantized weight, up to rounding order."""
    from deepinfer.backends.quant import ActQuant, with_act

    gen = seeded(23)
    x = torch.randn(5, 128, generator=gen).bfloat16().float()
    w = with_act(weight_kinds(torch.randn(96, 128, generator=gen) * 0.1)[kind], ActQuant(32))
    xq, wd = asc.fp8_qdq(x, 32), widened(w)
    assert_within(f"v41 linear {kind}", asc.linear(x, w), xq @ wd.T, dot_bound(xq, wd))


# ------------------------------------------------------------------ Triton kernels


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("shape,rope_dim", [((4, 32), 8), ((48,), 16)])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope(asc, t, shape, rope_dim, inverse):
    gen = seeded(2, t, *shape, rope_dim, inverse)
    x = randn(gen, t, *shape)
    angle = randn(gen, t, rope_dim // 2, scale=3.0)
    _close("rope", *run(asc, "rope", x, angle.cos(), angle.sin(), inverse))


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("n,d", [(4, 64), (2, 40)])
def test_hc_ops(asc, t, n, d):
    gen = seeded(7, t, n, d)
    streams = randn(gen, t, n, d)
    args = (streams, randn(gen, (2 + n) * n, n * d, scale=0.1), randn(gen, (2 + n) * n, scale=0.2),
            torch.rand(3, generator=gen), 1e-6, 1e-6, 20)
    for out, expected in zip(*run(asc, "hc_pre", *args)):
        _close("hc_pre", out, expected)
    post_args = (randn(gen, t, d), streams, torch.rand(t, n, generator=gen) * 2, torch.rand(t, n, n, generator=gen))
    _close("hc_post", *run(asc, "hc_post", *post_args))
    head_args = (streams, randn(gen, n, n * d, scale=0.1), randn(gen, n, scale=0.2), torch.rand(1, generator=gen),
                 1e-6, 1e-6)
    _close("hc_head", *run(asc, "hc_head", *head_args))


@pytest.mark.parametrize("w,length,d", [(1, 8, 32), (5, 4, 40), (9, 3, 16), (2, 128, 40)])
def test_compress_windows(asc, w, length, d):
    gen = seeded(10, w, length, d)
    kv, gate = randn(gen, w, length, d), randn(gen, w, length, d, scale=2.0)
    gate[:, 0, : d // 2] = float("-inf")  # masked slots get weight 0
    _close("compress_windows", *run(asc, "compress_windows", kv, gate))


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("h,d,k", [(4, 32, 45), (1, 24, 70)])
def test_sparse_attention(asc, t, h, d, k):
    gen = seeded(11, t, h, d, k)
    idx = indices(gen, t, k, 50)
    idx[0] = -1  # a token with no valid index gets zeros
    args = (randn(gen, t, h, d), randn(gen, 50, d), idx, randn(gen, h), d ** -0.5)
    _close("sparse_attention", *run(asc, "sparse_attention", *args))


@pytest.mark.parametrize("lens", [(7,), (70, 0, 1, 33)])
def test_dense_attention(asc, lens):
    gen = seeded(20, *lens)
    t, h, d = sum(lens), 2, 40
    args = (randn(gen, t, h, d, scale=2.0), randn(gen, t, h, d), randn(gen, t, h, d), list(lens), d ** -0.5)
    _close("dense_attention", *run(asc, "dense_attention", *args))


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("h,d,m,topk", [(16, 16, 40, 8), (4, 16, 5, 16)])
def test_indexer_topk(asc, t, h, d, m, topk):
    gen = seeded(12, t, h, d, m, topk)
    args = (randn(gen, t, h, d), randn(gen, t, h), randn(gen, 60, d), indices(gen, t, m, 60), topk, 0.25)
    out, expected = run(asc, "indexer_topk", *args)
    assert torch.equal(out.cpu().sort(-1).values, expected.sort(-1).values)


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("e,k", [(8, 2), (16, 4)])
def test_route_topk_and_hash(asc, t, e, k):
    gen = seeded(13, t, e, k)
    x, gate = randn(gen, t, 64), randn(gen, e, 64, scale=0.3)
    (w, ids), (rw, rids) = run(asc, "route_topk", x, gate, randn(gen, e, scale=0.5), k, 1.5)
    order, rorder = ids.cpu().argsort(-1), rids.argsort(-1)
    assert torch.equal(ids.cpu().gather(1, order), rids.gather(1, rorder))
    _close("route_topk", w.cpu().gather(1, order), rw.gather(1, rorder))
    hash_ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    _close("route_hash", *run(asc, "route_hash", x, gate, hash_ids, 2.5))


# ------------------------------------------------------------------ bitmask


@pytest.mark.parametrize("b,v", [(1, 40), (5, 1100)])
def test_apply_token_bitmask(asc, b, v):
    gen = seeded(18, b, v)
    logits = randn(gen, b, v)
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (b, (v + 31) // 32), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    out, expected = logits.clone().to(asc.device), logits.clone()
    asc.apply_token_bitmask(out, bitmask.to(asc.device))
    ref.apply_token_bitmask(expected, bitmask)
    assert torch.equal(out.cpu(), expected)


# ------------------------------------------------------------------ fused composites (base.py)


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("op", FUSED_OPS)
def test_fused_composites(t, op, asc):
    """hc_pre_norm, hc_post_pre_norm, rms_norm_rope, swiglu_mlp and compress_entries: this backend
    runs the base-class composite of its own ops; every output within the composite's tolerance."""
    check_fused(asc, op, t, TOL[op])


# ------------------------------------------------------------------ DeepSeek-V3


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("routing", GROUPED_ROUTINGS, ids=grouped_routing_id)
def test_route_grouped_topk(asc, t, routing):
    check_route_grouped_topk(asc, t, routing, TOL["route_grouped_topk"])


@pytest.mark.parametrize("t", TOKENS)
def test_sparse_attention_without_sink(asc, t):
    check_attention_without_sink(asc, t, TOL["sparse_attention"])


@pytest.mark.parametrize("t", TOKENS)
def test_unclamped_experts(asc, t):
    check_unclamped_experts(asc, t, TOL["moe_experts"])


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("op", V41_OPS)
def test_v41_ops(asc, t, op):
    """DeepSeek-V4.1's ops: the shared Triton kernels on this backend (op_checks.V41_OPS: tolerances)."""
    check_v41_op(asc, op, t)


# ------------------------------------------------------------------ SamplingParams' logit ops


def test_logit_ops_against_reference(asc):
    """apply_penalties (1e-6 relative), apply_min_p, apply_logit_bias, count_tokens (exact) with pass-through
    rows, repeated ids and -inf entries (tests/logits_checks.py)."""
    check_op_conformance(asc)


@pytest.mark.parametrize("case", range(len(logit_cases())), ids=[c[0] for c in logit_cases()])
def test_logit_ops_against_transformers(asc, case):
    """The same adjusted logits, greedy token and sampled distribution (chi-square) as transformers'
    logits processors (RepetitionPenalty, MinP, NoBadWords, SequenceBias, MinNewTokensLength)."""
    name, temperature, ours, theirs = logit_cases()[case]
    check_case(asc, name, temperature, ours, theirs, seed=100 + case)
