"""The nvidia backend's Triton kernels against the cpu reference, op by op.

Runs through the Triton interpreter on CPU tensors (conftest sets TRITON_INTERPRET=1). Inputs are
float32, a distinct fixed seed per case, ragged sizes (T in 1, 7, 33; widths that are not tile multiples).
Every output buffer the kernels allocate starts as NaN / INT64_MIN (`alloc.poison`), so an element
a kernel does not write fails the comparison.

Tolerance: max |nvidia - cpu| <= TOL[op] * max |cpu| (relative to the largest reference value).
Exact ops (0.0) must match bit for bit; integer outputs (ids, tokens) must be equal.

| op                  | TOL    | measured (max rel err over cases) |
|---------------------|--------|-----------------------------------|
| rms_norm            | 1e-5   | 1.3e-7                            |
| rope                | 1e-6   | 0 interp; 2.4e-7 on H200 (FMA)    |
| swiglu              | 1e-5   | 7.8e-8                            |
| linear              | 1e-5   | 3.4e-7                            |
| grouped_linear      | 1e-5   | 2.7e-7                            |
| embedding           | 0      | 0                                 |
| hc_pre              | 1e-5   | 2.4e-7 (collapsed, post, comb)    |
| hc_post             | 1e-5   | 6.7e-8                            |
| hc_head             | 1e-5   | 1.2e-7                            |
| compress_windows    | 1e-5   | 8.9e-8                            |
| sparse_attention    | 1e-5   | 4.8e-7                            |
| dense_attention     | 1e-5   | 4.6e-7                            |
| indexer_topk        | ids    | equal (as sets per row)           |
| route_topk          | 1e-5   | 2.1e-7, ids equal                 |
| route_hash          | 1e-5   | 2.2e-7                            |
| route_grouped_topk  | 1e-5   | 2.7e-7, ids equal (DeepSeek-V3)   |
| moe_experts         | 1e-5   | 3.4e-7                            |
| sample              | tokens | equal (greedy and sampled rows)   |
| apply_token_bitmask | 0      | 0                                 |
| apply_penalties     | 1e-6   | 0 interp (x - f*c - p may fuse on a GPU) |
| apply_min_p, apply_logit_bias, count_tokens | 0 | 0 (and vs transformers' processors: tests/logits_checks.py) |
| hc_pre_norm         | 1e-5   | 2.7e-7 (composites of the above)  |
| hc_post_pre_norm    | 1e-5   | 2.5e-7                            |
| rms_norm_rope       | 1e-5   | 1.4e-7                            |
| swiglu_mlp          | 1e-5   | 5.4e-7                            |
| compress_entries    | 1e-5   | 1.7e-7                            |
| fp8_qdq, fp4_qdq    | 0      | 0 (bit for bit, E8M0 and E4M3)    |
| hc_mixes            | 1e-5   |                                   |
| hc_collapse         | 1e-6   |                                   |
| indexer_scores      | 1e-5   | (and -inf where the reference)    |

DeepSeek-V3's inputs to the existing ops, at the same tolerances: sparse_attention with no sink
(-inf) over index lists whose first blocks are absent (2.7e-7; a token with no index gets zeros),
moe_experts / swiglu_mlp / swiglu with limit inf (2.6e-7 / 2.9e-7 / 6.4e-10).

Measured with `pytest -s` (each comparison prints its relative error); interpreted runtime ~25 s.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the nvidia backend's kernels cannot run")

from deepinfer.backends import AcceleratorUnavailable, cuda_usable, get_accelerator  # noqa: E402
from deepinfer.backends import reference as ref  # noqa: E402
from logits_checks import cases as logit_cases, check_case, check_op_conformance  # noqa: E402
from op_checks import (FUSED_OPS, GROUPED_ROUTINGS, V41_OPS, assert_close, check_attention_without_sink,  # noqa: E402
                       check_fused, check_route_grouped_topk, check_unclamped_experts, check_v41_op,
                       grouped_routing_id, indices, poisoned, randn, run, seeded)

TOL = {
    "rms_norm": 1e-5, "rope": 1e-6, "swiglu": 1e-5, "linear": 1e-5, "grouped_linear": 1e-5,
    "embedding": 0.0, "hc_pre": 1e-5, "hc_post": 1e-5, "hc_head": 1e-5, "compress_windows": 1e-5,
    "sparse_attention": 1e-5, "dense_attention": 1e-5, "route_topk": 1e-5, "route_grouped_topk": 1e-5, "route_hash": 1e-5,
    "moe_experts": 1e-5,
    "apply_token_bitmask": 0.0,
    # composites of the ops above (base.py): each within the sum of its parts' tolerances
    "hc_pre_norm": 1e-5, "hc_post_pre_norm": 1e-5, "rms_norm_rope": 1e-5, "swiglu_mlp": 1e-5, "compress_entries": 1e-5,
}
TOKENS = (1, 7, 33)


@pytest.fixture(scope="module")
def nv():
    yield from poisoned("nvidia")


def _close(op: str, out, expected, tol=None) -> None:
    assert_close(op, out, expected, TOL[op] if tol is None else tol)


# ------------------------------------------------------------------ dense / elementwise


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("shape,weighted", [((64,), True), ((3, 96), False), ((3, 40), True), ((1500,), True)])
def test_rms_norm(nv, t, shape, weighted):
    gen = seeded(1, t, *shape, weighted)
    x = randn(gen, t, *shape, scale=3.0)
    w = randn(gen, shape[-1]) if weighted else None
    _close("rms_norm", *run(nv, "rms_norm", x, w, 1e-6))


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("shape,rope_dim", [((4, 32), 8), ((48,), 16), ((2, 16), 16)])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope(nv, t, shape, rope_dim, inverse):
    gen = seeded(2, t, *shape, rope_dim, inverse)
    x = randn(gen, t, *shape)
    angle = randn(gen, t, rope_dim // 2, scale=3.0)
    _close("rope", *run(nv, "rope", x, angle.cos(), angle.sin(), inverse))


@pytest.mark.parametrize("shape", [(1, 32), (7, 100), (33, 3, 17)])
def test_swiglu(nv, shape):
    gen = seeded(3, *shape)
    _close("swiglu", *run(nv, "swiglu", randn(gen, *shape, scale=6.0), randn(gen, *shape, scale=6.0), 7.0))


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("n,k", [(80, 96), (7, 300), (130, 17)])
def test_linear(nv, t, n, k):
    gen = seeded(4, t, n, k)
    _close("linear", *run(nv, "linear", randn(gen, t, k), randn(gen, n, k)))


def test_linear_leading_dims(nv):
    gen = seeded(4, 0)
    _close("linear", *run(nv, "linear", randn(gen, 3, 5, 40), randn(gen, 24, 40)))


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("groups,n,k", [(2, 16, 64), (4, 24, 48), (3, 5, 33)])
def test_grouped_linear(nv, t, groups, n, k):
    gen = seeded(5, t, groups, n, k)
    _close("grouped_linear", *run(nv, "grouped_linear", randn(gen, t, groups, k), randn(gen, groups * n, k)))


@pytest.mark.parametrize("t", TOKENS)
def test_embedding(nv, t):
    gen = seeded(6, t)
    ids = torch.randint(0, 50, (t,), generator=gen)
    _close("embedding", *run(nv, "embedding", ids, randn(gen, 50, 72)))


# ------------------------------------------------------------------ mHC


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("n,d", [(4, 64), (2, 40), (3, 16)])
def test_hc_pre(nv, t, n, d):
    gen = seeded(7, t, n, d)
    args = (randn(gen, t, n, d), randn(gen, (2 + n) * n, n * d, scale=0.1), randn(gen, (2 + n) * n, scale=0.2),
            torch.rand(3, generator=gen), 1e-6, 1e-6, 20)
    (collapsed, post, comb), (rc, rp, rcomb) = run(nv, "hc_pre", *args)
    _close("hc_pre", collapsed, rc)
    _close("hc_pre", post, rp)
    _close("hc_pre", comb, rcomb)


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("n,d", [(4, 64), (2, 300)])
def test_hc_post(nv, t, n, d):
    gen = seeded(8, t, n, d)
    args = (randn(gen, t, d), randn(gen, t, n, d), torch.rand(t, n, generator=gen) * 2,
            torch.rand(t, n, n, generator=gen))
    _close("hc_post", *run(nv, "hc_post", *args))


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("n,d", [(4, 64), (2, 40)])
def test_hc_head(nv, t, n, d):
    gen = seeded(9, t, n, d)
    args = (randn(gen, t, n, d), randn(gen, n, n * d, scale=0.1), randn(gen, n, scale=0.2),
            torch.rand(1, generator=gen), 1e-6, 1e-6)
    _close("hc_head", *run(nv, "hc_head", *args))


# ------------------------------------------------------------------ attention


@pytest.mark.parametrize("w,length,d", [(1, 8, 32), (5, 4, 40), (9, 3, 16)])
def test_compress_windows(nv, w, length, d):
    gen = seeded(10, w, length, d)
    kv, gate = randn(gen, w, length, d), randn(gen, w, length, d, scale=2.0)
    gate[:, 0, : d // 2] = float("-inf")  # masked slots get weight 0
    _close("compress_windows", *run(nv, "compress_windows", kv, gate))


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("h,d,k", [(4, 32, 45), (20, 64, 16), (1, 24, 70)])
def test_sparse_attention(nv, t, h, d, k):
    gen = seeded(11, t, h, d, k)
    pool = 50
    idx = indices(gen, t, k, pool)
    idx[0] = -1  # a token with no valid index gets zeros
    args = (randn(gen, t, h, d), randn(gen, pool, d), idx, randn(gen, h), d ** -0.5)
    _close("sparse_attention", *run(nv, "sparse_attention", *args))


# sequence lengths: one query block, several key blocks with a ragged tail, an empty sequence, one token
@pytest.mark.parametrize("lens", [(7,), (130, 0, 1, 65), (64, 64)])
@pytest.mark.parametrize("h,d", [(3, 16), (2, 40)])
def test_dense_attention(nv, lens, h, d):
    gen = seeded(20, *lens, h, d)
    t = sum(lens)
    args = (randn(gen, t, h, d, scale=2.0), randn(gen, t, h, d), randn(gen, t, h, d), list(lens), d ** -0.5)
    _close("dense_attention", *run(nv, "dense_attention", *args))


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("h,d,m,topk", [(16, 16, 40, 8), (3, 32, 70, 64), (4, 16, 5, 16)])
def test_indexer_topk(nv, t, h, d, m, topk):
    gen = seeded(12, t, h, d, m, topk)
    cand = indices(gen, t, m, 60)
    args = (randn(gen, t, h, d), randn(gen, t, h), randn(gen, 60, d), cand, topk, 0.25)
    out, expected = run(nv, "indexer_topk", *args)
    assert torch.equal(out.cpu().sort(-1).values, expected.sort(-1).values)


# ------------------------------------------------------------------ MoE


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("e,k", [(8, 2), (16, 4)])
def test_route_topk(nv, t, e, k):
    gen = seeded(13, t, e, k)
    args = (randn(gen, t, 64), randn(gen, e, 64, scale=0.3), randn(gen, e, scale=0.5), k, 1.5)
    (w, ids), (rw, rids) = run(nv, "route_topk", *args)
    order, rorder = ids.cpu().argsort(-1), rids.argsort(-1)
    assert torch.equal(ids.cpu().gather(1, order), rids.gather(1, rorder))
    _close("route_topk", w.cpu().gather(1, order), rw.gather(1, rorder))


@pytest.mark.parametrize("t", TOKENS)
def test_route_hash(nv, t):
    gen = seeded(14, t)
    ids = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(t)])
    args = (randn(gen, t, 64, scale=3.0), randn(gen, 16, 64, scale=0.3), ids, 2.5)
    _close("route_hash", *run(nv, "route_hash", *args))


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("e,k,d,inter", [(8, 2, 64, 32), (5, 3, 40, 24)])
def test_moe_experts(nv, t, e, k, d, inter):
    gen = seeded(15, t, e, k, d, inter)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    args = (randn(gen, t, d), torch.rand(t, k, generator=gen), ids, randn(gen, e, 2 * inter, d, scale=0.3),
            randn(gen, e, d, inter, scale=0.3), 1.0)  # limit 1.0: the clamp is hit
    _close("moe_experts", *run(nv, "moe_experts", *args))


# ------------------------------------------------------------------ sampling


@pytest.mark.parametrize("b,v", [(1, 50), (7, 3000), (9, 1100)])
def test_sample(nv, b, v):
    gen = seeded(16, b, v)
    logits = randn(gen, b, v, scale=2.0)
    logits[:, 3] = logits[:, 5] = logits.max() + 1  # exact tie: the first index wins
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.3, 0.0, 2.0, 0.9, 1.0, 0.5])[:b]
    top_k = torch.tensor([0, 0, 50, 0, 0, 5, 0, 0, 2])[:b]
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.9, 1.0, 0.5, 1.0, 0.8, 1.0])[:b]
    seeds = torch.randint(-2 ** 63, 2 ** 63 - 1, (b,), generator=gen)
    positions = torch.randint(0, 10_000, (b,), generator=gen)
    out, expected = run(nv, "sample", logits, temperature, top_k, top_p, seeds, positions)
    assert torch.equal(out.cpu(), expected)
    greedy = temperature < 1e-5
    greedy_out, greedy_ref = run(nv, "sample", logits, torch.zeros(b), top_k, top_p, seeds, positions)
    assert torch.equal(greedy_out.cpu(), greedy_ref) and bool((greedy_ref == 3).all())
    assert torch.equal(out.cpu()[greedy], greedy_ref[greedy])


def test_sample_noise_matches_reference_bits(nv):
    """With flat logits the pick is the argmax of the noise alone: equal tokens over many
    (seed, position) pairs means the SplitMix64 stream is ported bit for bit."""
    b, v = 64, 257
    gen = seeded(17)
    seeds = torch.randint(-2 ** 63, 2 ** 63 - 1, (b,), generator=gen)
    positions = torch.arange(b) * 7919
    args = (torch.zeros(b, v), torch.ones(b), torch.zeros(b, dtype=torch.int64), torch.ones(b), seeds, positions)
    out, expected = run(nv, "sample", *args)
    assert torch.equal(out.cpu(), expected)


@pytest.mark.parametrize("b,v", [(1, 40), (5, 1100)])
def test_apply_token_bitmask(nv, b, v):
    gen = seeded(18, b, v)
    logits = randn(gen, b, v)
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (b, (v + 31) // 32), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    out, expected = logits.clone().to(nv.device), logits.clone()
    nv.apply_token_bitmask(out, bitmask.to(nv.device))
    ref.apply_token_bitmask(expected, bitmask)
    assert torch.equal(out.cpu(), expected)


# ------------------------------------------------------------------ batch invariance


def _rows_alone(fn, batch: torch.Tensor, *rest):
    return torch.cat([fn(batch[r:r + 1], *rest) for r in range(batch.shape[0])])


def test_batch_invariance(nv):
    """Row r's result is bit-identical whether it is computed alone or in a batch of 9."""
    gen = seeded(19)
    x = randn(gen, 9, 3, 96).to(nv.device)
    w = randn(gen, 96).to(nv.device)
    assert torch.equal(nv.rms_norm(x, w, 1e-6), _rows_alone(nv.rms_norm, x, w, 1e-6))

    x = randn(gen, 9, 200).to(nv.device)
    weight = randn(gen, 72, 200).to(nv.device)
    assert torch.equal(nv.linear(x, weight), _rows_alone(nv.linear, x, weight))

    q = randn(gen, 9, 4, 32).to(nv.device)
    kv = randn(gen, 60, 32).to(nv.device)
    idx = indices(gen, 9, 50, 60).to(nv.device)
    sinks = randn(gen, 4).to(nv.device)

    def attend(rows, row_idx):
        return nv.sparse_attention(rows, kv, row_idx, sinks, 0.2)

    alone = torch.cat([attend(q[r:r + 1], idx[r:r + 1]) for r in range(9)])
    assert torch.equal(attend(q, idx), alone)

    # an image's encoder attention does not depend on the other images packed with it
    lens = [20, 70, 9]
    q, k, v = (randn(gen, sum(lens), 2, 16).to(nv.device) for _ in range(3))
    packed = nv.dense_attention(q, k, v, lens, 0.25)
    bounds = [0, 20, 90, 99]
    alone = torch.cat([nv.dense_attention(q[a:b], k[a:b], v[a:b], [b - a], 0.25) for a, b in zip(bounds, bounds[1:])])
    assert torch.equal(packed, alone)


