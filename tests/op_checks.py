"""Shared helpers of the op conformance tests (nvidia and ascend vs the cpu reference)."""

from __future__ import annotations

import math

import torch

from deepinfer.backends import get_accelerator
from deepinfer.backends import reference as ref
from deepinfer.backends.base import WeightRole


def poisoned(name: str):
    """Generator for a module fixture: the backend, with every kernel output allocated as NaN so an
    element a kernel fails to write shows up as a mismatch."""
    from deepinfer.backends.triton import alloc

    acc = get_accelerator(name)
    alloc.poison = True
    yield acc
    alloc.poison = False


def seeded(*key: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash(key) & 0xFFFFFFFF)


def randn(generator, *shape, scale=1.0):
    return torch.randn(*shape, generator=generator) * scale


def indices(generator, t, k, pool, frac_invalid=0.3):
    idx = torch.randint(0, pool, (t, k), generator=generator)
    idx[torch.rand(t, k, generator=generator) < frac_invalid] = -1
    return idx


def to_device(acc, *tensors):
    return [t.to(acc.device) if isinstance(t, torch.Tensor) else t for t in tensors]


def run(acc, op, *args):
    """(backend result, cpu reference result) of one op on the same inputs."""
    return getattr(acc, op)(*to_device(acc, *args)), getattr(ref, op)(*args)


def assert_close(op: str, out, expected, tol: float) -> None:
    """max |out - expected| <= tol * max |expected|, no NaN (unwritten elements), same shape."""
    out = out.cpu()
    assert out.shape == expected.shape, f"{op}: shape {tuple(out.shape)} != {tuple(expected.shape)}"
    assert not out.isnan().any(), f"{op}: NaN in output (an element the kernel did not write?)"
    if out.numel() == 0:
        return
    err, scale = float((out - expected).abs().max()), float(expected.abs().max())
    print(f"\n{op}: max rel err {err / max(scale, 1e-30):.2e} (tol {tol:.0e})", end="")
    assert err <= tol * scale, f"{op}: max abs err {err:.2e} > {tol} x max|ref| = {tol * scale:.2e}"


FUSED_OPS = ("hc_pre_norm", "hc_post_pre_norm", "rms_norm_rope", "swiglu_mlp", "compress_entries")


def fused_op_inputs(op: str, t: int) -> tuple:
    """Inputs of the fused sequences (models/deepseek_v4/fused.py; swiglu_mlp: base.py) for t tokens (t windows for
    compress_entries): a backend's version against the cpu reference, like every other op."""
    gen = seeded(40, t, FUSED_OPS.index(op))
    n, d = 4, 48
    hc = (randn(gen, (2 + n) * n, n * d, scale=0.1), randn(gen, (2 + n) * n, scale=0.2), torch.rand(3, generator=gen),
          1e-6, 1e-6, 20)
    streams = randn(gen, t, n, d)
    if op == "hc_pre_norm":
        return (streams, *hc, randn(gen, d))
    if op == "hc_post_pre_norm":
        return (randn(gen, t, d), streams, torch.rand(t, n, generator=gen) * 2, torch.rand(t, n, n, generator=gen),
                *hc, randn(gen, d))
    if op == "rms_norm_rope":
        return randn(gen, t, 3, 32, scale=3.0), randn(gen, 32), 1e-6, randn(gen, t, 4), randn(gen, t, 4)
    if op == "swiglu_mlp":
        return randn(gen, t, d), randn(gen, 2 * 24, d, scale=0.2), randn(gen, d, 24, scale=0.2), 7.0
    # a CSA compressor (rate 4, overlapping windows of 8 staged rows), the first window's previous half absent
    rate, dim = 4, 32
    rows = torch.randint(0, 60, (t, 2 * rate), generator=gen)
    rows[0, :rate] = -1
    return (randn(gen, 60, 4 * dim), rows, randn(gen, rate, 2 * dim), True, randn(gen, dim), 1e-6,
            randn(gen, t, 4), randn(gen, t, 4))


def check_fused(acc, op: str, t: int, tol: float) -> None:
    """A fused sequence on a backend (DeepSeek-V4's composite over its ops, or its own kernel;
    swiglu_mlp: base.py's) against the same on the cpu reference ops: every output."""
    from deepinfer.backends.cpu import CpuAccelerator
    from deepinfer.models.deepseek_v4 import fused

    args = fused_op_inputs(op, t)
    if op == "swiglu_mlp":  # an Accelerator op (with a default composite)
        out, expected = run(acc, op, *args)
    else:
        out, expected = getattr(fused, op)(acc, *to_device(acc, *args)), getattr(fused, op)(CpuAccelerator(), *args)
    out, expected = (out, expected) if isinstance(expected, tuple) else ((out,), (expected,))
    for o, e in zip(out, expected, strict=True):
        assert_close(op, o, e, tol)


# DeepSeek-V3's router (route_grouped_topk) at its shapes: (E, n_group, topk_group, top_k,
# normalize, scaling): group-limited with 4 and 3 groups, no groups (n_group 1), V3's own 256/8/4/8.
GROUPED_ROUTINGS = [(16, 4, 2, 4, True, 2.5), (12, 3, 2, 3, True, 2.0), (8, 1, 1, 3, False, 1.5),
                    (256, 8, 4, 8, True, 2.5)]


def grouped_routing_id(routing) -> str:
    return "E{}_g{}_kg{}_k{}_norm{}_s{}".format(*routing)


def check_route_grouped_topk(acc, t: int, routing, tol: float) -> None:
    """A backend's route_grouped_topk against the reference: the same experts per token (as a set:
    the column order is unspecified) and their weights within tol. The bias is on the scale of the
    scores, so it and the group limit both change which experts win."""
    e, g, kg, k, norm, scaling = routing
    gen = seeded(41, t, *routing)
    args = (randn(gen, t, 64), randn(gen, e, 64, scale=0.3), randn(gen, e, scale=0.1), k, g, kg, norm, scaling)
    (w, ids), (rw, rids) = run(acc, "route_grouped_topk", *args)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == (t, k)
    order, rorder = ids.cpu().argsort(-1), rids.argsort(-1)
    assert torch.equal(ids.cpu().gather(1, order), rids.gather(1, rorder))
    assert_close("route_grouped_topk", w.cpu().gather(1, order), rw.gather(1, rorder), tol)


def check_attention_without_sink(acc, t: int, tol: float) -> None:
    """sparse_attention with sinks = -inf (DeepSeek-V3's MLA: a plain softmax over the indices), over
    a latent-shaped pool (head dim c + dr, not a power of two) with index lists whose first blocks are
    absent for some tokens; a token with no valid index gets zeros."""
    gen = seeded(42, t)
    h, d, k, pool = 4, 40, 100, 120
    idx = indices(gen, t, k, pool)
    # every key block of 64 (cpu) or 32 (Triton) columns absent for some tokens but not for others
    idx[:, :70] = torch.where(torch.arange(t)[:, None] % 2 == 0, -1, idx[:, :70])
    idx[0] = -1
    args = (randn(gen, t, h, d), randn(gen, pool, d), idx, torch.full((h,), float("-inf")), 0.135)
    out, expected = run(acc, "sparse_attention", *args)
    assert_close("sparse_attention", out, expected, tol)
    assert out.cpu()[0].abs().max() == 0 and not expected.isnan().any()


def check_unclamped_experts(acc, t: int, tol: float) -> None:
    """swiglu, moe_experts and swiglu_mlp with limit = inf (DeepSeek-V3's plain SwiGLU), on inputs
    large enough that any finite clamp would bite."""
    gen = seeded(43, t)
    e, k, d, inter = 8, 2, 40, 24
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    x, gate_up, down = randn(gen, t, d, scale=4.0), randn(gen, e, 2 * inter, d, scale=0.5), randn(gen, e, d, inter)
    weights = torch.rand(t, k, generator=gen)
    stacks = [acc.prepare_weight(w, WeightRole.EXPERTS) for w in (gate_up, down)]  # the backend's layout
    assert_close("moe_experts", acc.moe_experts(*to_device(acc, x, weights, ids), *stacks, math.inf),
                 ref.moe_experts(x, weights, ids, gate_up, down, math.inf), tol)
    assert_close("swiglu_mlp", *run(acc, "swiglu_mlp", x, gate_up[0], down[0], math.inf), tol)
    gate, up = randn(gen, t, inter, scale=30.0), randn(gen, t, inter, scale=30.0)
    out, expected = run(acc, "swiglu", gate, up, math.inf)
    assert_close("swiglu", out, expected, tol)
    assert torch.equal(expected, torch.nn.functional.silu(gate) * up)