def test_nvidia_without_gpu_or_interpreter_is_a_clear_error(monkeypatch):
    if cuda_usable():
        pytest.skip("a CUDA GPU is present: the nvidia backend is legitimately available")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(AcceleratorUnavailable, match="TRITON_INTERPRET=1"):
        get_accelerator("nvidia")


# ------------------------------------------------------------------ fused composites (base.py)


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("op", FUSED_OPS)
def test_fused_composites(t, op, nv):
    """hc_pre_norm, hc_post_pre_norm, rms_norm_rope, swiglu_mlp and compress_entries: this backend
    runs the base-class composite of its own ops; every output within the composite's tolerance."""
    check_fused(nv, op, t, TOL[op])


# ------------------------------------------------------------------ DeepSeek-V3


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("routing", GROUPED_ROUTINGS, ids=grouped_routing_id)
def test_route_grouped_topk(nv, t, routing):
    check_route_grouped_topk(nv, t, routing, TOL["route_grouped_topk"])


@pytest.mark.parametrize("t", TOKENS)
def test_sparse_attention_without_sink(nv, t):
    check_attention_without_sink(nv, t, TOL["sparse_attention"])


@pytest.mark.parametrize("t", TOKENS)
def test_unclamped_experts(nv, t):
    check_unclamped_experts(nv, t, TOL["moe_experts"])


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("op", V41_OPS)
def test_v41_ops(nv, t, op):
    """DeepSeek-V4.1's ops (tests/op_checks.py: V41_OPS has the tolerances)."""
    check_v41_op(nv, op, t)


# ------------------------------------------------------------------ SamplingParams' logit ops


def test_logit_ops_against_reference(nv):
    """apply_penalties (1e-6 relative), apply_min_p, apply_logit_bias, count_tokens (exact) with pass-through
    rows, repeated ids and -inf entries (tests/logits_checks.py)."""
    check_op_conformance(nv)


@pytest.mark.parametrize("case", range(len(logit_cases())), ids=[c[0] for c in logit_cases()])
def test_logit_ops_against_transformers(nv, case):
    """The same adjusted logits, greedy token and sampled distribution (chi-square) as transformers'
    logits processors (RepetitionPenalty, MinP, NoBadWords, SequenceBias, MinNewTokensLength)."""
    name, temperature, ours, theirs = logit_cases()[case]
    check_case(nv, name, temperature, ours, theirs, seed=100 + case)