# DeepSeek-V4.1's ops: its quantize-dequantize points (bit-exact everywhere), the lagged mHC split
# (mixes, collapse), the indexer's bf16-rounded scores and its bf16-probability sparse attention.
# op -> tolerance (as assert_close; 0.0 = bit for bit; "ulp": within 1 bf16 ulp of the reference).
# sparse_attention_bf16: an exp one float32 ulp off can move a probability across a bf16 rounding
# boundary, one bf16 ulp of that probability times a value (measured 4.5e-5 relative, interpreter).
V41_OPS = {"fp8_qdq": 0.0, "fp4_qdq": 0.0, "fp4_qdq_e4m3": 0.0, "hc_mixes": 1e-5, "hc_collapse": 1e-6,
           "indexer_scores": "ulp", "sparse_attention_bf16": 1e-4}


def v41_op_inputs(op: str, t: int) -> tuple:
    """Inputs for t tokens. The quantizers get values over 20 binades, exact zeros, an all-zero group,
    values at the FP8 limit and e2m1 midpoints (ties), in groups that split rows unevenly. The
    attention and the indexer get bf16 values (what V4.1 feeds them), index lists with -1 entries and
    one token with none, over more than one 64-index block."""
    gen = seeded(41, t, list(V41_OPS).index(op))
    if op.startswith("fp"):
        x = randn(gen, t, 96) * torch.exp2(torch.randint(-10, 10, (t, 96), generator=gen).float())
        x[0, :32] = 0.0
        x[-1, 32:36] = torch.tensor([448.0, -448.0, 0.75, 2.5]) * 2.0 ** 5
        x[:, 40] = 0.0
        return (x, 16 if op == "fp4_qdq_e4m3" else 32) + ((True,) if op == "fp4_qdq_e4m3" else ())
    if op in ("hc_mixes", "hc_collapse"):
        n, d = 4, 48
        streams = randn(gen, t, n, d)
        if op == "hc_collapse":
            return streams, torch.rand(t, n, generator=gen) + 0.5
        return (streams, randn(gen, (2 + n) * n, n * d, scale=0.1), randn(gen, (2 + n) * n, scale=0.2),
                torch.rand(3, generator=gen), 1e-20, 1e-6, 20)
    bf16 = lambda x: x.to(torch.bfloat16).float()  # noqa: E731
    if op == "indexer_scores":
        cand = indices(gen, t, 70, 60)
        cand[0] = -1
        return bf16(randn(gen, t, 8, 32)), bf16(randn(gen, t, 8) * 0.0625), bf16(randn(gen, 60, 32)), cand
    idx = indices(gen, t, 150, 90)
    idx[0] = -1
    return bf16(randn(gen, t, 6, 64)), bf16(randn(gen, 90, 64)), idx, randn(gen, 6), 64 ** -0.5


def check_v41_op(acc, op: str, t: int) -> None:
    """A V4.1 op on a backend against the cpu reference on the same inputs: every output."""
    name = "fp4_qdq" if op == "fp4_qdq_e4m3" else op
    out, expected = run(acc, name, *v41_op_inputs(op, t))
    out, expected = (out, expected) if isinstance(expected, tuple) else ((out,), (expected,))
    for o, e in zip(out, expected, strict=True):
        o = o.cpu()
        if op == "indexer_scores":  # -inf exactly where the reference has it, finite values close
            assert torch.equal(torch.isinf(o), torch.isinf(e)), f"{op}: -inf pattern differs"
            o, e = o.masked_fill(torch.isinf(e), 0.0), e.masked_fill(torch.isinf(e), 0.0)
        if V41_OPS[op] == "ulp":  # bf16 outputs: at most one bf16 ulp apart (the head sum's order)
            step = torch.exp2(torch.floor(torch.log2(e.abs().clamp_min(1e-30))) - 7)
            assert bool(((o - e).abs() <= step).all()), f"{op}: more than 1 bf16 ulp from the reference"
        elif V41_OPS[op] == 0.0:  # bit for bit (the sign of zero included)
            assert o.dtype == e.dtype and torch.equal(o.view(torch.int32), e.view(torch.int32)), f"{op}: bits differ"
        else:
            assert_close(op, o, e, V41_OPS[op])


# moe_experts_bf16 (DeepSeek-V4.1's routed experts): every backend's kernel against the base class's
# composite on the cpu reference ops, on the stored stacks. Measured: bit-identical on every case here
# (nvidia interpreter, ascend shim, cpu kernels): FP8 / FP4 values times FP8 inputs sum exactly in
# float32, and the bf16 and FP8 roundings absorb the rest. Not guaranteed: an exp one float32 ulp off
# in the SwiGLU can move one intermediate element across an e4m3 step (1/8 of it), one column of the
# down projection times that. So: at most MOE_BF16_MISMATCH of the elements may differ at all, each
# within MOE_BF16_TOL x max|ref| (assert_close). A misplaced rounding or routing weight, or another
# summation order, changes far more elements (tests/unit/test_quant_kernels.py shows it fails).
MOE_BF16_TOL = 5e-2
MOE_BF16_MISMATCH = 0.01
MOE_BF16_KINDS = ("f32", "bf16", "fp8_32_ue8m0", "fp8_128_f32", "fp4_ue8m0")


def moe_bf16_case(kind: str, t: int, seed: int = 3) -> tuple:
    """(x, weights, ids, gate_up, down): t tokens of bf16 values, k = 3 of 8 experts per token (expert 7
    never routed to, others shared by several tokens), D = 96, I = 64 (act_block 32 divides both);
    stacks stored as `kind` ("f32": float32)."""
    from quant_checks import weight_kinds

    gen = seeded(61, t, seed)
    e, k, d, inter = 8, 3, 96, 64
    gu = torch.randn(e, 2 * inter, d, generator=gen) * 0.15
    dn = torch.randn(e, d, inter, generator=gen) * 0.15
    if kind != "f32":
        gu, dn = weight_kinds(gu)[kind], weight_kinds(dn)[kind]
    x = (torch.randn(t, d, generator=gen) * 2.0).bfloat16().float()
    ids = torch.stack([torch.randperm(e - 1, generator=gen)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=gen) * 2.0
    return x, weights, ids, gu, dn


def moe_bf16_reference(x, weights, ids, gate_up, down, limit, act_block) -> torch.Tensor:
    """The definition: base.py's composite on the cpu reference ops."""
    from deepinfer.backends.cpu import CpuAccelerator

    return CpuAccelerator().moe_experts_bf16(x, weights, ids, gate_up, down, limit, act_block)


def assert_moe_bf16(name: str, out: torch.Tensor, expected: torch.Tensor) -> None:
    out = out.cpu()
    differ = float((out != expected).float().mean()) if out.shape == expected.shape else 1.0
    print(f"\n{name}: {differ:.2%} of the elements differ", end="")
    assert differ <= MOE_BF16_MISMATCH, f"{name}: {differ:.2%} of the elements differ (> {MOE_BF16_MISMATCH:.0%})"
    assert_close(name, out, expected, MOE_BF16_TOL)


def check_moe_experts_bf16(acc, kind: str, t: int, act_block: int) -> None:
    """The backend's moe_experts_bf16 on its prepared stacks (WeightRole.EXPERTS) against the definition;
    limit 1.5 so the SwiGLU clamps bite."""
    x, weights, ids, gu, dn = moe_bf16_case(kind, t)
    stacks = [acc.prepare_weight(w, WeightRole.EXPERTS) for w in (gu, dn)]
    out = acc.moe_experts_bf16(*to_device(acc, x, weights, ids), *stacks, 1.5, act_block)
    assert_moe_bf16(f"moe_experts_bf16 {kind} T={t} act_block={act_block}", out,
                    moe_bf16_reference(x, weights, ids, gu, dn, 1.5, act_block))
